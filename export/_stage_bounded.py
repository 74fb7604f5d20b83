"""tlaloc_jax.stage_bounded: a function that is not a decoder (an embedding model, a reranker, a classifier, a
scoring function) -> a bounded-program artifact (tlaloc-bounded-v2) that tlaloc_jax.serve.BoundedProgram serves.

    manifest = tlaloc_jax.stage_bounded(embed, params, {"ids": ids}, "artifact/",
                                        bounds={"rows": Bound(max=8, axes=[("ids", 0)], batch=True),
                                                "tokens": Bound(max=128, axes=[("ids", 1)])})

`fn(params, inputs, valid) -> outputs`: `inputs` is a dict of the named inputs, each bounded axis padded to a
bucket; `valid` a dict {bound: tlaloc_jax.Valid(length, mask)}; `outputs` a dict of named arrays (or one array,
named "output"). `example_args` holds each input at the maxima of its bounds, with realistic values: the padding
check runs on them. One body per combination of the bounds' buckets, each taking the inputs, each bound's valid
length and mask, and the weights (arguments, never constants). Which output axis follows which bound is read off
the function's shapes: an output axis either has a bound's size or a fixed one.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from tlaloc_jax import artifact as af
from tlaloc_jax.artifact import bounded_manifest as bm
from tlaloc_jax.bounds import Bound, Valid

from ._entries import ExportError, check_custom_calls, export_fn
from ._files import copy_tokenizer, write_body, write_weights
from ._progress import progress_bar
from ._padding import check_padding
from ._roundings import output_roundings
from ._weights import flatten_weights, path_name

Role = af.Role


def _examples(example_args: Mapping[str, Any]) -> dict[str, np.ndarray]:
    if not isinstance(example_args, Mapping) or not example_args:
        raise ExportError("example_args must be a dict {input name: array} of at least one input")
    out = {}
    for name, value in example_args.items():
        if not isinstance(name, str) or not af.NAME.match(name):
            raise ExportError(f"input {name!r}: a name keeps to letters, digits, '_', '.' and '-'")
        arr = np.asarray(value)
        # What the function sees in process too: jax's dtypes (int64 -> int32 without x64).
        arr = arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype))
        if arr.dtype.name not in af.DTYPES:
            raise ExportError(f"input {name!r} has dtype {arr.dtype.name}, which an artifact cannot hold (known: "
                              f"{', '.join(af.DTYPES)})")
        out[name] = arr
    return out


def _resolve_bounds(bounds: Mapping[str, Bound], examples: Mapping[str, np.ndarray]
                    ) -> tuple[tuple[bm.BoundSpec, ...], tuple[bm.TensorSpec, ...]]:
    """The manifest's bounds, and each input's spec (its axes naming their bounds)."""
    if not bounds:
        raise ExportError("declare at least one bound: {name: Bound(max, axes=[(input, axis)])}")
    axes = {name: [""] * arr.ndim for name, arr in examples.items()}
    specs = []
    for name, b in bounds.items():
        what = f"bound {name!r}"
        if not isinstance(b, Bound):
            raise ExportError(f"{what} is a {type(b).__name__}; declare it as tlaloc_jax.Bound")
        if not af.NAME.match(name):
            raise ExportError(f"{what}: a name keeps to letters, digits, '_', '.' and '-'")
        if b.max < 2:
            raise ExportError(f"{what} has max {b.max}: an axis of one size is fixed, not bounded")
        ladder = b.ladder
        if ladder[0] < 1 or ladder[-1] != b.max:
            raise ExportError(f"{what}: buckets {list(ladder)} must lie in [1, {b.max}] and end at its max {b.max}")
        if not b.axes:
            raise ExportError(f"{what} is on no axis: give axes=[(input name, axis), ...]")
        for inp, axis in b.axes:
            if inp not in examples:
                raise ExportError(f"{what} is on input {inp!r}, which example_args lacks (inputs: "
                                  f"{', '.join(examples)})")
            shape = examples[inp].shape
            if not -len(shape) <= axis < len(shape):
                raise ExportError(f"{what} is on axis {axis} of input {inp!r}, which has shape {list(shape)}")
            axis %= len(shape)
            if axes[inp][axis]:
                raise ExportError(f"axis {axis} of input {inp!r} is in bounds {axes[inp][axis]!r} and {name!r}")
            if shape[axis] != b.max:
                raise ExportError(f"input {inp!r} axis {axis} is {shape[axis]} in example_args; give the example at "
                                  f"the max {b.max} of {what}")
            axes[inp][axis] = name
        kind = af.BoundKind.BATCH if b.batch else af.BoundKind.LENGTH
        specs.append(bm.BoundSpec(name, kind, b.max, ladder))
    batch = [s.name for s in specs if s.kind == af.BoundKind.BATCH]
    if len(batch) > 1:
        raise ExportError(f"bounds {batch} are all batch bounds; a program has at most one")
    inputs = tuple(bm.TensorSpec(n, arr.dtype.name, tuple(arr.shape), tuple(axes[n])) for n, arr in examples.items())
    for s in inputs:
        if batch and batch[0] not in s.axes:
            raise ExportError(f"input {s.name!r} has no axis of batch bound {batch[0]!r}: calls batched together "
                              "could not each have their own")
    return tuple(specs), inputs


def _flatten_outputs(result) -> list[tuple[str, Any]]:
    """The function's outputs as (name, array): a dict's paths joined with ".", a bare array named "output"."""
    leaves = jax.tree_util.tree_flatten_with_path(result)[0]
    out = [(path_name(path) or "output", leaf) for path, leaf in leaves]
    if not out:
        raise ExportError("the function returned no arrays")
    return out


def _body(fn: Callable, treedef, bounds: tuple[bm.BoundSpec, ...], inputs: tuple[bm.TensorSpec, ...]):
    """The program over its positional arguments, in signature order: inputs, each bound's length and mask,
    the weights' leaves. Returns {output name: array}, which jax flattens (and so exports) in sorted name order,
    the order of the manifest's outputs."""
    n_in, n_b = len(inputs), len(bounds)

    def body(*args):
        named = {s.name: a for s, a in zip(inputs, args[:n_in])}
        valid = {b.name: Valid(args[n_in + 2 * i], args[n_in + 2 * i + 1]) for i, b in enumerate(bounds)}
        params = jax.tree_util.tree_unflatten(treedef, args[n_in + 2 * n_b:])
        pairs = _flatten_outputs(fn(params, named, valid))
        outputs = dict(pairs)
        if len(outputs) != len(pairs):
            raise ExportError(f"two outputs flatten to one name: {[n for n, _ in pairs]}")
        return outputs
    return body


