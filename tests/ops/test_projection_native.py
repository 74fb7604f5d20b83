"""The C projection kernel (kernels/projection.c, called through tlaloc_jax/kernels/projection_native.py
as an FFI custom call jax runs in process) against the float64 reference at its tiles' edges, for f32, bf16 and
int8 weights; where out_major_product takes it; its refusals. Served bodies that call it: tests/runtime/test_native_served.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from margins import assert_within
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.projection_native import (NATIVE_PROJECTION, NATIVE_ROWS, native_projection,
                                                  native_projections)
from tlaloc_jax.kernels.quantized_matmul import out_major_product
from tlaloc_jax.kernels.tolerances import relative_error

pytestmark = pytest.mark.numeric

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "int8": np.int8}


def _weight(rng, O, I, dtype):
    if dtype == "int8":
        return rng.integers(-127, 128, (O, I)).astype(np.int8)
    return (rng.standard_normal((O, I)) * 0.5).astype(DTYPES[dtype])


def reference(x, w) -> np.ndarray:
    """sum_i x[m, i] w[o, i] in float64, w widened exactly."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


kernel = jax.jit(native_projection)


# Rows across the kernel's paths: 1 row alone (f32 weight rows 3 side by side, an item's last 1 or 2 alone: outputs
# 101, 50, 52 and 7 leave each); 2 to 8 in one stream, 8, 4, 3 and 2 rows a pass (6 = 4 + 2, 7 =
# 4 + 3); from 9 in panels of 16 rows (32 with AVX-512), one partly filled (9, 17, 50), whole (16, 48), and past an
# item's block of rows (f32: 48 rows, 96 with AVX-512: 50, 97; narrow weights: 128, 256 with AVX-512: 130, 260);
# inputs a whole number of vectors and not (the scalar tail); outputs past whole 6-row weight tiles by each of 1 to
# 5, and not a multiple of the 48-output items; narrow inputs in blocks of 2048 and a part.
@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 48, 50, 97, 130, 260])
def test_kernel_matches_reference(dtype, rows):
    rng = np.random.default_rng(rows)
    for O, I in ((101, 64), (50, 37), (7, 200), (52, 24), (99, 16), (13, 2100)):
        x = rng.standard_normal((rows, I)).astype(np.float32)
        w = _weight(rng, O, I, dtype)
        got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(w)))
        want = reference(x, w)
        assert got.shape == (rows, O) and got.dtype == np.float32
        bound = tol.bound(I)          # an I-term f32 dot summed in another order; the widening is exact
        assert_within(relative_error(got, want), bound, f"native projection {dtype}, {rows} x {I} -> {O}")
        # Controls that must fail: one input left out of every sum, and the weight's rows read one output off.
        short = reference(x[:, :-1], w[:, :-1])
        assert relative_error(short, want) > 10 * bound
        assert relative_error(np.asarray(kernel(jnp.asarray(x), jnp.asarray(np.roll(w, 1, axis=0)))), want) > 10 * bound


def test_out_major_product_takes_the_kernel_where_turned_on():
    """Under native_projections(), out_major_product's body calls the kernel for the rows and dtypes of
    NATIVE_ROWS, and XLA's forms past them; without it never; the result within the bound."""
    rng = np.random.default_rng(0)
    I, O = 64, 24
    for dtype, most in NATIVE_ROWS.items():
        w = jnp.asarray(_weight(rng, O, I, {"float32": "f32", "bfloat16": "bf16", "int8": "int8"}[dtype.name]))
        # The most rows it takes and one more; every row count (int8): a prefill-sized call.
        for rows in sorted({1, most, most + 1} - {0}) if most < float("inf") else (1, 300):
            x = jnp.asarray(rng.standard_normal((rows, I)).astype(np.float32)).astype(
                jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32)
            f = jax.jit(lambda x, w: out_major_product(x, w, reduce_one_row=True))
            with native_projections():
                text = f.lower(x, w).as_text()
                got = np.asarray(f(x, w))
            assert (NATIVE_PROJECTION in text) == (rows <= most), (dtype, rows)
            assert NATIVE_PROJECTION not in jax.jit(lambda x, w: out_major_product(x, w, reduce_one_row=True)
                                                    ).lower(x, w).as_text()
            assert_within(relative_error(got, reference(np.asarray(x, np.float32), w)), tol.bound(I),
                          f"out_major_product under native_projections, {dtype}, {rows} rows")


def test_refusals():
    """Weights of another dtype are refused by name; the kernel has no derivative."""
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="f32, bf16 or int8"):
        native_projection(x, jnp.ones((4, 8), jnp.float8_e4m3fn))
    with pytest.raises(TypeError, match="inference-only"):
        jax.grad(lambda x: native_projection(x, jnp.ones((4, 8), jnp.float32)).sum())(x)


def test_export_stages_it_on_cpu(tmp_path):
    """A cpu export names the kernel in its manifest by default, for int8 and for f32 weights (its decode bodies
    call it: one row is within NATIVE_ROWS); --projections xla stages none; native projections on cuda are refused
    by name."""
    from hf_models import build_checkpoint
    from tlaloc_jax.export import ExportError, export_checkpoint
    path = build_checkpoint(tmp_path / "ck", "llama", seed=3)
    kw = dict(batch_ladder=(1,), context_ladder=(32,), block_size=8, prefill_chunk=16, progress=False)
    assert NATIVE_PROJECTION in export_checkpoint(path, tmp_path / "int8", weight_quant="int8", **kw
                                                  ).versions.custom_calls
    assert NATIVE_PROJECTION in export_checkpoint(path, tmp_path / "f32", **kw).versions.custom_calls
    assert NATIVE_PROJECTION not in export_checkpoint(path, tmp_path / "xla", weight_quant="int8", projections="xla",
                                                      **kw).versions.custom_calls
    with pytest.raises(ExportError, match="projections 'native' is a C kernel for the CPU on one device"):
        export_checkpoint(path, tmp_path / "cuda", platform="cuda", projections="native", **kw)
