"""The bounded-program artifact's schema: written by tlaloc_jax.stage_bounded, read by the JAX-free runtime
(tlaloc_jax.serve.BoundedProgram).

A bounded program is a function that is not a decoder: an embedding model, a reranker, a classifier, a scoring
function. Some axes of its inputs are bounded: their size is known only at run time, at most a maximum (the
tokens of a sentence, the rows of a batch). The artifact holds one body per bucket of each bound (the cross
product when there are several), each taking the inputs padded to its bucket and, per bound, the valid length
and the valid mask; the runtime pads a call to the smallest bucket that holds it and slices the outputs.

Standard library only, like tlaloc_jax/manifest.py, whose dtype table, weight and tokenizer file records, version
record, @main reader, file checks and JSON-to-dataclass builder this module uses.

Changelog:
  tlaloc-bounded-v1: bounds (batch or length, a maximum, buckets); the author's inputs and outputs by name, each
    axis naming the bound whose size it has; one program per bucket combination (inputs, then per bound its
    VALID_LENGTH and VALID_MASK, then the weights); each output's tolerance-model path length; an optional
    embedding task (which input takes token ids, which output is the embedding) for /v1/embeddings. sha256 of
    every file.
"""

from __future__ import annotations

import enum
import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import manifest as mf

BOUNDED_NAME = "tlaloc-bounded.json"
SCHEMA_V1 = "tlaloc-bounded-v1"
MAX_BOUNDED_BYTES = 16 << 20
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class BoundKind(enum.StrEnum):
    """batch: rows; calls batched into one body each take some rows, so every input and output has this axis.
    length: a size per call (per row when the program also has a batch bound)."""

    BATCH = "batch"
    LENGTH = "length"


class Role(enum.StrEnum):
    """What a program's argument or result holds. `TensorSig.name` says which one."""

    INPUT = "INPUT"                # an input of the author's function, by its name
    VALID_LENGTH = "VALID_LENGTH"  # a bound's valid size, int32: [] (or [B], per row, beside a batch bound)
    VALID_MASK = "VALID_MASK"      # a bound's valid positions, bool: [N] (or [B, N] beside a batch bound)
    WEIGHT = "WEIGHT"              # a weight, by its slot in the weight table
    OUTPUT = "OUTPUT"              # an output of the author's function, by its name


@dataclass(frozen=True)
class BoundSpec:
    name: str
    kind: BoundKind
    max: int
    buckets: tuple[int, ...]       # increasing; the last is max


@dataclass(frozen=True)
class TensorSpec:
    """An input or output of the author's function, at the bounds' maxima. axes: per axis, the name of the bound
    whose size it has, or "" for a fixed axis."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    # Outputs: the tolerance model's roundings on the longest path to a value ({dtype: count} as pairs), counted
    # on the largest program's body (tlaloc_jax.export's padding check uses the same count).
    roundings: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class TensorSig:
    """One argument or result of a program's body."""

    role: Role
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.role} {self.name}"


@dataclass(frozen=True)
class Program:
    """One body: the author's function at one bucket of each bound."""

    name: str
    sizes: tuple[int, ...]         # the bucket of each bound, in the manifest's bound order
    body: str                      # bodies/<sha256>.mlir, textual StableHLO (its @main is checked at load)
    body_sha256: str
    serialized: str                # bodies/<sha256>.mlirbc, portable StableHLO bytecode: what the runtime compiles
    serialized_sha256: str
    exported: str                  # bodies/<sha256>.exported, jax.export's serialization (for jax callers)
    exported_sha256: str
    program: str                   # programs/<name>.json: this program's own manifest (sizes and signature)
    program_sha256: str
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    kept_inputs: tuple[int, ...]   # jax.export's module_kept_var_idx: all of them, checked at export


@dataclass(frozen=True)
class EmbeddingTask:
    """What /v1/embeddings needs of a program: the input that takes token ids (int32 [rows, tokens] with a batch
    bound, else [tokens]; the program's only input) and the output that is the embedding (float [rows, D] or
    [D]); ids must be below vocab."""

    tokens: str
    output: str
    vocab: int


