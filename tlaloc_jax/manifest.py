"""The serving artifact's manifest schema: written by tlaloc_jax.export, read by the JAX-free runtime.

Standard library only. A manifest is a tree of frozen dataclasses; `Manifest.to_json()` writes it
deterministically and `load_manifest()` reads and validates an artifact directory, refusing, by
name, an unknown schema version, a missing field, a body whose sha256 does not match, a weight file of
the wrong byte length and any path that leaves the artifact directory.

Changelog:
  tlaloc-serving-v2: full-history KV pool (one buffer, layers stacked), decode and prefill entries.
  tlaloc-serving-v3: adds the windowed KV pool: sliding layers keep a ring of pages per sequence
    (`window`: the window and the ring size; pool "window_kv" with roles WINDOW_BLOCK_TABLES,
    WINDOW_SLOT_MAPPING, WINDOW_KV_POOL_IN/OUT).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = "tlaloc-serving.json"
SCHEMA_V2 = "tlaloc-serving-v2"
SCHEMA_V3 = "tlaloc-serving-v3"
SUPPORTED_SCHEMAS = (SCHEMA_V2, SCHEMA_V3)

# Input roles (docs/glossary.md) and output roles.
TOKEN_IDS, POSITIONS, BLOCK_TABLES, SEQ_LENS, SLOT_MAPPING = (
    "TOKEN_IDS", "POSITIONS", "BLOCK_TABLES", "SEQ_LENS", "SLOT_MAPPING")
WINDOW_BLOCK_TABLES, WINDOW_SLOT_MAPPING = "WINDOW_BLOCK_TABLES", "WINDOW_SLOT_MAPPING"
KV_POOL_IN, KV_POOL_OUT, WEIGHT = "KV_POOL_IN", "KV_POOL_OUT", "WEIGHT"
WINDOW_KV_POOL_IN, WINDOW_KV_POOL_OUT = "WINDOW_KV_POOL_IN", "WINDOW_KV_POOL_OUT"
LOGITS, NEXT_TOKEN = "LOGITS", "NEXT_TOKEN"
# The integer inputs of a call, by role, and the StepInputs field each one is.
STEP_FIELDS = {TOKEN_IDS: "token_ids", POSITIONS: "positions", BLOCK_TABLES: "block_tables",
               SEQ_LENS: "seq_lens", SLOT_MAPPING: "slot_mapping", WINDOW_BLOCK_TABLES: "window_block_tables",
               WINDOW_SLOT_MAPPING: "window_slot_mapping"}
STEP_ROLES = tuple(STEP_FIELDS)
POOL_IN_ROLES = (KV_POOL_IN, WINDOW_KV_POOL_IN)
INPUT_ROLES = STEP_ROLES + POOL_IN_ROLES + (WEIGHT,)
OUTPUT_ROLES = (LOGITS, NEXT_TOKEN, KV_POOL_OUT, WINDOW_KV_POOL_OUT)

# Element sizes of the dtypes an artifact may hold (names as numpy/ml_dtypes spell them).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int8": 1, "uint8": 1}


class ManifestError(ValueError):
    """An artifact is refused at load; the message names the file, field or entry at fault."""


@dataclass(frozen=True)
class TensorSig:
    """One input or output of an entry. `slot` names the weight for role WEIGHT, the pool for pool roles."""

    role: str
    dtype: str
    shape: tuple[int, ...]
    slot: str = ""


@dataclass(frozen=True)
class Entry:
    """One compiled program: a decode or prefill call of `batch` sequences in a `context`-position bucket."""

    name: str
    kind: str                      # "decode" | "prefill"
    batch: int
    context: int
    tokens_per_seq: int
    body: str                      # bodies/<sha256>.mlir, textual StableHLO
    body_sha256: str
    serialized: str                # bodies/<sha256>.bin, jax.export's portable serialized form
    serialized_sha256: str
    program: str                   # programs/<name>.json
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    donations: tuple[tuple[int, int], ...]   # (output index, input index it is written over)
    kept_inputs: tuple[int, ...]             # jax.export's module_kept_var_idx: all of them, checked at export

    def input_index(self, role: str, slot: str = "") -> int:
        for i, sig in enumerate(self.inputs):
            if sig.role == role and (not slot or sig.slot == slot):
                return i
        raise ManifestError(f"entry {self.name!r} has no input with role {role}{' ' + slot if slot else ''}")

    def output_index(self, role: str) -> int:
        for i, sig in enumerate(self.outputs):
            if sig.role == role:
                return i
        raise ManifestError(f"entry {self.name!r} has no output with role {role}")


@dataclass(frozen=True)
class WeightFile:
    slot: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str                      # weights/NNNN_<slot>.bin, raw little-endian, no header


@dataclass(frozen=True)
class Pool:
    """A device-resident pool class: its layers stacked, donated to every entry that takes it."""

    name: str                      # "kv" (full-history pages) | "window_kv" (the sliding layers' rings)
    in_role: str
    out_role: str
    layers: tuple[int, ...]        # the model layers whose keys and values it holds, in stack order
    num_blocks: int
    dtype: str
    shape: tuple[int, ...]         # [L', 2, P, S, K, D]


@dataclass(frozen=True)
class Window:
    """The windowed pool's geometry (v3): each sequence holds a ring of at most ring_pages pages."""

    window: int
    ring_pages: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    weight_dtype: str
    kv_dtype: str
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Buckets:
    batch_ladder: tuple[int, ...]
    context_ladder: tuple[int, ...]
    prefill_max_batch: int
    prefill_chunk: int             # 0: a prefill entry takes its whole context per call


