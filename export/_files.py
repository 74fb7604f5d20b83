"""Writing an artifact's files: each named by what it holds and hashed as it is written."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from pathlib import Path
from typing import Mapping

import numpy as np
from jax import export as jax_export

from tlaloc_jax import artifact as af

from ._lazy import LazyWeight
from ._timing import timed

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


def write_file(path: Path, data: bytes) -> str:
    """Write `data` to `path` (its folders made) -> its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class BodyFiles:
    """The files of one exported body, named by its bytecode's sha256 (field names as af.Entry's): the portable
    bytecode the runtime compiles, and when asked the textual StableHLO and jax's serialization (else "")."""

    serialized: str
    serialized_sha256: str
    body: str = ""
    body_sha256: str = ""
    exported: str = ""
    exported_sha256: str = ""


def write_body(out: Path, exp: jax_export.Exported, *, mlir: bool = False, exported: bool = False) -> BodyFiles:
    """Write an exported body's portable bytecode and, for debugging (mlir) and re-tracing (exported), its
    textual StableHLO and jax's own serialization beside it."""
    code = exp.mlir_module_serialized
    stem = f"bodies/{hashlib.sha256(code).hexdigest()}"
    files = BodyFiles(serialized=f"{stem}.mlirbc", serialized_sha256=write_file(out / f"{stem}.mlirbc", code))
    if mlir:
        files = dataclasses.replace(files, body=f"{stem}.mlir",
                                    body_sha256=write_file(out / f"{stem}.mlir", exp.mlir_module().encode()))
    if exported:
        files = dataclasses.replace(files, exported=f"{stem}.exported",
                                    exported_sha256=write_file(out / f"{stem}.exported", exp.serialize()))
    return files


def write_blocks(path: Path, blocks) -> tuple[int, str]:
    """Write byte blocks one after another to `path` (its folders made), hashing as they go -> (bytes, sha256)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest, n = hashlib.sha256(), 0
    with open(path, "wb") as f:
        for block in blocks:
            with timed("write"):
                data = np.ascontiguousarray(block).reshape(-1).view(np.uint8)   # bytes of any dtype (bf16 too)
                f.write(data)
                digest.update(data)
                n += data.nbytes
    return n, digest.hexdigest()


def write_weights(out: Path, flat: Mapping[str, np.ndarray | LazyWeight], bar,
                  quant: Mapping[str, af.WeightQuant] | None = None,
                  parts: Mapping[str, af.Partition] | None = None, devices: int = 1) -> tuple[af.WeightFile, ...]:
    """One raw file per weight (host order, checked little-endian by the caller), hashed; `bar` ticks per file.
    quant: the slots that are halves of quantized weights (export/_quant.py's quant_records). parts: a weight split
    over the devices (its partition names a dimension) is written as one file per device, its block along that
    dimension, so that each device reads its shard alone. A LazyWeight is read here, a block at a time where it
    comes in parts (a split one whole), and dropped once written."""
    quant, parts = quant or {}, parts or {}
    files = []
    for i, (slot, w) in enumerate(flat.items()):
        bar.set_postfix_str(slot)
        partition = parts.get(slot, ())
        common = dict(slot=slot, dtype=w.dtype.name, shape=tuple(w.shape), nbytes=w.nbytes, quant=quant.get(slot))
        if any(partition):
            w = w.load() if isinstance(w, LazyWeight) else w
            axis = next(d for d, name in enumerate(partition) if name)
            shards = []
            for d, block in enumerate(np.split(np.asarray(w), devices, axis=axis)):
                rel = f"weights/{i:04d}_{slot}.shard{d}of{devices}.bin"
                data = np.ascontiguousarray(block).tobytes()
                shards.append(af.WeightShard(file=rel, nbytes=len(data), sha256=write_file(out / rel, data)))
            files.append(af.WeightFile(**common, partition=partition, shards=tuple(shards)))
        else:
            rel = f"weights/{i:04d}_{slot}.bin"
            _, sha = write_blocks(out / rel, w.blocks(slot) if isinstance(w, LazyWeight) else (w,))
            files.append(af.WeightFile(**common, file=rel, sha256=sha))
        bar.update()
    return tuple(files)


def copy_tokenizer(out: Path, tokenizer_dir) -> tuple[af.TokenizerFile, ...]:
    """The tokenizer files of `tokenizer_dir` (those of TOKENIZER_FILES it has), copied into the artifact, hashed."""
    if tokenizer_dir is None:
        return ()
    files = []
    for fname in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / fname
        if src.is_file():
            shutil.copyfile(src, out / fname)
            files.append(af.TokenizerFile(fname, af.sha256_file(out / fname)))
    return tuple(files)