def _avals(sigs) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(s.shape, jnp.dtype(af.numpy_dtype(s.dtype))) for s in sigs]


def _output_specs(body, bounds: tuple[bm.BoundSpec, ...], inputs: tuple[bm.TensorSpec, ...],
                  table: tuple[af.WeightFile, ...]) -> tuple[bm.TensorSpec, ...]:
    """Each output's spec, in the body's (sorted) order: its shape with every bound at its max, and which bound each
    axis follows, read off abstract evaluations with one bound at a time at another size: its next bucket down
    (a size the function is traced at anyway), or max - 1 when it has one bucket."""
    def shapes(sizes) -> dict[str, jax.ShapeDtypeStruct]:
        args, _ = bm.program_signature(bounds, inputs, (), table, sizes)
        return jax.eval_shape(body, *_avals(args))

    top = tuple(b.max for b in bounds)
    base = shapes(top)
    axes = {n: [""] * len(o.shape) for n, o in base.items()}
    for i, b in enumerate(bounds):
        other = b.buckets[-2] if len(b.buckets) > 1 else b.max - 1
        probe = shapes(tuple(other if j == i else s for j, s in enumerate(top)))
        for n, o in base.items():
            for a, (d, e) in enumerate(zip(o.shape, probe[n].shape)):
                if d == e:
                    continue
                if (d, e) != (b.max, other) or axes[n][a]:
                    raise ExportError(f"output {n!r} axis {a} is {d} with bound {b.name!r} at {b.max} and {e} at "
                                      f"{other}; an output axis has one bound's size or a fixed one")
                axes[n][a] = b.name
    batch = next((b.name for b in bounds if b.kind == af.BoundKind.BATCH), None)
    specs = []
    for n, o in base.items():
        dtype = np.dtype(o.dtype).name
        if not af.NAME.match(n):
            raise ExportError(f"output {n!r}: a name keeps to letters, digits, '_', '.' and '-'")
        if dtype not in af.DTYPES:
            raise ExportError(f"output {n!r} has dtype {dtype}, which an artifact cannot hold")
        if batch and batch not in axes[n]:
            raise ExportError(f"output {n!r} has no axis of batch bound {batch!r}: calls batched together could "
                              "not each get theirs")
        specs.append(bm.TensorSpec(n, dtype, tuple(int(d) for d in o.shape), tuple(axes[n])))
    return tuple(specs)