@dataclass(frozen=True)
class RefusedToken:
    token_id: int
    config_key: str


@dataclass(frozen=True)
class Versions:
    """What produced the bodies; a runtime checks them against its plugin."""

    jax: str
    jaxlib: str
    calling_convention: int
    platform: str
    attention_block: int


@dataclass(frozen=True)
class Manifest:
    schema: str
    model: ModelShape
    block_size: int
    pools: tuple[Pool, ...]
    buckets: Buckets
    entries: tuple[Entry, ...]
    weights: tuple[WeightFile, ...]
    versions: Versions
    refused_tokens: tuple[RefusedToken, ...] = ()
    tokenizer_files: tuple[str, ...] = ()
    window: Window | None = None

    def pool(self, name: str) -> Pool | None:
        return next((p for p in self.pools if p.name == name), None)

    @property
    def kv_pool(self) -> Pool | None:
        """The full-history pool (None when every attention layer is in the windowed pool)."""
        return self.pool("kv")

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise ManifestError(f"no entry named {name!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str) -> "Manifest":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{MANIFEST_NAME} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ManifestError(f"{MANIFEST_NAME} must hold a JSON object")
        schema = raw.get("schema")
        if schema not in SUPPORTED_SCHEMAS:
            raise ManifestError(f"unknown manifest schema version {schema!r} (this runtime reads "
                                f"{', '.join(SUPPORTED_SCHEMAS)})")
        return _build(Manifest, raw, "manifest")


def _build(cls, raw: Any, where: str):
    """Build dataclass `cls` from parsed JSON, naming any missing or mistyped field by its path."""
    if dataclasses.is_dataclass(cls):
        if not isinstance(raw, dict):
            raise ManifestError(f"{where} must be an object")
        kwargs = {}
        hints = {f.name: f for f in dataclasses.fields(cls)}
        for name, f in hints.items():
            if name not in raw:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise ManifestError(f"missing field {where}.{name}")
            kwargs[name] = _build(_FIELD_TYPES[cls][name], raw[name], f"{where}.{name}")
        return cls(**kwargs)
    origin = getattr(cls, "__origin__", None)
    if type(cls) is types.UnionType:       # X | None
        if raw is None:
            return None
        return _build(next(a for a in cls.__args__ if a is not type(None)), raw, where)
    if origin is tuple:
        if not isinstance(raw, list):
            raise ManifestError(f"{where} must be a list")
        args = cls.__args__
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], x, f"{where}[{i}]") for i, x in enumerate(raw))
        if len(raw) != len(args):
            raise ManifestError(f"{where} must have {len(args)} items")
        return tuple(_build(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, raw)))
    if cls is int and not (isinstance(raw, int) and not isinstance(raw, bool)):
        raise ManifestError(f"{where} must be an integer, got {raw!r}")
    if cls is str and not isinstance(raw, str):
        raise ManifestError(f"{where} must be a string, got {raw!r}")
    return raw


def _resolve_types():
    import typing
    out = {}
    for cls in (TensorSig, Entry, WeightFile, Pool, Window, ModelShape, Buckets, RefusedToken, Versions, Manifest):
        out[cls] = typing.get_type_hints(cls)
    return out


_FIELD_TYPES = _resolve_types()


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
        raise ManifestError(f"{what} path {rel!r} leaves the artifact directory (resolves to {path})")
    return path


