"""The files an artifact lists: inside its directory, present, with the sha256 the manifest says, each body's
@main what its signature says. A runtime opens no other file of an artifact directory."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from .errors import ManifestError
from .records import TensorSig, TokenizerFile, WeightFile
from .stablehlo import main_signature, signature_mismatch


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_inside(root: Path, rel: str, what: str) -> Path:
    """The path `rel` inside artifact directory `root`; refuses absolute paths, '..' and symlinks out."""
    if not rel or os.path.isabs(rel) or Path(rel).drive:
        raise ManifestError(f"{what} path {rel!r} is not relative to the artifact directory")
    if ".." in Path(rel).parts:
        raise ManifestError(f"{what} path {rel!r} leaves the artifact directory")
    root = root.resolve()
    path = (root / rel).resolve()
    if root != path and root not in path.parents:
        raise ManifestError(f"{what} path {rel!r} leaves the artifact directory")
    return path


def checked_file(root: Path, rel: str, digest: str | None, what: str,
                 digests: Callable[[Path], str] = sha256_file) -> Path:
    """A file the manifest lists: inside the artifact, present, and (digest given) with that sha256 (as `digests`
    finds it: hashed, or remembered from a load before by digests.FileDigests)."""
    p = resolve_inside(root, rel, what)
    if not p.is_file():
        raise ManifestError(f"{what} {rel!r} does not exist")
    if digest is not None:
        got = digests(p)
        if got != digest:
            raise ManifestError(f"{what} {rel!r} has sha256 {got}, the manifest says {digest}")
    return p


def read_manifest_file(root: Path, name: str, max_bytes: int, other: str, other_hint: str,
                       checkpoint_hint: str = "") -> bytes:
    """The bytes of manifest `name` in artifact directory `root`; refused, naming the directory, when absent (naming
    `other`, the other schema's manifest, with `other_hint` when the directory holds that instead, and
    `checkpoint_hint`, the way from a checkpoint to an artifact, when it holds a Hugging Face checkpoint) or larger
    than max_bytes."""
    path = root / name
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "does not exist"
        raise ManifestError(f"{root}: {what}; give the artifact directory that python -m tlaloc_jax.export (or "
                            "tlaloc_jax.stage) wrote")
    if not path.is_file():
        if (root / other).is_file():
            raise ManifestError(f"{root}: no {name} in the artifact directory: it holds {other_hint}")
        if (root / "config.json").is_file():
            raise ManifestError(f"{root}: no {name} in the artifact directory: it holds a Hugging Face checkpoint "
                                f"(config.json), not an artifact; {checkpoint_hint}")
        raise ManifestError(f"{root}: no {name} in the artifact directory")
    if path.stat().st_size > max_bytes:
        raise ManifestError(f"{name} is {path.stat().st_size} bytes, more than any manifest ({max_bytes})")
    return path.read_bytes()


def verify_body(root: Path, record, inputs: tuple[TensorSig, ...], outputs: tuple[TensorSig, ...],
                donations: tuple[tuple[int, int], ...], what: str, devices: int = 1,
                digests: Callable[[Path], str] = sha256_file) -> None:
    """A body's portable bytecode (`record`: an Entry or a Program, with its serialized path and sha256) is present
    with its sha256, and its @main takes and returns `inputs` and `outputs`, partitioned for `devices` devices.
    The other files an exporter may write beside it (textual StableHLO, jax's serialization) are not opened."""
    body = checked_file(root, record.serialized, record.serialized_sha256, f"{what} serialized body", digests)
    why = signature_mismatch(inputs, outputs, donations, main_signature(body.read_bytes(), f"{what} body"), devices)
    if why:
        raise ManifestError(f"{what} body {record.serialized!r} does not match the manifest: {why}")


def verify_listed_files(root: Path, weights: tuple[WeightFile, ...], tokenizer_files: tuple[TokenizerFile, ...],
                        verify_weights: bool, digests: Callable[[Path], str] = sha256_file) -> None:
    """Every weight file (a split weight's shard files) present with its size (and, verify_weights, its sha256),
    every tokenizer file with its."""
    for w in weights:
        for file, size, digest in [(s.file, s.nbytes, s.sha256) for s in w.shards] or [(w.file, w.nbytes, w.sha256)]:
            got = checked_file(root, file, None, f"weight {w.slot!r} file").stat().st_size
            if got != size:
                raise ManifestError(f"weight {w.slot!r} file {file!r} has {got} bytes, the manifest says {size}")
            if verify_weights and digest:
                checked_file(root, file, digest, f"weight {w.slot!r} file", digests)
    for t in tokenizer_files:
        checked_file(root, t.file, t.sha256 or None, "tokenizer file", digests)
