"""export_checkpoint: a Hugging Face checkpoint -> a serving artifact, through `stage` like any authored model.

The family table reads the checkpoint into the built-in decoder's config and weight slots; this module
declares the decoder's pools (full-history pages, the sliding layers' rings, the linear layers' state
slots) and stages `decoder.forward` over them.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Sequence

from tlaloc_jax import manifest as mf
from tlaloc_jax.checkpoint import load_checkpoint, weight_dtype
from tlaloc_jax.config import SLIDING, DecoderConfig
from tlaloc_jax.decoder import DEFAULT_KEY_BLOCK, forward
from tlaloc_jax.plan import layer_plan
from tlaloc_jax.paging import ring_pages_for

from ._entries import ExportError
from ._pools import PagedKV, PoolSpec, RingKV, StateSlots
from ._stage import Sampler, _ladder, stage


def decoder_pools(cfg: DecoderConfig, *, windowed: bool, kv_dtype: str, ring_pages: int) -> dict[str, PoolSpec]:
    """The built-in decoder's pools, as its layer plan orders them: "kv" (full-history pages), "window_kv" (the
    sliding layers' rings, when windowed), "conv" and "recurrent" (the linear layers' states, f32)."""
    plan = layer_plan(cfg, windowed)
    K, D = cfg.num_kv_heads, cfg.head_dim
    specs: dict[str, PoolSpec] = {}
    for name in plan.pool_names():
        ids = plan.pool_layers(name)
        if name == "kv":
            specs[name] = PagedKV(len(ids), K, D, kv_dtype, layer_ids=ids)
        elif name == "window_kv":
            specs[name] = RingKV(len(ids), K, D, cfg.sliding_window, kv_dtype, ring_pages=ring_pages, layer_ids=ids)
        elif name == "conv":
            specs[name] = StateSlots((cfg.conv_channels, cfg.linear_conv_kernel - 1), "float32", len(ids), ids)
        elif name == "recurrent":
            specs[name] = StateSlots((cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim), "float32",
                                     len(ids), ids)
        else:
            raise ExportError(f"the decoder's layer plan names pool {name!r}, which export_checkpoint cannot declare")
    return specs


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      batch_ladder: Sequence[int] = (1, 2, 4), context_ladder: Sequence[int] = (64, 256, 1024),
                      prefill_max_batch: int | None = None, prefill_chunk: int | None = None,
                      block_size: int = 16, num_blocks: int | None = None, weight_dtype_name: str = "float32",
                      kv_dtype: str = "float32", attention_block: int = DEFAULT_KEY_BLOCK,
                      windowed_kv: bool = True, window_blocks: int | None = None, state_slots: int | None = None,
                      platform: str = "cpu", progress: bool = True, sampler: Sampler | None = None,
                      allow_longer_context: bool = False, decode_steps: int = 1) -> mf.Manifest:
    """Write the serving artifact of a checkpoint to `out_dir` and return its manifest (tlaloc-serving-v4).

    One decode and one prefill entry per (batch, context) point of the ladders (prefill batches capped by
    prefill_max_batch, tokens per call by prefill_chunk), each a jax.export body with the pools donated;
    weights as raw little-endian files ([in, out] for linears); the tokenizer files copied in.

    A model with sliding-window layers keeps them in a ring pool unless windowed_kv is False: each sequence
    keeps a ring of ceil((window - 1 + N) / block_size) pages for those layers (N the longest call: the
    prefill chunk, else the largest context), capped at a whole context's pages; the ring pool holds
    window_blocks pages (default: a ring for each sequence the full pool holds at the largest context).
    A model with linear-attention layers keeps their states in state_slots slots (default: as many sequences
    as the full pool holds at the largest context).
    sampler: `Sampler()` stages the sampler in every entry (see `stage`). A context ladder past the
    checkpoint's max_position_embeddings is refused unless allow_longer_context, which warns instead.
    decode_steps: K > 1 adds a K-step decode entry beside each decode entry (see `stage`).
    """
    contexts = _ladder(context_ladder, "context ladder")
    if block_size <= 0 or attention_block % block_size:
        raise ExportError(f"attention block {attention_block} is not a multiple of the block size {block_size}")
    kv_np = weight_dtype(kv_dtype)       # the same dtypes are allowed for KV pools
    cfg, weights = load_checkpoint(checkpoint_dir, weight_dtype_name)
    if contexts[-1] > cfg.max_position_embeddings:
        why = (f"the context ladder reaches {contexts[-1]} positions, past the checkpoint's max_position_embeddings "
               f"({cfg.max_position_embeddings}): the model was not trained for positions that far and its output "
               "there is not to be trusted")
        if not allow_longer_context:
            raise ExportError(f"{why}; lower the context ladder, or pass allow_longer_context=True "
                              "(--allow-longer-context) to export it anyway")
        warnings.warn(why, stacklevel=2)
    windowed = windowed_kv and SLIDING in cfg.layer_types
    ring = 0
    if windowed:
        chunk = int(prefill_chunk or 0)
        ring = ring_pages_for(cfg.sliding_window, chunk or contexts[-1], block_size, contexts[-1] // block_size)
    pools = decoder_pools(cfg, windowed=windowed, kv_dtype=kv_np.name, ring_pages=ring)
    step = functools.partial(forward, cfg, key_block=attention_block, ring_pages=ring)
    describe = dict(layers=cfg.num_layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    hidden=cfg.hidden_size, weight_dtype=weight_dtype_name, kv_dtype=kv_np.name)
    return stage(step, weights, pools, out_dir, batch_ladder=batch_ladder, context_ladder=contexts,
                 prefill_chunk=prefill_chunk, prefill_max_batch=prefill_max_batch, block_size=block_size,
                 num_blocks=num_blocks, ring_blocks=window_blocks, state_slots=state_slots, platform=platform,
                 name=cfg.name or Path(checkpoint_dir).name, model_type=cfg.model_type,
                 eos_token_ids=cfg.eos_token_ids, refused_tokens=cfg.refused_tokens, tokenizer_dir=checkpoint_dir,
                 embedding_slot="embed", describe=describe, attention_block=attention_block, progress=progress,
                 sampler=sampler, decode_steps=decode_steps)
