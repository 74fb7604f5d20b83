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

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


def write_file(path: Path, data: bytes) -> str:
    """Write `data` to `path` (its folders made) -> its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class BodyFiles:
    """The three files of one exported body, named by the textual body's sha256 (field names as af.Entry's)."""

    body: str
    body_sha256: str
    serialized: str
    serialized_sha256: str
    exported: str
    exported_sha256: str


def write_body(out: Path, exp: jax_export.Exported) -> BodyFiles:
    """Write an exported body: its textual StableHLO, the portable bytecode the runtime compiles, and jax's own
    serialization."""
    text = exp.mlir_module().encode()
    digest = hashlib.sha256(text).hexdigest()
    body = f"bodies/{digest}.mlir"
    write_file(out / body, text)
    serialized = f"bodies/{digest}.mlirbc"
    exported = f"bodies/{digest}.exported"
    return BodyFiles(body=body, body_sha256=digest, serialized=serialized,
                     serialized_sha256=write_file(out / serialized, exp.mlir_module_serialized),
                     exported=exported, exported_sha256=write_file(out / exported, exp.serialize()))


def write_weights(out: Path, flat: Mapping[str, np.ndarray], bar,
                  quant: Mapping[str, af.WeightQuant] | None = None) -> tuple[af.WeightFile, ...]:
    """One raw file per weight (host order, checked little-endian by the caller), hashed; `bar` ticks per file.
    quant: the slots that are halves of quantized weights (export/_quant.py's quant_records)."""
    quant = quant or {}
    files = []
    for i, (slot, w) in enumerate(flat.items()):
        bar.set_postfix_str(slot)
        rel = f"weights/{i:04d}_{slot}.bin"
        data = np.ascontiguousarray(w).tobytes()
        files.append(af.WeightFile(slot=slot, dtype=w.dtype.name, shape=tuple(w.shape), nbytes=len(data), file=rel,
                                   sha256=write_file(out / rel, data), quant=quant.get(slot)))
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


