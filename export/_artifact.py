"""export_checkpoint: a Hugging Face checkpoint -> a serving artifact directory (manifest v2)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Sequence

import jax
import jaxlib
import numpy as np
from tqdm.auto import tqdm

from tlaloc_jax import manifest as mf
from tlaloc_jax.checkpoint import load_checkpoint, weight_dtype
from tlaloc_jax.config import LINEAR, SLIDING
from tlaloc_jax.decoder import DEFAULT_KEY_BLOCK, pool_of, pool_shapes
from tlaloc_jax.paging import ring_pages_for

from ._entries import POOL_ROLES, ExportError, Layout, entry_signature, export_entry, plan_entries

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


def _ladder(values: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(sorted(set(int(v) for v in values)))
    if not out or out[0] <= 0:
        raise ExportError(f"{what} must hold positive integers, got {list(values)}")
    return out


def _write(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      batch_ladder: Sequence[int] = (1, 2, 4), context_ladder: Sequence[int] = (64, 256, 1024),
                      prefill_max_batch: int | None = None, prefill_chunk: int | None = None,
                      block_size: int = 16, num_blocks: int | None = None, weight_dtype_name: str = "float32",
                      kv_dtype: str = "float32", attention_block: int = DEFAULT_KEY_BLOCK,
                      windowed_kv: bool = True, window_blocks: int | None = None,
                      platform: str = "cpu", progress: bool = True) -> mf.Manifest:
    """Write the serving artifact of a checkpoint to `out_dir` and return its manifest.

    One decode and one prefill entry per (batch, context) point of the ladders (prefill batches capped
    by prefill_max_batch, tokens per call by prefill_chunk), each a jax.export body with the KV pool
    donated; weights as raw little-endian files ([in, out] for linears); the tokenizer files copied in.
    The export needs no accelerator and loads no PJRT plugin; the same inputs give the same bytes.

    A model with sliding-window layers gets the windowed KV pool (manifest v3) unless windowed_kv is
    False: each sequence keeps a ring of ceil((window - 1 + N) / block_size) pages for those layers (N the
    longest call: the prefill chunk, else the largest context), capped at a whole context's pages. The
    windowed pool holds window_blocks pages (default: a ring for each sequence of the largest context
    the full pool holds, capped at the full pool's pages).
    """
    batches = _ladder(batch_ladder, "batch ladder")
    contexts = _ladder(context_ladder, "context ladder")
    for c in contexts:
        if c % block_size:
            raise ExportError(f"context {c} is not a multiple of the block size {block_size}")
    if attention_block % block_size:
        raise ExportError(f"attention block {attention_block} is not a multiple of the block size {block_size}")
    prefill_max_batch = batches[-1] if prefill_max_batch is None else int(prefill_max_batch)
    chunk = int(prefill_chunk or 0)
    if chunk < 0:
        raise ExportError(f"prefill chunk must be positive, got {chunk}")
    kv_np = weight_dtype(kv_dtype)       # the same two dtypes are allowed for KV pools
    pages_per_seq = contexts[-1] // block_size
    num_blocks = int(num_blocks or batches[-1] * pages_per_seq)
    if num_blocks < pages_per_seq:
        raise ExportError(f"num_blocks {num_blocks} cannot hold one sequence of the largest context "
                          f"({pages_per_seq} pages)")

    if sys.byteorder != "little":
        raise ExportError("weight files are raw little-endian; exporting from a big-endian host is not supported")
    cfg, weights = load_checkpoint(checkpoint_dir, weight_dtype_name)
    if LINEAR in cfg.layer_types:
        raise ExportError(f"{cfg.model_type} has linear-attention (Gated DeltaNet) layers, whose state pools need "
                          "manifest v4 (STATE_SLOTS, state pool roles), which is not built yet")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"output directory {str(out)!r} is not empty")
    out.mkdir(parents=True, exist_ok=True)

    windowed = windowed_kv and SLIDING in cfg.layer_types
    ring = 0
    if windowed:
        ring = ring_pages_for(cfg.sliding_window, chunk or contexts[-1], block_size, pages_per_seq)
        window_blocks = int(window_blocks or min(num_blocks, (num_blocks // pages_per_seq) * ring))
        if window_blocks < ring:
            raise ExportError(f"window_blocks {window_blocks} cannot hold one ring of {ring} pages")
    shapes = pool_shapes(cfg, num_blocks, block_size, window_blocks if windowed else 0)
    layout = Layout(shapes, kv_np.name, ring)
    specs = plan_entries(batches, contexts, prefill_max_batch, chunk)
    entries = []
    bar = tqdm(total=len(specs) + len(weights), desc="export", unit="item", disable=not progress)
    for spec in specs:
        bar.set_postfix_str(spec.name)
        inputs, outputs, donations = entry_signature(cfg, spec, spec.context // block_size, weights, layout)
        exp = export_entry(cfg, spec, inputs, outputs, donations, key_block=attention_block,
                           ring_pages=layout.ring_pages,
                           platform=platform)
        text = exp.mlir_module().encode()
        digest = hashlib.sha256(text).hexdigest()
        body = f"bodies/{digest}.mlir"
        _write(out / body, text)
        serialized = f"bodies/{digest}.mlirbc"
        ser_digest = _write(out / serialized, exp.mlir_module_serialized)
        # jax's own serialization (for jax.export.deserialize in notebooks and tests); not read by the runtime.
        _write(out / f"bodies/{digest}.exported", exp.serialize())
        entry = mf.Entry(name=spec.name, kind=spec.kind, batch=spec.batch, context=spec.context,
                         tokens_per_seq=spec.tokens_per_seq, body=body, body_sha256=digest, serialized=serialized,
                         serialized_sha256=ser_digest, program=f"programs/{spec.name}.json", inputs=tuple(inputs),
                         outputs=tuple(outputs), donations=donations,
                         kept_inputs=tuple(exp.module_kept_var_idx))
        _write(out / entry.program, (json.dumps({"entry": spec.name, "inputs": [s.__dict__ for s in inputs],
                                                 "outputs": [s.__dict__ for s in outputs]},
                                                indent=1, sort_keys=True) + "\n").encode())
        entries.append(entry)
        bar.update()

    files = []
    for i, (slot, w) in enumerate(weights.items()):
        bar.set_postfix_str(slot)
        rel = f"weights/{i:04d}_{slot}.bin"
        data = np.ascontiguousarray(w).tobytes()     # host order; checked little-endian above
        _write(out / rel, data)
        files.append(mf.WeightFile(slot=slot, dtype=w.dtype.name, shape=tuple(w.shape), nbytes=len(data), file=rel))
        bar.update()
    bar.close()

    tokenizer = []
    for name in TOKENIZER_FILES:
        src = Path(checkpoint_dir) / name
        if src.is_file():
            shutil.copyfile(src, out / name)
            tokenizer.append(name)

    attn_layers = [i for i, t in enumerate(cfg.layer_types) if t in ("full_attention", SLIDING)]
    pools = tuple(
        mf.Pool(name=name, in_role=POOL_ROLES[name][0], out_role=POOL_ROLES[name][1],
                layers=tuple(i for i in attn_layers if pool_of(cfg, cfg.layer_types[i], windowed) == name),
                num_blocks=shape[2], dtype=kv_np.name, shape=tuple(shape))
        for name, shape in shapes.items())
    m = mf.Manifest(
        schema=mf.SCHEMA_V3 if windowed else mf.SCHEMA_V2,
        block_size=block_size, pools=pools,
        window=mf.Window(window=cfg.sliding_window, ring_pages=ring) if windowed else None,
        model=mf.ModelShape(name=cfg.name or Path(checkpoint_dir).name, model_type=cfg.model_type,
                            layers=cfg.num_layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                            head_dim=cfg.head_dim, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
                            weight_dtype=weight_dtype_name, kv_dtype=kv_np.name, eos_token_ids=cfg.eos_token_ids),
        buckets=mf.Buckets(batch_ladder=batches, context_ladder=contexts, prefill_max_batch=prefill_max_batch,
                           prefill_chunk=chunk),
        entries=tuple(entries), weights=tuple(files),
        versions=mf.Versions(jax=jax.__version__, jaxlib=jaxlib.__version__,
                             calling_convention=int(exp.calling_convention_version),
                             platform=platform, attention_block=attention_block),
        refused_tokens=tuple(mf.RefusedToken(t, k) for t, k in cfg.refused_tokens),
        tokenizer_files=tuple(tokenizer),
    )
    (out / mf.MANIFEST_NAME).write_text(m.to_json())
    return mf.load_manifest(out)
