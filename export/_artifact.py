"""export_checkpoint: a Hugging Face checkpoint -> a serving artifact, through `stage` like any authored model.

The family table reads the checkpoint into the built-in decoder's config and weight slots; this module stages
`decoder.forward` over the decoder's pools (decoder.decoder_pools: full-history pages, the sliding layers' rings,
the linear layers' state slots).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Sequence

from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import read_config, weight_dtype
from tlaloc_jax.config import SLIDING, ConfigError, DecoderConfig
from tlaloc_jax.decoder import (DEFAULT_KEY_BLOCK, decoder_pools, final_hidden, forward, logits_from_hidden,
                                supports_mixed_calls)
from tlaloc_jax.kernels import paged_attention_gpu, paged_attention_native
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.layout import LAYOUTS
from tlaloc_jax.lora import LORA_DTYPE, decoder_lora
from tlaloc_jax.mtp_head import POOL as MTP_POOL
from tlaloc_jax.serve.core.paging import ring_pages_for
from tlaloc_jax.sharding import ShardingError, local_config, shard_decoder_weights

from ._entries import ExportError
from ._mesh import weight_split_axes
from ._mtp_entries import checkpoint_mtp
from ._options import (DEFAULT_BATCH_LADDER, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_LONG_CHUNK, Capacity, Features,
                       Ladders, ModelInfo, Sampler, SplitStep)
from ._checkpoint_weights import loaded_weights, streamed_weights
from ._quant import check_prequantized, head_quant_for, prequantized_config, scheme_label
from ._stage import sorted_ladder, stage
from ._verify import with_projections
from ._weights import flatten_weights


def tensor_parallel_decoder(cfg: DecoderConfig, weights: dict, n: int) -> tuple[dict, DecoderConfig, dict | None]:
    """The built-in decoder's (weights, step config, weight split axes) for `stage(..., mesh=n)`: fused projections
    stored shard-major, the config of one device's shard, each weight's split axis (tlaloc_jax.sharding). n = 1:
    the weights and config as they are, no split axes. A model whose counts do not divide n is refused by name."""
    if n == 1:
        return weights, cfg, None
    try:
        weights = shard_decoder_weights(cfg, weights, n)
        return weights, local_config(cfg, n), weight_split_axes(weights, flatten_weights)
    except ShardingError as e:
        raise ExportError(str(e)) from None


# The decode attention of cuda exports when none is asked for. A default is what a GPU run has measured correct and
# faster: plain ops until `python -m bench.gpu run` records the Pallas kernel's verdict in docs/gpu.md (its test reads it).
CUDA_DECODE_ATTENTION = "xla"
# The decode attention of cpu exports when none is asked for, where the model's attention fits it: the C kernel
# (kernels/decode_attention.c), measured faster than plain ops in the served step at 4 to 32 rows and equal at one
# (bench/decode_forms.py, deleted in 82403e3; docs/cpu.md); the serving machine then needs a C compiler. Latent
# attention, fp8 KV pools and head shapes it does not take get plain ops.
CPU_DECODE_ATTENTION = "native"
# The projections of cpu exports when none is asked for: the C kernel where NATIVE_ROWS takes a call's rows and
# weight dtype (bf16 and int8 weights, which XLA's forms read far below the read rate; f32 up to 32 rows), measured
# faster than XLA's forms through the runtime's plugin (docs/cpu.md, "Kernels outside XLA").
CPU_PROJECTIONS = "native"
# The entry sets an export writes (export_checkpoint's entries).
ENTRY_FORMS = ("default", "flat")


def decode_top_context(decode_attention: str, ring_pages: int) -> bool:
    """Whether a decode (decode_steps, verify) call's work is the same at every context of the ladder for the same
    rows: every attention layer decodes with the native kernel, which loops over each row's own keys (the bucket
    sets only its block table's width); linear layers' states have no bucket. A ring layer (plain ops) scores
    min(bucket, ring) pages in one pass; plain ops and the Pallas kernel are not claimed here (not measured on
    every platform they serve), so they keep one entry per context."""
    return decode_attention == "native" and not ring_pages


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      batch_ladder: Sequence[int] = DEFAULT_BATCH_LADDER,
                      context_ladder: Sequence[int] = (64, 256, 1024),
                      prefill_max_batch: int | None = None, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                      prefill_long_chunk: int | None = DEFAULT_PREFILL_LONG_CHUNK,
                      block_size: int = 16, num_blocks: int | None = None, weight_dtype_name: str = "float32",
                      kv_dtype: str = "float32", attention_block: int = DEFAULT_KEY_BLOCK,
                      windowed_kv: bool = True, window_blocks: int | None = None, state_slots: int | None = None,
                      platform: str = "cpu", progress: bool = True, sampler: Sampler | None = None,
                      allow_longer_context: bool = False, prompt_logprobs: int | None = None,
                      decode_attention: str | None = None, weight_layout: str = "per-layer",
                      weight_quant: str = "none", quant_group: int = 128, head_quant: str | None = None,
                      decode_steps: int = 1,
                      mixed: bool | None = None, packed: bool | None = None, entries: str = "default",
                      tensor_parallel: int = 1, projections: str | None = None, mlir: bool = False,
                      exported: bool = False, max_loras: int = 0, max_lora_rank: int = 16,
                      lora_target_modules: Sequence[str] | None = None, lora_dtype: str | None = None,
                      speculative_tokens: int = 0, decode_contexts: str | None = None) -> af.Manifest:
    """Write the serving artifact of a checkpoint to `out_dir` and return its manifest (tlaloc-serving-v5).

    One decode and one prefill entry per (batch, context) point of the ladders (prefill batches capped by
    prefill_max_batch, tokens per call by prefill_chunk; one more one-row prefill entry of prefill_long_chunk tokens
    per context for a prompt read alone; decode entries as decode_contexts says), each a jax.export body with the
    pools donated;
    weights as raw little-endian files (projections [out, in] in the per-layer layout, [in, out] when stacked or
    quantized); the tokenizer files copied in.

    A model with sliding-window layers keeps them in a ring pool unless windowed_kv is False: each sequence
    keeps a ring of ceil((window - 1 + N) / block_size) pages for those layers (N the longest call: the
    prefill chunk, else the largest context), capped at a whole context's pages; the ring pool holds
    window_blocks pages (default: a ring for each sequence the full pool holds at the largest context).
    A model with linear-attention layers keeps their states in state_slots slots (default: as many sequences
    as the full pool holds at the largest context, plus up to 4 spares for state snapshots).
    weight_layout: "per-layer" (one array per layer, q|k|v and gate|up fused, layers unrolled) or "stacked"
    (scanned stacks): see tlaloc_jax/layout.py.
    sampler: `Sampler()` stages the sampler in every entry (see `stage`). A context ladder past the
    checkpoint's max_position_embeddings is refused unless allow_longer_context, which warns instead.
    prompt_logprobs: N adds a scoring prefill entry beside each prefill entry, returning per prompt position the
    next token's logprob and rank and the N top logprobs (see `stage`, SplitStep); None adds none.
    decode_attention: how decode entries attend over their pages: "xla" (plain ops), "native" (a C kernel,
    kernels/decode_attention.c; cpu only; the serving runtime builds it with its C compiler; ring layers keep plain ops) or
    "pallas" (the Pallas GPU kernel, lowered through Triton; cuda only). None: CPU_DECODE_ATTENTION on cpu where the
    model's attention fits it (else "xla"), CUDA_DECODE_ATTENTION on cuda. Prefill entries use plain ops either way.
    projections: "native" (the C kernel, kernels/projection.c; cpu only, one device) for the calls whose
    rows and weight dtype it takes (kernels.projection_native.NATIVE_ROWS), or "xla" (XLA's forms); None:
    CPU_PROJECTIONS on cpu with one device, else "xla".
    weight_quant "int8", "fp8" or "int4" (groups of quant_group input channels) stores the projections as codes
    and scales quantized from the checkpoint's f32 values (export/_quant.py); kv_dtype "float8_e4m3fn" stores the
    KV pools as e4m3fn codes. head_quant: the output head's scheme, "int8" (per output channel) or "none" (the
    weight dtype); None: int8 where weight_quant is int4 or uint4, else none (export/_quant.py, head_quant_for).
    The model's name then ends in ":q<scheme>" and ":kvfp8".
    decode_steps: K > 1 adds a K-step decode entry beside each decode entry (see `stage`).
    mixed: adds mixed entries, the running sequences' decode rows and one prompt chunk in one call (see
    `Features`); None: where the decoder runs them (decoder.supports_mixed_calls), False: none.
    packed: the prefill entries of several rows are packed prefills, which compute their rows' tokens and not
    their padding (see `Features`); None: where the decoder runs them (as mixed), False: plain prefill entries.
    entries: "default" (the entries above) or "flat": only packed prefills, one per context and token bucket, whose
    tokens each attend as a row of their own (see `Features.flat`); for models of attention layers only.
    tensor_parallel: N > 1 stages every entry for N devices, each holding 1/N of the heads, KV heads, MLP width
    and experts (tlaloc_jax.sharding; docs/multi-device.md); a model whose counts do not divide is refused.
    mlir, exported: also write each body's `.mlir` and `.exported` (see `stage`); the runtime needs neither.
    max_loras: N > 0 stages N LoRA adapter slots of rank at most max_lora_rank on lora_target_modules (PEFT's
    module names, tlaloc_jax.lora.DECODER_TARGETS; None: every one the model has) in every entry, their A and B in
    lora_dtype ("float32" or "bfloat16"; None: LORA_DTYPE); the runtime loads adapters into them.
    speculative_tokens: K > 0 adds a verify entry per decode point, for speculative decoding of up to K drafted
    tokens a step (see `Features`; state pools keep the accepted position's state). From a checkpoint with an MTP
    head (DeepSeek-V3's num_nextn_predict_layers, Qwen3-Next's mtp.*) it also stages the head's mtp entries
    (export/_mtp_entries.py).
    decode_contexts: where the decode, decode_steps and verify entries sit on the context ladder: "top" (its
    largest context alone: a decode call there costs what one at a shorter context does for the same rows, since
    the native kernel loops over each row's own keys), "every" (each context); None: "top" where every attention
    layer decodes with the native kernel (decode_top_context), else "every".
    """
    if entries not in ENTRY_FORMS:
        raise ExportError(f"entries {entries!r} is not one of {', '.join(ENTRY_FORMS)}")
    flat = entries == "flat"
    if flat and (mixed or packed is False or decode_steps != 1):
        raise ExportError("entries 'flat' runs every call as a packed prefill: drop mixed, packed=False "
                          "(--no-mixed, --no-packed) and decode_steps (--decode-steps), or export entries 'default'")
    asked = decode_attention
    decode_attention = decode_attention or (CUDA_DECODE_ATTENTION if platform == "cuda" else CPU_DECODE_ATTENTION)
    if decode_attention not in ("native", "pallas", "xla"):
        raise ExportError(f"decode_attention {decode_attention!r} is not one of native, pallas, xla")
    if decode_attention == "native" and platform != "cpu":
        raise ExportError(f"decode_attention 'native' is a C kernel for the CPU; platform {platform!r} takes "
                          "decode_attention 'xla' or 'pallas'")
    if decode_attention == "pallas" and platform != "cuda":
        raise ExportError(f"decode_attention 'pallas' lowers through Triton, which only the cuda plugin compiles; "
                          f"platform {platform!r} takes decode_attention 'xla'")
    if projections not in (None, "native", "xla"):
        raise ExportError(f"projections {projections!r} is not one of native, xla")
    if projections == "native" and (platform != "cpu" or tensor_parallel > 1):
        raise ExportError("projections 'native' is a C kernel for the CPU on one device; "
                          f"platform {platform!r} with tensor_parallel {tensor_parallel} takes projections 'xla'")
    projections = projections or (CPU_PROJECTIONS if platform == "cpu" and tensor_parallel == 1 else "xla")
    contexts = sorted_ladder(context_ladder, "context ladder")
    if block_size <= 0 or attention_block % block_size:
        raise ExportError(f"attention block {attention_block} is not a multiple of the block size {block_size}")
    if weight_layout not in LAYOUTS:
        raise ExportError(f"unknown weight layout {weight_layout!r}: one of {', '.join(LAYOUTS)}")
    kv_np = af.numpy_dtype(kv_dtype) if kv_dtype == "float8_e4m3fn" else weight_dtype(kv_dtype)
    quantized = weight_quant != "none"
    stored = prequantized_config(checkpoint_dir, weight_quant)      # a pre-quantized checkpoint's, or None
    if tensor_parallel > 1 and (quantized or stored):
        raise ExportError(f"weight_quant {weight_quant!r} with tensor_parallel {tensor_parallel}: quantized weights "
                          "are not split over devices yet; stage them on one device")
    fam, cfg = config_from_hf(read_config(checkpoint_dir))
    # One device streams each weight file from the checkpoint as it is written (a pre-quantized checkpoint's codes
    # too); a mesh splits host arrays.
    read = loaded_weights if tensor_parallel > 1 else streamed_weights
    asked_head, head_quant = head_quant, head_quant_for(weight_quant, head_quant)
    if head_quant != "none" and cfg.tie_word_embeddings:
        if asked_head is not None:
            raise ExportError(f"head_quant {head_quant!r}: this model's head is its embedding (tie_word_embeddings), "
                              "which stays in the weight dtype; export it with head_quant 'none'")
        head_quant = "none"
    weights = read(checkpoint_dir, fam, cfg, dtype=weight_dtype_name, layout=weight_layout, quant=weight_quant,
                   group=quant_group, head=head_quant)
    cfg = cfg.with_context(contexts[-1])
    if flat and not supports_mixed_calls(cfg):
        raise ExportError(f"entries 'flat' runs packed calls, which {cfg.model_type} (linear or latent attention "
                          "layers) cannot: export entries 'default'")
    name = cfg.name or Path(checkpoint_dir).name
    if stored:
        name += f":q{check_prequantized(weights, stored, progress=progress)}"
    if quantized:
        name += f":q{scheme_label(weight_quant, quant_group)}"
    if kv_dtype == "float8_e4m3fn":
        name += ":kvfp8"
    weights, shard_cfg, split_axes = tensor_parallel_decoder(cfg, weights, tensor_parallel)
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
    if decode_attention == "native":
        why = (f"it has no latent-attention form ({cfg.model_type})" if cfg.latent else
               f"tensor_parallel {tensor_parallel} (the kernel is not run over a mesh yet)" if tensor_parallel > 1 else
               paged_attention_native.refusal(1, shard_cfg.num_heads, shard_cfg.num_kv_heads, cfg.head_dim, kv_np))
        if why and asked is None:
            decode_attention = "xla"
        elif why:
            raise ExportError(f"the native decode-attention kernel cannot serve this model: {why}; export with "
                              "decode_attention='xla' (--decode-attention xla)")
    top = decode_top_context(decode_attention, ring)
    if decode_contexts not in (None, "top", "every"):
        raise ExportError(f"decode_contexts {decode_contexts!r} is not one of top, every")
    if decode_contexts == "top" and not top:
        raise ExportError("decode_contexts 'top' stages decode entries at the largest context alone, for decode "
                          "calls whose cost does not depend on the bucket: the native decode attention without "
                          f"sliding-window rings; this export has decode attention {decode_attention!r}"
                          + (" and rings (a ring scores min(bucket, ring) pages)" if ring else "")
                          + ": use decode_contexts 'every' (--decode-contexts every)")
    if decode_attention == "pallas" and cfg.latent:
        raise ExportError(f"the Pallas GPU decode-attention kernel has no latent-attention form ({cfg.model_type}); "
                          "export with decode_attention='xla' (--decode-attention xla)")
    if decode_attention == "pallas":
        why = paged_attention_gpu.refusal(1, shard_cfg.num_heads, shard_cfg.num_kv_heads, cfg.head_dim, block_size,
                                          kv_np)
        if why:
            raise ExportError(f"the Pallas GPU decode-attention kernel cannot serve this model: {why}; export with "
                              "decode_attention='xla' (--decode-attention xla)")
    try:
        lora = decoder_lora(shard_cfg, max_loras, max_lora_rank,
                            tuple(lora_target_modules) if lora_target_modules else None,
                            lora_dtype or LORA_DTYPE) if max_loras else None
    except ConfigError as e:
        raise ExportError(str(e)) from None
    # An MTP head is staged where speculation is asked on one device without adapters and the checkpoint has one
    # (export/_mtp_entries.py): its pool beside the decoder's, and the decoder's final-normed hidden states.
    mtp = checkpoint_mtp(checkpoint_dir, fam, cfg, weights, dtype=weight_dtype_name, kv_dtype=kv_np.name,
                         key_block=attention_block) if speculative_tokens and tensor_parallel == 1 and not max_loras \
        else None
    if mtp is not None:
        pools[MTP_POOL] = mtp.pool
    # The decoder's step norms only each row's last token; prompt scoring reads every position's hidden state.
    # On a mesh each device runs the config of its shard (tlaloc_jax.sharding.local_config).
    hidden = functools.partial(final_hidden, shard_cfg, key_block=attention_block, ring_pages=ring, all_positions=True)
    head = functools.partial(logits_from_hidden, shard_cfg)
    # A verify call runs the decode entries' projections and attention kernels on its k + 1 tokens a row, so that
    # it costs about what a decode call does and rounds as one does.
    verify = SplitStep(hidden=with_projections(functools.partial(hidden, decode_attention=decode_attention,
                                                                 query_rows=True), projections),
                       head=with_projections(head, projections), state_positions=True)
    step = SplitStep(hidden=hidden, head=head, state_positions=True, verify=verify,
                     last=functools.partial(forward, shard_cfg, key_block=attention_block, ring_pages=ring,
                                            decode_attention=decode_attention, projections=projections,
                                            packed_attention="tokens" if flat else "rows"))
    kv_heads, head_dim = (1, cfg.latent_width) if cfg.latent else (cfg.num_kv_heads, cfg.head_dim)
    model = ModelInfo(name=name, model_type=cfg.model_type, tokenizer_dir=checkpoint_dir, embedding_slot="embed",
                      eos_token_ids=cfg.eos_token_ids, refused_tokens=cfg.refused_tokens, layers=cfg.num_layers,
                      heads=cfg.num_heads, kv_heads=kv_heads, head_dim=head_dim, hidden=cfg.hidden_size,
                      weight_dtype=weight_dtype_name, kv_dtype=kv_np.name, attention_block=attention_block)
    return stage(step, weights, pools, out_dir, platform=platform, progress=progress, model=model,
                 ladders=Ladders(batch=batch_ladder, context=contexts, prefill_chunk=prefill_chunk,
                                 prefill_max_batch=prefill_max_batch, prefill_long_chunk=prefill_long_chunk),
                 capacity=Capacity(block_size=block_size, paged_kv=num_blocks, ring_kv=window_blocks,
                                   state_slots=state_slots),
                 features=Features(sampler=sampler, prompt_logprobs=prompt_logprobs, decode_steps=decode_steps,
                                   mixed=not flat and (supports_mixed_calls(cfg) if mixed is None else mixed),
                                   packed=supports_mixed_calls(cfg) if packed is None else packed, flat=flat,
                                   speculative_tokens=speculative_tokens,
                                   decode_top_context=top if decode_contexts is None else decode_contexts == "top"),
                 mesh=tensor_parallel if tensor_parallel > 1 else None, weight_split_axes=split_axes, mlir=mlir,
                 exported=exported, lora=lora, mtp=mtp)
