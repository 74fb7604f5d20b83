"""The bounded-program artifact's schema (tlaloc-bounded): written by tlaloc_jax.stage_bounded, read by the JAX-free
runtime (tlaloc_jax.serve.BoundedProgram).

A bounded program is a function that is not a decoder: an embedding model, a reranker, a classifier, a scoring
function. Some axes of its inputs are bounded: their size is known only at run time, at most a maximum (the
tokens of a sentence, the rows of a batch). The artifact holds one body per bucket of each bound (the cross
product when there are several), each taking the inputs padded to its bucket and, per bound, the valid length
and the valid mask; the runtime pads a call to the smallest bucket that holds it and slices the outputs.

Changelog:
  tlaloc-bounded-v1: bounds (batch or length, a maximum, buckets); the author's inputs and outputs by name, each
    axis naming the bound whose size it has; one program per bucket combination (inputs, then per bound its
    VALID_LENGTH and VALID_MASK, then the weights); each output's tolerance-model path length; an optional
    embedding task (which input takes token ids, which output is the embedding) for /v1/embeddings. sha256 of
    every file. A program's argument or result names its input, bound, weight or output in "name" (the `slot`
    of the TensorSig it is read into).
  tlaloc-bounded-v2: a program needs only its portable bytecode (`serialized`, `.mlirbc`) beside its record;
    `programs/*.json` is gone, and the textual StableHLO (`body`) and jax's serialization (`exported`) are written
    only when the export asks for them (then listed with their sha256; the runtime opens neither). v1 manifests
    still load; their `.mlir`, `.exported` and `programs/` files are not opened.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .codec import build, dumps, parse
from .decoder_manifest import MANIFEST_NAME
from .errors import ManifestError
from .files import read_manifest_file, sha256_file, verify_body, verify_listed_files
from .records import TensorSig, TokenizerFile, Versions, WeightFile, check_platform, check_tokenizer_hashes, \
    check_weight_table
from .vocabulary import NAME, BoundKind, Role, dtype_info

BOUNDED_NAME = "tlaloc-bounded.json"
SCHEMA_V1 = "tlaloc-bounded-v1"
SCHEMA_V2 = "tlaloc-bounded-v2"
SUPPORTED_BOUNDED = (SCHEMA_V1, SCHEMA_V2)
MAX_BOUNDED_BYTES = 16 << 20


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
class Program:
    """One body: the author's function at one bucket of each bound."""

    name: str
    sizes: tuple[int, ...]         # the bucket of each bound, in the manifest's bound order
    serialized: str                # bodies/<sha256>.mlirbc, portable StableHLO bytecode: what the runtime compiles
    serialized_sha256: str         # (and reads @main from, checked against inputs and outputs at load)
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    kept_inputs: tuple[int, ...]   # jax.export's module_kept_var_idx: all of them, checked at export
    # Files the runtime never opens: the textual StableHLO and jax's serialization (v1 always; v2 when the export
    # asks for them), and programs/<name>.json (v1).
    body: str = ""                 # bodies/<sha256>.mlir
    body_sha256: str = ""
    exported: str = ""             # bodies/<sha256>.exported (for jax callers)
    exported_sha256: str = ""
    program: str = ""
    program_sha256: str = ""


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
    weights: tuple[WeightFile, ...]
    versions: Versions
    tokenizer_files: tuple[TokenizerFile, ...] = ()
    embedding: EmbeddingTask | None = None

    def bound(self, name: str) -> BoundSpec:
        for b in self.bounds:
            if b.name == name:
                return b
        raise ManifestError(f"no bound named {name!r}")

    @property
    def batch(self) -> BoundSpec | None:
        return next((b for b in self.bounds if b.kind == BoundKind.BATCH), None)

    def input(self, name: str) -> TensorSpec:
        return _named(self.inputs, name, "input")

    def output(self, name: str) -> TensorSpec:
        return _named(self.outputs, name, "output")

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        for p, program in zip(raw["programs"], self.programs):
            p["inputs"], p["outputs"] = signature_json(program.inputs), signature_json(program.outputs)
        return dumps(raw)

    @staticmethod
    def from_json(text: str | bytes) -> "BoundedManifest":
        raw = parse(text, BOUNDED_NAME)
        if raw.get("schema") not in SUPPORTED_BOUNDED:
            raise ManifestError(f"unknown bounded-program schema {raw.get('schema')!r} (this runtime reads "
                                f"{', '.join(SUPPORTED_BOUNDED)})")
        return build(BoundedManifest, _slots_from_names(raw), "manifest")


def signature_json(sigs: tuple[TensorSig, ...]) -> list[dict]:
    """A program's arguments or results as the schema writes them: each TensorSig's slot under "name"."""
    out = []
    for sig in sigs:
        d = dataclasses.asdict(sig)
        d["name"] = d.pop("slot")
        out.append(d)
    return out


