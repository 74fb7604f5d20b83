"""Bounded programs, the author's side: `Bound` marks input axes whose size is known only at run time (at most a
maximum), and `Valid` is what the function receives for each bound. `tlaloc_jax.stage_bounded` exports the
function (export/_stage_bounded.py); `tlaloc_jax.serve.BoundedProgram` serves it.

    def embed(params, inputs, valid):          # inputs: {"ids": [B, T]}; valid: {"rows": Valid, "tokens": Valid}
        mask = valid["tokens"].mask            # [B, T]: True where a row has a token
        ...
        return {"embedding": pooled}           # [B, D]

    bounds = {"rows": Bound(max=8, axes=[("ids", 0)], batch=True),
              "tokens": Bound(max=128, axes=[("ids", 1)])}

The function sees every bounded axis padded to a bucket; what lies past a bound's valid length is garbage it must
never read (the exporter runs each bucket with garbage there and refuses a function whose result changes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Bound:
    """Axes whose size is known only at run time, at most `max`; all of them have the same size in a call.

    axes: (input name, axis) pairs. buckets: the sizes a body is exported for (default: the powers of two below
    max, and max); a call runs in the smallest that holds it. batch: the axes are rows (every input and output
    has one), so several calls can share one body, each taking rows of it.
    """

    max: int
    axes: tuple[tuple[str, int], ...]
    buckets: tuple[int, ...] | None = None
    batch: bool = False

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple((str(n), int(a)) for n, a in self.axes))
        if self.buckets is not None:
            object.__setattr__(self, "buckets", tuple(sorted({int(b) for b in self.buckets})))

    @property
    def ladder(self) -> tuple[int, ...]:
        if self.buckets is not None:
            return self.buckets
        powers = []
        p = 1
        while p < self.max:
            powers.append(p)
            p *= 2
        return (*powers, self.max)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Valid:
    """A bound's valid part. length: int32 [] (for a batch bound: the live rows; without one: the call's size), or
    [B], each row's size, when the program also has a batch bound. mask: bool, `arange(N) < length`: [N] or
    [B, N]."""

    length: jax.Array
    mask: jax.Array


def exact_valid(bounds: Mapping[str, Bound], inputs: Mapping[str, jax.Array]) -> dict[str, Valid]:
    """What a call whose inputs are exactly their sizes (no padding) receives: every position valid. The same
    function then runs in process as it runs served: `fn(params, inputs, exact_valid(bounds, inputs))`."""
    sizes = {}
    for name, b in bounds.items():
        n, axis = b.axes[0]
        sizes[name] = int(jnp.shape(inputs[n])[axis])
    rows = next((sizes[n] for n, b in bounds.items() if b.batch), None)
    out = {}
    for name, b in bounds.items():
        size = sizes[name]
        if b.batch or rows is None:
            out[name] = Valid(jnp.int32(size), jnp.ones((size,), bool))
        else:
            out[name] = Valid(jnp.full((rows,), size, jnp.int32), jnp.ones((rows, size), bool))
    return out
