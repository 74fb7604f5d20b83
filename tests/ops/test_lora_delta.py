"""The adapters' delta (tlaloc_jax.lora.delta) with A and B held in bf16 (export --lora-dtype bf16, the default)
against the same adapters in f32, through XLA's products and through the C projection kernel: within the tolerance
model's storage rounding (tolerances.lora_storage_roundings) and no further; and against the float64 product of the
rounded adapters within an f32 product's bound (the products widen bf16 exactly). Controls: the f32 bound alone
refuses the bf16 delta (its rounding is real), and a row read one slot off breaks the bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from margins import assert_within
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.projection_native import native_projections
from tlaloc_jax.lora import LayerAdapters, delta

pytestmark = pytest.mark.numeric

ROWS, I, O, SLOTS, RANK = 8, 256, 192, 9, 16


def _adapters(rng):
    """Slot 0 zero (no adapter), slots 1..8 random; each row in its own slot."""
    a = (rng.standard_normal((SLOTS, RANK, I)) * 0.1).astype(np.float32)
    b = (rng.standard_normal((O, SLOTS, RANK)) * 0.1).astype(np.float32)
    a[0], b[:, 0] = 0, 0
    scale = np.r_[0.0, rng.uniform(0.5, 2.0, SLOTS - 1)].astype(np.float32)
    return a, b, scale


def _delta(x, a, b, scale, slots, native: bool):
    la = LayerAdapters({"q_proj": (jnp.asarray(a), jnp.asarray(b))}, jnp.asarray(scale), jnp.asarray(slots))
    with native_projections(native):
        return np.asarray(jax.jit(lambda x, la: delta(la, "q_proj", x))(jnp.asarray(x), la))


def reference(x, a, b, scale, slots) -> np.ndarray:
    """scale[s] (x A[s]) B[s] per row in float64, A and B as given (widened exactly)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    s = slots[:, 0]
    xa = np.einsum("bti,bri->btr", np.asarray(x, np.float64), a[s])
    return np.einsum("btr,obr->bto", xa, b[:, s]) * scale[s][:, None, None]


@pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])
def test_bf16_adapters_stay_within_their_storage_rounding(native):
    rng = np.random.default_rng(61)
    x = rng.standard_normal((ROWS, 1, I)).astype(np.float32)
    a, b, scale = _adapters(rng)
    slots = np.arange(1, ROWS + 1, dtype=np.int32)[:, None]
    a16, b16 = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
    got16 = _delta(x, a16, b16, scale, slots, native)
    got32 = _delta(x, a, b, scale, slots, native)
    products = I + RANK + 2                  # x A, its product with B, the scale
    f32 = tol.bound(products)
    # The delta of the rounded adapters, computed as f32 products of exactly widened bf16 values.
    assert_within(tol.relative_error(got16, reference(x, a16, b16, scale, slots)), f32, "bf16 delta, exact widening")
    storage = tol.bound({"float32": products, **tol.lora_storage_roundings(1, "bfloat16")})
    err = tol.relative_error(got16, got32)
    assert_within(err, storage, "bf16 adapters against f32 adapters")
    assert err > f32, "control: bf16 storage rounds more than an f32 product"
    off = _delta(x, a16, b16, scale, (slots % (SLOTS - 1)) + 1, native)        # each row one slot on
    assert tol.relative_error(off, got32) > 10 * storage, "control: a row one slot off"
