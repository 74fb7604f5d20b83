"""One tolerance table for comparing a kernel with its reference form, keyed by dtype.

The key is the dtype whose rounding separates the two sides: comparing two f32 computations on the
same inputs (even inputs read from a bf16 pool, since both sides widen them to f32 before any
arithmetic) uses "float32"; comparing a bf16 pool against an f32 one uses "bfloat16".
Errors are measured by `relative_error`: max |actual - expected| / max |expected|.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes  # noqa: F401  (registers "bfloat16" with numpy)
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
    reorder: float    # same operations, sums in another order (blockwise vs one-pass online softmax)
    reference: float  # fast form vs the naive reference form (different softmax and P.V arithmetic)
    grad: float       # a custom_vjp gradient vs jax.grad of the reference form


TOLERANCES: dict[str, Tolerance] = {
    # The seed measured blockwise vs one-pass within 2.4e-7 at the block edges; f32 eps is 1.2e-7.
    "float32": Tolerance(reorder=2.5e-7, reference=1e-6, grad=1e-5),
    # bf16 keeps 8 significant bits: one rounding of each key and value is up to 2^-9 = 2e-3 relative,
    # and a softmax over rounded scores moves the output by a few of those.
    # Reordering is f32 arithmetic whatever the storage dtype, hence the f32 bound.
    "bfloat16": Tolerance(reorder=2.5e-7, reference=2e-2, grad=2e-2),
}


def tolerance(dtype) -> Tolerance:
    """dtype: anything np.dtype accepts (jnp.float32, "bfloat16", an array's .dtype)."""
    name = np.dtype(dtype).name
    if name not in TOLERANCES:
        raise KeyError(f"no tolerance for dtype {name}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[name]


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|, in float64; 0 vs 0 is 0, NaN anywhere is inf."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if not (np.all(np.isfinite(actual)) and np.all(np.isfinite(expected))):
        return float("inf")
    err = np.max(np.abs(actual - expected), initial=0.0)
    scale = np.max(np.abs(expected), initial=0.0)
    if scale == 0:
        return 0.0 if err == 0 else float("inf")
    return float(err / scale)