def _slots_from_names(raw: dict) -> dict:
    """The manifest's JSON with each program argument's or result's "name" read as its TensorSig slot."""
    programs = raw.get("programs")
    if not isinstance(programs, list):
        return raw
    renamed = []
    for i, p in enumerate(programs):
        if isinstance(p, dict):
            p = dict(p)
            for key in ("inputs", "outputs"):
                sigs = p.get(key)
                if not isinstance(sigs, list):
                    continue
                for j, s in enumerate(sigs):
                    if isinstance(s, dict) and "name" not in s:
                        raise ManifestError(f"missing field manifest.programs[{i}].{key}[{j}].name")
                p[key] = [{**{k: v for k, v in s.items() if k not in ("name", "slot")}, "slot": s["name"]}
                          if isinstance(s, dict) else s for s in sigs]
        renamed.append(p)
    return {**raw, "programs": renamed}


def _named(specs: tuple[TensorSpec, ...], name: str, what: str) -> TensorSpec:
    for s in specs:
        if s.name == name:
            return s
    raise ManifestError(f"the program has no {what} named {name!r} ({what}s: {', '.join(s.name for s in specs)})")


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
                      outputs: tuple[TensorSpec, ...], weights: tuple[WeightFile, ...],
                      sizes: tuple[int, ...]) -> tuple[tuple[TensorSig, ...], tuple[TensorSig, ...]]:
    """(arguments, results) of the program at `sizes` (one per bound): the inputs padded to the buckets, then each
    bound's valid length and mask, then the weights; the outputs. The exporter writes this and the loader checks
    every program against it."""
    at = {b.name: s for b, s in zip(bounds, sizes)}
    args = [TensorSig(Role.INPUT, s.dtype, shape_at(s, at), s.name) for s in inputs]
    for b in bounds:
        length, mask = valid_shapes(bounds, b, at)
        args += [TensorSig(Role.VALID_LENGTH, "int32", length, b.name),
                 TensorSig(Role.VALID_MASK, "bool", mask, b.name)]
    args += [TensorSig(Role.WEIGHT, w.dtype, tuple(w.shape), w.slot) for w in weights]
    results = tuple(TensorSig(Role.OUTPUT, s.dtype, shape_at(s, at), s.name) for s in outputs)
    return tuple(args), results


def program_name(bounds: tuple[BoundSpec, ...], sizes: tuple[int, ...]) -> str:
    return "_".join(f"{b.name}{s}" for b, s in zip(bounds, sizes))


# -- loading ---------------------------------------------------------------------------------------------------


def load_bounded(artifact_dir: str | os.PathLike, *, verify_files: bool = True, verify_weights: bool = True,
                 digests: Callable[[Path], str] = sha256_file) -> BoundedManifest:
    """Read and validate a bounded-program artifact: its manifest, and (verify_files) every file the runtime opens
    (each body's bytecode, the weights, the tokenizer files), inside the artifact and with its sha256 (the weights' hashes skipped when verify_weights is False; their sizes are
    still checked), and each body's @main against its program's signature. digests: a file's sha256
    (FileDigests.sha256 remembers those of unchanged files)."""
    root = Path(artifact_dir)
    m = BoundedManifest.from_json(read_manifest_file(
        root, BOUNDED_NAME, MAX_BOUNDED_BYTES, MANIFEST_NAME,
        f"a decoder ({MANIFEST_NAME}), not a bounded program; load it with tlaloc_jax.serve.Engine",
        "stage a program over it first with tlaloc_jax.stage_bounded"))
    check(m)
    if verify_files:
        for p in m.programs:
            verify_body(root, p, p.inputs, p.outputs, (), f"program {p.name!r}", digests=digests)
        verify_listed_files(root, m.weights, m.tokenizer_files, verify_weights, digests)
    return m


def check(m: BoundedManifest) -> None:
    """The checks that need no files: bounds and buckets, the specs' axes, one program per bucket combination with
    the signature the specs give it, the weight table, the embedding task."""
    check_platform(m.versions)
    if not m.bounds:
        raise ManifestError("the manifest declares no bound")
    names = set()
    for b in m.bounds:
        what = f"bound {b.name!r}"
        if not NAME.match(b.name) or b.name in names:
            raise ManifestError(f"{what}: a bound's name is unique and keeps to letters, digits, '_', '.' and '-'")
        names.add(b.name)
        if b.max < 1 or not b.buckets or b.buckets[-1] != b.max or b.buckets[0] < 1 or \
                any(x >= y for x, y in zip(b.buckets, b.buckets[1:])):
            raise ManifestError(f"{what}: buckets {list(b.buckets)} must increase from 1 or more up to its max "
                                f"{b.max}")
    if sum(b.kind == BoundKind.BATCH for b in m.bounds) > 1:
        raise ManifestError(f"bounds {[b.name for b in m.bounds if b.kind == BoundKind.BATCH]} are all batch "
                            "bounds; a program has at most one")
    for kind, specs in (("input", m.inputs), ("output", m.outputs)):
        if not specs:
            raise ManifestError(f"the program has no {kind}")
        if len({s.name for s in specs}) != len(specs):
            raise ManifestError(f"two {kind}s share a name: {[s.name for s in specs]}")
        for s in specs:
            _check_spec(m, s, kind)
    for b in m.bounds:
        if not any(b.name in s.axes for s in m.inputs):
            raise ManifestError(f"bound {b.name!r} is on no input's axis: a call could not say its size")
    check_weight_table(m.weights, m.schema)
    check_tokenizer_hashes(m.tokenizer_files, m.schema)
    _check_programs(m)
    if m.embedding is not None:
        check_embedding(m.bounds, m.inputs, m.outputs, m.embedding)