def load_manifest(artifact_dir: str | os.PathLike, *, verify_files: bool = True) -> Manifest:
    """Read and validate an artifact directory's manifest; with verify_files, check every file too."""
    root = Path(artifact_dir)
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"no {MANIFEST_NAME} in {str(artifact_dir)!r}")
    m = Manifest.from_json(path.read_text())
    _check_consistency(m)
    if verify_files:
        for e in m.entries:
            for rel, digest, what in ((e.body, e.body_sha256, "body"),
                                      (e.serialized, e.serialized_sha256, "serialized body")):
                p = resolve_inside(root, rel, f"entry {e.name!r} {what}")
                if not p.is_file():
                    raise ManifestError(f"entry {e.name!r} {what} {rel!r} does not exist")
                got = sha256_file(p)
                if got != digest:
                    raise ManifestError(f"entry {e.name!r} {what} {rel!r} has sha256 {got}, "
                                        f"the manifest says {digest}")
            p = resolve_inside(root, e.program, f"entry {e.name!r} program")
            if not p.is_file():
                raise ManifestError(f"entry {e.name!r} program {e.program!r} does not exist")
        for w in m.weights:
            p = resolve_inside(root, w.file, f"weight {w.slot!r}")
            if not p.is_file():
                raise ManifestError(f"weight {w.slot!r} file {w.file!r} does not exist")
            size = p.stat().st_size
            if size != w.nbytes:
                raise ManifestError(f"weight {w.slot!r} file {w.file!r} has {size} bytes, "
                                    f"the manifest says {w.nbytes}")
        for rel in m.tokenizer_files:
            resolve_inside(root, rel, "tokenizer file")
    return m


def _nbytes(dtype: str, shape: tuple[int, ...], what: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ManifestError(f"{what} has unknown dtype {dtype!r}")
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def _check_consistency(m: Manifest) -> None:
    """Cross-field checks that need no files: weight sizes, roles, donations, pool shapes."""
    if (m.schema == SCHEMA_V3) != (m.window is not None and m.pool("window_kv") is not None):
        raise ManifestError(f"schema {m.schema} " + ("needs a window and a window_kv pool" if m.schema == SCHEMA_V3
                                                     else "has no windowed pool, but the manifest describes one"))
    pools_by_role = {}
    for p in m.pools:
        if p.in_role not in POOL_IN_ROLES or p.out_role not in OUTPUT_ROLES:
            raise ManifestError(f"pool {p.name!r} has unknown roles {p.in_role}/{p.out_role}")
        if len(p.shape) != 6 or p.shape[0] != len(p.layers) or p.shape[2] != p.num_blocks \
                or p.shape[3] != m.block_size:
            raise ManifestError(f"pool {p.name!r} shape {list(p.shape)} does not match its layers, "
                                f"num_blocks and the block size")
        pools_by_role[p.in_role] = p
    slots = {}
    for w in m.weights:
        if w.nbytes != _nbytes(w.dtype, w.shape, f"weight {w.slot!r}"):
            raise ManifestError(f"weight {w.slot!r}: nbytes {w.nbytes} does not match dtype {w.dtype} "
                                f"and shape {list(w.shape)}")
        slots[w.slot] = w
    for e in m.entries:
        if e.kind not in ("decode", "prefill"):
            raise ManifestError(f"entry {e.name!r} has unknown kind {e.kind!r}")
        for sig in e.inputs:
            if sig.role not in INPUT_ROLES:
                raise ManifestError(f"entry {e.name!r} input has unknown role {sig.role!r}")
            if sig.role == WEIGHT:
                w = slots.get(sig.slot)
                if w is None:
                    raise ManifestError(f"entry {e.name!r} takes weight {sig.slot!r}, which the weight table lacks")
                if (w.dtype, tuple(w.shape)) != (sig.dtype, tuple(sig.shape)):
                    raise ManifestError(f"entry {e.name!r} takes weight {sig.slot!r} as {sig.dtype}{list(sig.shape)}, "
                                        f"the weight table has {w.dtype}{list(w.shape)}")
            if sig.role in POOL_IN_ROLES:
                p = pools_by_role.get(sig.role)
                if p is None or (sig.dtype, tuple(sig.shape)) != (p.dtype, tuple(p.shape)):
                    raise ManifestError(f"entry {e.name!r} input {sig.role} {sig.dtype}{list(sig.shape)} differs "
                                        f"from the manifest's pool {p.name if p else None!r}")
        for sig in e.outputs:
            if sig.role not in OUTPUT_ROLES:
                raise ManifestError(f"entry {e.name!r} output has unknown role {sig.role!r}")
        for out_i, in_i in e.donations:
            if not (0 <= out_i < len(e.outputs) and 0 <= in_i < len(e.inputs)):
                raise ManifestError(f"entry {e.name!r} donation ({out_i}, {in_i}) is out of range")
            o, i = e.outputs[out_i], e.inputs[in_i]
            if (o.dtype, tuple(o.shape)) != (i.dtype, tuple(i.shape)):
                raise ManifestError(f"entry {e.name!r} donates input {in_i} to output {out_i} of another "
                                    "shape or dtype")
        if tuple(e.kept_inputs) != tuple(range(len(e.inputs))):
            raise ManifestError(f"entry {e.name!r}: its body dropped inputs (kept {list(e.kept_inputs)})")
