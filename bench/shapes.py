"""The Llama shapes the scale benches use, and a random seeded bf16 checkpoint of one written as Hugging Face writes
them: model-0000k-of-0000n.safetensors shards of about 5 GB and model.safetensors.index.json, config.json, and the
demo model's tokenizer files (its ids all lie inside the 128,256-id vocabulary).

The writer generates one tensor at a time, a block at a time, straight into its shard: its memory is a pool of
values (128 MiB) and a block, not the model (an 8B checkpoint is ~16 GB of shards).

    from bench.shapes import SHAPES, hf_config, write_checkpoint
    write_checkpoint(hf_config("8b"), Path("/tmp/ck-8b"))
    python -m bench.shapes 3b /tmp/ck-3b
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bench.common import llama_config

# name: (hidden, layers, heads, kv_heads, intermediate, tied embeddings); head 128 and vocabulary 128,256 each.
SHAPES = {
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, tied=True),     # Llama-3.2-1B
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, tied=True),     # Llama-3.2-3B
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, tied=False),   # Llama-3.1-8B
}
VOCAB = 128_256
SHARD_BYTES = 5_000_000_000
STD = 0.02          # Hugging Face's initializer_range: q/k and logits stay near unit scale at these widths
POOL = 1 << 26             # values in the pool the projections are cut from
_BLOCK = 1 << 22           # values a weight takes from one offset of the pool


def hf_config(shape: str, context: int = 32768) -> dict:
    """The Hugging Face config of a shape (bf16; positions up to max(context, 131072), as Llama 3.1 ships)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    s = SHAPES[shape]
    hf = llama_config(SimpleNamespace(vocab=VOCAB, context=context, **{k: v for k, v in s.items() if k != "tied"}))
    hf.update(architectures=["LlamaForCausalLM"], hidden_act="silu", bos_token_id=0, eos_token_id=0,
              torch_dtype="bfloat16", tie_word_embeddings=s["tied"], rms_norm_eps=1e-5,
              max_position_embeddings=max(4 * context, 131072),
              rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return hf


def shard_plan(tensors: dict[str, tuple[int, ...]], itemsize: int, shard_bytes: int) -> list[list[str]]:
    """Tensors in order, cut into shards of at most shard_bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in tensors.items():
        n = int(np.prod(shape)) * itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _header(names: list[str], tensors: dict[str, tuple[int, ...]], itemsize: int) -> bytes:
    """A safetensors header (BF16 tensors back to back), padded with spaces to 8 bytes as safetensors pads it."""
    meta, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        n = int(np.prod(tensors[name])) * itemsize
        meta[name] = {"dtype": "BF16", "shape": list(tensors[name]), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@functools.lru_cache(maxsize=1)
def _pool(seed: int) -> np.ndarray:
    """POOL seeded normal values times STD, as bf16: drawing 8e9 normals takes ~10 minutes on 2 cores, so a
    projection's values are cut from this pool at seeded offsets instead (a weight's rows are distinct slices)."""
    import ml_dtypes
    rng = np.random.default_rng([seed, 1 << 20])
    return (STD * rng.standard_normal(POOL, dtype=np.float32)).astype(ml_dtypes.bfloat16)


def _write_tensor(f, name: str, shape: tuple[int, ...], seed: int, index: int) -> None:
    """One tensor's bf16 values, seeded by (seed, its index), written a block at a time: norm weights near 1
    (drawn), the rest slices of the seeded pool of normal values with STD at drawn offsets."""
    import ml_dtypes
    rng = np.random.default_rng([seed, index])
    size = int(np.prod(shape))
    if name.endswith("norm.weight"):
        f.write((1.0 + 0.1 * rng.standard_normal(size, dtype=np.float32)).astype(ml_dtypes.bfloat16).tobytes())
        return
    pool = _pool(seed)
    for start in range(0, size, _BLOCK):
        n, at = min(_BLOCK, size - start), int(rng.integers(0, POOL - _BLOCK))
        f.write(pool[at:at + n].tobytes())


def write_checkpoint(hf: dict, out: Path, seed: int = 0, shard_bytes: int = SHARD_BYTES, log=print) -> int:
    """Write the random bf16 checkpoint of `hf` (a dense family without split tensors) to `out`, sharded as Hugging
    Face shards it; its parameter count. Writes into `out`.tmp and renames it when whole."""
    from tlaloc_jax.checkpoint import DEMO_MODEL, checkpoint_tensors
    from tlaloc_jax.families import config_from_hf

    fam, cfg = config_from_hf(hf)
    tensors = checkpoint_tensors(fam, cfg)
    shards = shard_plan(tensors, 2, shard_bytes)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map, t0, order = {}, time.perf_counter(), {name: i for i, name in enumerate(tensors)}
    for k, names in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        with open(tmp / fname, "wb") as f:
            f.write(_header(names, tensors, 2))
            for name in names:
                _write_tensor(f, name, tensors[name], seed, order[name])
                weight_map[name] = fname
        log(f"wrote {fname} ({len(names)} tensors) at {time.perf_counter() - t0:.0f} s")
    params = sum(int(np.prod(s)) for s in tensors.values())
    index = {"metadata": {"total_size": 2 * params}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DEMO_MODEL / fname, tmp / fname)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return params


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    n = write_checkpoint(hf_config(a.shape), a.out, seed=a.seed)
    print(f"{a.shape}: {n / 1e9:.2f}B parameters (bf16) in {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