def stage_bounded(fn: Callable, params: Any, example_args: Mapping[str, Any], out_dir, *,
                  bounds: Mapping[str, Bound], name: str = "program", embedding: bm.EmbeddingTask | None = None,
                  tokenizer_dir=None, platform: str = "cpu", progress: bool = True, mlir: bool = False,
                  exported: bool = False) -> bm.BoundedManifest:
    """Write the bounded-program artifact of `fn` to `out_dir` (empty or absent) and return its manifest.

    fn(params, inputs, valid) -> outputs: traced once per program; `params` has the structure given here (its
        arrays become arguments of every body).
    example_args: {input name: array}, each at the maxima of its bounds, with realistic values.
    bounds: {name: Bound(max, axes=[(input, axis), ...], buckets=None, batch=False)}; at most one batch bound.
    embedding: an EmbeddingTask(tokens=input, output=output, vocab=V) when the program is an embedding model that
        /v1/embeddings serves; tokenizer_dir: a directory whose tokenizer files are copied in (for text input).
    mlir, exported: also write each body's `.mlir` and `.exported` (as `stage`); the runtime needs neither.
    Refuses (ExportError) a program that reads padding, naming the output and the bucket; the export needs no
    accelerator and loads no PJRT plugin; the same inputs give the same bytes.
    """
    if platform not in ("cpu", "cuda"):
        raise ExportError(f"platform {platform!r}: bodies are lowered for cpu or cuda")
    if sys.byteorder != "little":
        raise ExportError("weight files are raw little-endian; exporting from a big-endian host is not supported")
    examples = _examples(example_args)
    bound_specs, inputs = _resolve_bounds(bounds, examples)
    flat, treedef = flatten_weights(params)
    # The weights' part of each signature; the files they name are written after every check passed.
    table = tuple(af.WeightFile(slot, w.dtype.name, tuple(w.shape), w.nbytes, "") for slot, w in flat.items())
    body = _body(fn, treedef, bound_specs, inputs)
    outputs = _output_specs(body, bound_specs, inputs, table)
    if embedding is not None:
        try:
            bm.check_embedding(bound_specs, inputs, outputs, embedding)
        except af.ManifestError as e:
            raise ExportError(str(e)) from None

    combos = list(itertools.product(*(b.buckets for b in bound_specs)))
    bar = progress_bar(len(combos) + len(flat), "stage_bounded", progress)
    run = jax.jit(body)
    weights = [jnp.asarray(w) for w in flat.values()]
    rng = np.random.default_rng(0)
    planned, roundings = [], []
    for sizes in combos:
        pname = bm.program_name(bound_specs, sizes)
        bar.set_postfix_str(pname)
        args, results = bm.program_signature(bound_specs, inputs, outputs, table, sizes)
        roundings = output_roundings(jax.make_jaxpr(body)(*_avals(args)))
        check_padding(run, pname, bound_specs, inputs, outputs, dict(zip((b.name for b in bound_specs), sizes)),
                      examples, weights, roundings, rng)
        planned.append((pname, sizes, args, results, _export(body, pname, args, results, platform)))
        bar.update()
    # The last combination is every bound at its max: the longest paths.
    outputs = tuple(dataclasses.replace(o, roundings=tuple(sorted(r.items()))) for o, r in zip(outputs, roundings))

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"output directory {str(out)!r} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    programs, calling_convention = [], 0
    for pname, sizes, args, results, exp in planned:
        calling_convention = int(exp.calling_convention_version)
        files = write_body(out, exp, mlir=mlir, exported=exported)
        programs.append(bm.Program(name=pname, sizes=sizes, **dataclasses.asdict(files), inputs=args,
                                   outputs=results, kept_inputs=tuple(exp.module_kept_var_idx)))
    files = write_weights(out, flat, bar)
    bar.close()
    m = bm.BoundedManifest(
        schema=bm.SCHEMA_V2, name=name, bounds=bound_specs, inputs=inputs, outputs=outputs, programs=tuple(programs),
        weights=files, versions=af.Versions(jax=jax.__version__, jaxlib=jaxlib.__version__,
                                            calling_convention=calling_convention, platform=platform),
        tokenizer_files=copy_tokenizer(out, tokenizer_dir), embedding=embedding)
    (out / bm.BOUNDED_NAME).write_text(m.to_json())
    return bm.load_bounded(out)


def _export(body, pname: str, args, results, platform: str):
    """jax.export one program; a weight the function never reads is refused by name, an unread input or valid
    length is kept (every program takes what its signature says)."""
    exp = export_fn(body, _avals(args), platform=platform)
    dropped = sorted(set(range(len(args))) - set(exp.module_kept_var_idx))
    weights = [args[i].slot for i in dropped if args[i].role == Role.WEIGHT]
    if weights:
        raise ExportError(f"program {pname!r}: the function never reads weights {weights}; leave them out of params")
    if dropped:
        exp = export_fn(body, _avals(args), platform=platform, keep_unused=True)
    text = exp.mlir_module()
    check_custom_calls(pname, text, platform)
    why = af.signature_mismatch(args, results, (),
                                af.main_signature(exp.mlir_module_serialized, f"program {pname!r} body"))
    if why:
        raise ExportError(f"program {pname!r}: {why}")
    return exp