@dataclass(frozen=True)
class BoundedManifest:
    schema: str
    name: str
    bounds: tuple[BoundSpec, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    programs: tuple[Program, ...]
    weights: tuple[mf.WeightFile, ...]
    versions: mf.Versions
    tokenizer_files: tuple[mf.TokenizerFile, ...] = ()
    embedding: EmbeddingTask | None = None

    def bound(self, name: str) -> BoundSpec:
        for b in self.bounds:
            if b.name == name:
                return b
        raise mf.ManifestError(f"no bound named {name!r}")

    @property
    def batch(self) -> BoundSpec | None:
        return next((b for b in self.bounds if b.kind == BoundKind.BATCH), None)

    def input(self, name: str) -> TensorSpec:
        return _named(self.inputs, name, "input")

    def output(self, name: str) -> TensorSpec:
        return _named(self.outputs, name, "output")

    def to_json(self) -> str:
        return json.dumps(mf.record_json(self), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str | bytes) -> "BoundedManifest":
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise mf.ManifestError(f"{BOUNDED_NAME} is not UTF-8 text: {e}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise mf.ManifestError(f"{BOUNDED_NAME} is not valid JSON: {e}") from None
        except RecursionError:
            raise mf.ManifestError(f"{BOUNDED_NAME} nests deeper than any manifest") from None
        if not isinstance(raw, dict):
            raise mf.ManifestError(f"{BOUNDED_NAME} must hold a JSON object")
        if raw.get("schema") != SCHEMA_V1:
            raise mf.ManifestError(f"unknown bounded-program schema {raw.get('schema')!r} (this runtime reads "
                                   f"{SCHEMA_V1})")
        return mf._build(BoundedManifest, raw, "manifest")


def _named(specs: tuple[TensorSpec, ...], name: str, what: str) -> TensorSpec:
    for s in specs:
        if s.name == name:
            return s
    raise mf.ManifestError(f"the program has no {what} named {name!r} ({what}s: {', '.join(s.name for s in specs)})")


# -- the signature of a program, from the manifest's specs ---------------------------------------------------


def shape_at(spec: TensorSpec, sizes: dict[str, int]) -> tuple[int, ...]:
    """A tensor's shape when each bound has the size `sizes` gives it."""
    return tuple(sizes[a] if a else d for d, a in zip(spec.shape, spec.axes))


def valid_shapes(bounds: tuple[BoundSpec, ...], bound: BoundSpec, sizes: dict[str, int]
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(VALID_LENGTH shape, VALID_MASK shape) of `bound`: beside a batch bound each row has its own length."""
    batch = next((b for b in bounds if b.kind == BoundKind.BATCH), None)
    if batch is None or bound is batch:
        return (), (sizes[bound.name],)
    return (sizes[batch.name],), (sizes[batch.name], sizes[bound.name])


def program_signature(bounds: tuple[BoundSpec, ...], inputs: tuple[TensorSpec, ...],
                      outputs: tuple[TensorSpec, ...], weights: tuple[mf.WeightFile, ...],
                      sizes: tuple[int, ...]) -> tuple[tuple[TensorSig, ...], tuple[TensorSig, ...]]:
    """(arguments, results) of the program at `sizes` (one per bound): the inputs padded to the buckets, then each
    bound's valid length and mask, then the weights; the outputs. The exporter writes this and the loader checks
    every program against it."""
    at = {b.name: s for b, s in zip(bounds, sizes)}
    args = [TensorSig(Role.INPUT, s.name, s.dtype, shape_at(s, at)) for s in inputs]
    for b in bounds:
        length, mask = valid_shapes(bounds, b, at)
        args += [TensorSig(Role.VALID_LENGTH, b.name, "int32", length), TensorSig(Role.VALID_MASK, b.name, "bool", mask)]
    args += [TensorSig(Role.WEIGHT, w.slot, w.dtype, tuple(w.shape)) for w in weights]
    results = tuple(TensorSig(Role.OUTPUT, s.name, s.dtype, shape_at(s, at)) for s in outputs)
    return tuple(args), results


def program_name(bounds: tuple[BoundSpec, ...], sizes: tuple[int, ...]) -> str:
    return "_".join(f"{b.name}{s}" for b, s in zip(bounds, sizes))


# -- loading ---------------------------------------------------------------------------------------------------


def load_bounded(artifact_dir: str | os.PathLike, *, verify_files: bool = True,
                 verify_weights: bool = True) -> BoundedManifest:
    """Read and validate a bounded-program artifact: its manifest, and (verify_files) every file it lists, inside
    the artifact and with its sha256 (the weights' hashes skipped when verify_weights is False; their sizes are
    still checked), and each body's @main against its program's signature."""
    root = Path(artifact_dir)
    path = root / BOUNDED_NAME
    if not path.is_file():
        if (root / mf.MANIFEST_NAME).is_file():
            raise mf.ManifestError(f"no {BOUNDED_NAME} in the artifact directory: it holds a decoder "
                                   f"({mf.MANIFEST_NAME}), not a bounded program; load it with tlaloc_jax.serve.Engine")
        raise mf.ManifestError(f"no {BOUNDED_NAME} in the artifact directory")
    if path.stat().st_size > MAX_BOUNDED_BYTES:
        raise mf.ManifestError(f"{BOUNDED_NAME} is {path.stat().st_size} bytes, more than any manifest "
                               f"({MAX_BOUNDED_BYTES})")
    m = BoundedManifest.from_json(path.read_bytes())
    check(m)
    if verify_files:
        for p in m.programs:
            what = f"program {p.name!r}"
            body = mf._checked_file(root, p.body, p.body_sha256, f"{what} body")
            mf._checked_file(root, p.serialized, p.serialized_sha256, f"{what} serialized body")
            mf._checked_file(root, p.exported, p.exported_sha256, f"{what} exported body")
            mf._checked_file(root, p.program, p.program_sha256, f"{what} manifest")
            why = mf.signature_mismatch(p.inputs, p.outputs, (), mf.main_signature(
                body.read_text(encoding="utf-8", errors="replace"), f"{what} body"))
            if why:
                raise mf.ManifestError(f"{what} body {p.body!r} does not match the manifest: {why}")
        for w in m.weights:
            f = mf._checked_file(root, w.file, None, f"weight {w.slot!r} file")
            if f.stat().st_size != w.nbytes:
                raise mf.ManifestError(f"weight {w.slot!r} file {w.file!r} has {f.stat().st_size} bytes, the "
                                       f"manifest says {w.nbytes}")
            if verify_weights:
                mf._checked_file(root, w.file, w.sha256, f"weight {w.slot!r} file")
        for t in m.tokenizer_files:
            mf._checked_file(root, t.file, t.sha256, "tokenizer file")
    return m


def check(m: BoundedManifest) -> None:
    """The checks that need no files: bounds and buckets, the specs' axes, one program per bucket combination with
    the signature the specs give it, the weight table, the embedding task."""
    if m.versions.platform not in ("cpu", "cuda"):
        raise mf.ManifestError(f"versions.platform {m.versions.platform!r} is not served (cpu, cuda)")
    if not m.bounds:
        raise mf.ManifestError("the manifest declares no bound")
    names = set()
    for b in m.bounds:
        what = f"bound {b.name!r}"
        if not NAME.match(b.name) or b.name in names:
            raise mf.ManifestError(f"{what}: a bound's name is unique and keeps to letters, digits, '_', '.' and '-'")
        names.add(b.name)
        if b.max < 1 or not b.buckets or b.buckets[-1] != b.max or b.buckets[0] < 1 or \
                any(x >= y for x, y in zip(b.buckets, b.buckets[1:])):
            raise mf.ManifestError(f"{what}: buckets {list(b.buckets)} must increase from 1 or more up to its max "
                                   f"{b.max}")
    if sum(b.kind == BoundKind.BATCH for b in m.bounds) > 1:
        raise mf.ManifestError(f"bounds {[b.name for b in m.bounds if b.kind == BoundKind.BATCH]} are all batch "
                               "bounds; a program has at most one")
    for kind, specs in (("input", m.inputs), ("output", m.outputs)):
        if not specs:
            raise mf.ManifestError(f"the program has no {kind}")
        if len({s.name for s in specs}) != len(specs):
            raise mf.ManifestError(f"two {kind}s share a name: {[s.name for s in specs]}")
        for s in specs:
            _check_spec(m, s, kind)
    for b in m.bounds:
        if not any(b.name in s.axes for s in m.inputs):
            raise mf.ManifestError(f"bound {b.name!r} is on no input's axis: a call could not say its size")
    slots = set()
    for w in m.weights:
        if w.nbytes != mf.nbytes(w.dtype, w.shape, f"weight {w.slot!r}"):
            raise mf.ManifestError(f"weight {w.slot!r}: nbytes {w.nbytes} does not match dtype {w.dtype} and shape "
                                   f"{list(w.shape)}")
        if w.slot in slots:
            raise mf.ManifestError(f"weight {w.slot!r} is listed twice")
        if not w.sha256:
            raise mf.ManifestError(f"weight {w.slot!r} has no sha256 ({SCHEMA_V1} hashes every file)")
        slots.add(w.slot)
    for t in m.tokenizer_files:
        if not t.sha256:
            raise mf.ManifestError(f"tokenizer file {t.file!r} has no sha256 ({SCHEMA_V1} hashes every file)")
    _check_programs(m)
    if m.embedding is not None:
        check_embedding(m.bounds, m.inputs, m.outputs, m.embedding)


def _check_spec(m: BoundedManifest, s: TensorSpec, kind: str) -> None:
    what = f"{kind} {s.name!r}"
    if not NAME.match(s.name):
        raise mf.ManifestError(f"{what}: a name keeps to letters, digits, '_', '.' and '-'")
    mf.dtype_info(s.dtype, what)
    if len(s.axes) != len(s.shape):
        raise mf.ManifestError(f"{what} has shape {list(s.shape)} and {len(s.axes)} axis names")
    for i, (d, a) in enumerate(zip(s.shape, s.axes)):
        if d < 1:
            raise mf.ManifestError(f"{what} axis {i} has size {d}")
        if a and (a not in {b.name for b in m.bounds} or d != m.bound(a).max):
            raise mf.ManifestError(f"{what} axis {i} of size {d} names bound {a!r}, which is not a bound of that max")
    if m.batch is not None and m.batch.name not in s.axes:
        raise mf.ManifestError(f"{what} has no axis of batch bound {m.batch.name!r}: calls batched together could "
                               "not each have their own")
    for dtype, n in s.roundings:
        mf.dtype_info(dtype, f"{what} roundings")
        if n < 0:
            raise mf.ManifestError(f"{what} has a negative rounding count {n}")


def _check_programs(m: BoundedManifest) -> None:
    want = set(itertools.product(*(b.buckets for b in m.bounds)))
    seen = set()
    for p in m.programs:
        what = f"program {p.name!r}"
        sizes = tuple(p.sizes)
        if sizes not in want or sizes in seen:
            raise mf.ManifestError(f"{what} sizes {list(sizes)} are not a new combination of the buckets of "
                                   f"{[b.name for b in m.bounds]}")
        seen.add(sizes)
        if p.name != program_name(m.bounds, sizes):
            raise mf.ManifestError(f"{what} should be named {program_name(m.bounds, sizes)!r}")
        inputs, outputs = program_signature(m.bounds, m.inputs, m.outputs, m.weights, sizes)
        if (tuple(p.inputs), tuple(p.outputs)) != (inputs, outputs):
            raise mf.ManifestError(f"{what}: its signature is not the one its inputs, outputs, bounds and weights "
                                   "give at its sizes")
        if tuple(p.kept_inputs) != tuple(range(len(p.inputs))):
            raise mf.ManifestError(f"{what}: its body dropped inputs (kept {list(p.kept_inputs)})")
    if seen != want:
        missing = sorted(want - seen)
        raise mf.ManifestError(f"the manifest has no program for sizes {list(missing[0])} of "
                               f"{[b.name for b in m.bounds]}")


def check_embedding(bounds: tuple[BoundSpec, ...], inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
                    e: EmbeddingTask) -> None:
    """An embedding task names the program's only input, int32 token ids with axes [batch bound (if any), a length
    bound], and a float output with axes [batch bound (if any), a fixed width]."""
    tokens, out = _named(inputs, e.tokens, "input"), _named(outputs, e.output, "output")
    if len(inputs) != 1:
        raise mf.ManifestError(f"embedding: the program takes {[s.name for s in inputs]}; an embedding program "
                               f"takes its token ids {e.tokens!r} only")
    batch = tuple(b.name for b in bounds if b.kind == BoundKind.BATCH)
    lengths = [b.name for b in bounds if b.kind == BoundKind.LENGTH]
    if tokens.dtype != "int32" or len(lengths) != 1 or tokens.axes != (*batch, lengths[0]):
        raise mf.ManifestError(f"embedding: input {e.tokens!r} is {tokens.dtype} with axes {list(tokens.axes)}; "
                               f"token ids are int32 with axes {[*batch, 'one length bound']}")
    if not out.dtype.startswith(("float", "bfloat")) or out.axes != (*batch, ""):
        raise mf.ManifestError(f"embedding: output {e.output!r} is {out.dtype} with axes {list(out.axes)}; an "
                               f"embedding is a float vector per row (axes {[*batch, '']})")
    if e.vocab < 1:
        raise mf.ManifestError(f"embedding: vocab must be positive, got {e.vocab}")
