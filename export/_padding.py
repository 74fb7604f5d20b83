"""The padding check of stage_bounded: a program must give, on the valid part of each output, what it gives at the
exact size, whatever lies in the padding.

For each program (one bucket per bound) the check builds a call the bucket serves with as much padding as it can
hold: each length bound at the smallest size the bucket serves (one more than the bucket below), and, with a batch
bound, that many live rows, whose lengths cycle through that size, 1 and the whole bucket (rows of one body have
their own lengths: the runtime batches calls of different sizes). The valid part holds the example inputs; every
padded position and padded row holds garbage: large floats (16 times the example's largest magnitude, random
signs, never NaN), ids drawn from the example's range (an embedding lookup of a padded id still reads a real row),
random booleans. The program runs on that padded call, and each live row runs alone at its exact size; the valid
part of each output must equal the exact result within the tolerance model's bound for the padded body's longest
path (export/_roundings.py): the two are the same math rounded in another order. Integer and boolean outputs must
be equal.

A function that reads padding (a mean over the padded axis, a softmax over unmasked keys, row 0's length used for
every row) mixes the garbage in and differs by about the garbage's share of the value, many orders above the bound.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from tlaloc_jax import artifact as af
from tlaloc_jax.artifact import bounded_manifest as bm
from tlaloc_jax.kernels import tolerances as tol

from ._entries import ExportError

GARBAGE_SCALE = 16.0


def _garbage(rng: np.random.Generator, shape: tuple[int, ...], example: np.ndarray) -> np.ndarray:
    if example.dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(example.dtype, np.integer):
        return rng.integers(int(example.min()), int(example.max()) + 1, shape).astype(example.dtype)
    scale = max(float(np.max(np.abs(example.astype(np.float64)))), 1.0)
    return (rng.standard_normal(shape) * GARBAGE_SCALE * scale).astype(example.dtype)


def _live_rows(bounds: tuple[bm.BoundSpec, ...], sizes: Mapping[str, int]) -> list[dict[str, int]]:
    """Each live row's size per bound (the batch bound's entry is the row's index)."""
    smallest = {b.name: (b.buckets[b.buckets.index(sizes[b.name]) - 1] + 1 if sizes[b.name] != b.buckets[0] else 1)
                for b in bounds}
    batch = next((b for b in bounds if b.kind == af.BoundKind.BATCH), None)
    rows = smallest[batch.name] if batch else 1
    out = []
    for r in range(rows):
        row = {b.name: (smallest[b.name], 1, sizes[b.name])[r % 3] for b in bounds if b is not batch}
        if batch:
            row[batch.name] = r
        out.append(row)
    return out


def _region(spec: bm.TensorSpec, row: Mapping[str, int], batch: str | None) -> tuple:
    """The index of one row's valid part of a tensor."""
    return tuple(slice(row[a], row[a] + 1) if a and a == batch else slice(0, row[a]) if a else slice(None)
                 for a in spec.axes)


def _valid_args(bounds: tuple[bm.BoundSpec, ...], sizes: Mapping[str, int], rows: list[dict[str, int]],
                batch: str | None) -> list[np.ndarray]:
    """Each bound's VALID_LENGTH and VALID_MASK for `rows` live in a body of `sizes`; padded rows are whole rows of
    garbage."""
    args = []
    for b in bounds:
        n = sizes[b.name]
        if b.name == batch:
            length = np.int32(len(rows))
        elif batch is None:
            length = np.int32(rows[0][b.name])
        else:
            length = np.full(sizes[batch], n, np.int32)
            length[:len(rows)] = [r[b.name] for r in rows]
        args += [np.asarray(length, np.int32), np.arange(n, dtype=np.int32) < np.asarray(length)[..., None]]
    return args


def check_padding(run: Callable, program: str, bounds: tuple[bm.BoundSpec, ...], inputs: Sequence[bm.TensorSpec],
                  outputs: Sequence[bm.TensorSpec], sizes: Mapping[str, int], examples: Mapping[str, np.ndarray],
                  weights: Sequence, roundings: Sequence[Mapping[str, int]], rng: np.random.Generator) -> None:
    """Refuse (ExportError naming the output and the bucket) a program whose padded result differs from its
    exact-size result. run(*inputs, *valid, *weights) -> {output name: array}: the program's body, jitted;
    roundings: each output's path length in the padded body."""
    batch = next((b.name for b in bounds if b.kind == af.BoundKind.BATCH), None)
    rows = _live_rows(bounds, sizes)
    padded = []
    for spec in inputs:
        example = examples[spec.name]
        arr = _garbage(rng, bm.shape_at(spec, sizes), example)
        for row in rows:
            region = _region(spec, row, batch)
            arr[region] = example[region]
        padded.append(arr)
    got = run(*padded, *_valid_args(bounds, sizes, rows, batch), *weights)

    for row in rows:
        exact_sizes = {**row, batch: 1} if batch else dict(row)
        one = {**row, batch: 0} if batch else row
        exact_inputs = [examples[s.name][_region(s, row, batch)] for s in inputs]
        want = run(*exact_inputs, *_valid_args(bounds, exact_sizes, [one], batch), *weights)
        for spec, path in zip(outputs, roundings):
            w = np.asarray(want[spec.name])
            where = _describe(bounds, sizes, row, batch, program, len(rows))
            if not np.all(np.isfinite(w.astype(np.float64))):
                raise ExportError(f"output {spec.name!r} is not finite at exact size ({where}) on the example "
                                  "inputs; the padding check needs finite results: give example_args realistic "
                                  "values")
            g = np.asarray(got[spec.name])[_region(spec, row, batch)]
            if af.numpy_dtype(spec.dtype).kind in "biu":
                if not np.array_equal(g, w):
                    raise ExportError(f"output {spec.name!r} reads padding: {where}, its padded result differs "
                                      "from its exact-size result (an integer output must be equal); "
                                      f"{_ADVICE}")
                continue
            err, bound = tol.relative_error(g, w), tol.bound(dict(path))
            if not err <= bound:
                raise ExportError(f"output {spec.name!r} reads padding: {where}, its padded result differs from its "
                                  f"exact-size result by {err:.3g} of its scale, over the tolerance model's "
                                  f"{bound:.3g} ({_count(path)} roundings); {_ADVICE}")


_ADVICE = ("mask what lies past each bound's valid length (valid[bound].mask, valid[bound].length) before reducing "
           "over it or mixing it into the valid part")


def _count(path: Mapping[str, int]) -> str:
    return " + ".join(f"{n} {d}" for d, n in sorted(path.items())) or "0"


def _describe(bounds, sizes, row, batch, program, live: int) -> str:
    bucket = ", ".join(f"{b.name} {sizes[b.name]}" for b in bounds)
    call = ", ".join(f"{b.name} {row[b.name]}" for b in bounds if b.name != batch)
    rows = f"row {row[batch]} of {live} live rows" if batch else "the call"
    return f"in bucket {bucket} (program {program!r}), {rows}{' with ' + call if call else ''}"