def _check_spec(m: BoundedManifest, s: TensorSpec, kind: str) -> None:
    what = f"{kind} {s.name!r}"
    if not NAME.match(s.name):
        raise ManifestError(f"{what}: a name keeps to letters, digits, '_', '.' and '-'")
    dtype_info(s.dtype, what)
    if len(s.axes) != len(s.shape):
        raise ManifestError(f"{what} has shape {list(s.shape)} and {len(s.axes)} axis names")
    for i, (d, a) in enumerate(zip(s.shape, s.axes)):
        if d < 1:
            raise ManifestError(f"{what} axis {i} has size {d}")
        if a and (a not in {b.name for b in m.bounds} or d != m.bound(a).max):
            raise ManifestError(f"{what} axis {i} of size {d} names bound {a!r}, which is not a bound of that max")
    if m.batch is not None and m.batch.name not in s.axes:
        raise ManifestError(f"{what} has no axis of batch bound {m.batch.name!r}: calls batched together could "
                            "not each have their own")
    for dtype, n in s.roundings:
        dtype_info(dtype, f"{what} roundings")
        if n < 0:
            raise ManifestError(f"{what} has a negative rounding count {n}")


def _check_programs(m: BoundedManifest) -> None:
    want = set(itertools.product(*(b.buckets for b in m.bounds)))
    seen = set()
    for p in m.programs:
        what = f"program {p.name!r}"
        sizes = tuple(p.sizes)
        if sizes not in want or sizes in seen:
            raise ManifestError(f"{what} sizes {list(sizes)} are not a new combination of the buckets of "
                                f"{[b.name for b in m.bounds]}")
        seen.add(sizes)
        if p.name != program_name(m.bounds, sizes):
            raise ManifestError(f"{what} should be named {program_name(m.bounds, sizes)!r}")
        inputs, outputs = program_signature(m.bounds, m.inputs, m.outputs, m.weights, sizes)
        if (tuple(p.inputs), tuple(p.outputs)) != (inputs, outputs):
            raise ManifestError(f"{what}: its signature is not the one its inputs, outputs, bounds and weights "
                                "give at its sizes")
        if tuple(p.kept_inputs) != tuple(range(len(p.inputs))):
            raise ManifestError(f"{what}: its body dropped inputs (kept {list(p.kept_inputs)})")
    if seen != want:
        missing = sorted(want - seen)
        raise ManifestError(f"the manifest has no program for sizes {list(missing[0])} of "
                            f"{[b.name for b in m.bounds]}")


def check_embedding(bounds: tuple[BoundSpec, ...], inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
                    e: EmbeddingTask) -> None:
    """An embedding task names the program's only input, int32 token ids with axes [batch bound (if any), a length
    bound], and a float output with axes [batch bound (if any), a fixed width]."""
    tokens, out = _named(inputs, e.tokens, "input"), _named(outputs, e.output, "output")
    if len(inputs) != 1:
        raise ManifestError(f"embedding: the program takes {[s.name for s in inputs]}; an embedding program "
                            f"takes its token ids {e.tokens!r} only")
    batch = tuple(b.name for b in bounds if b.kind == BoundKind.BATCH)
    lengths = [b.name for b in bounds if b.kind == BoundKind.LENGTH]
    if tokens.dtype != "int32" or len(lengths) != 1 or tokens.axes != (*batch, lengths[0]):
        raise ManifestError(f"embedding: input {e.tokens!r} is {tokens.dtype} with axes {list(tokens.axes)}; "
                            f"token ids are int32 with axes {[*batch, 'one length bound']}")
    if not out.dtype.startswith(("float", "bfloat")) or out.axes != (*batch, ""):
        raise ManifestError(f"embedding: output {e.output!r} is {out.dtype} with axes {list(out.axes)}; an "
                            f"embedding is a float vector per row (axes {[*batch, '']})")
    if e.vocab < 1:
        raise ManifestError(f"embedding: vocab must be positive, got {e.vocab}")
