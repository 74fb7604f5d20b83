"""The C int4 projection kernel (kernels/projection_int4.c, called through
tlaloc_jax/kernels/projection_native.py as an FFI custom call jax runs in process) against the float64 reference on
the same codes, for groups of 32, 64 and 128, decode and prefill rows, and rows whose inputs end inside a chunk; the
bound counts what quantizing x to int8 per block adds (tolerances.activation_quantization_std). Controls: the kernel
fed the codes' nibbles swapped, or one group's scale dropped, fails the same bound. Also: zero points (uint4), where
quantized_matmul takes the kernel, and its refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from margins import assert_within
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.projection_native import (NATIVE_INT4_PROJECTION, native_int4_projection,
                                                  native_projections)
from tlaloc_jax.kernels.quantized_matmul import (QuantizedWeight, dequantize, quantize, quantized_matmul,
                                                 quantized_matmul_reference, to_out_major)

pytestmark = pytest.mark.numeric

kernel = jax.jit(native_int4_projection)


def out_major_int4(rng, I, O, group) -> QuantizedWeight:
    w = rng.standard_normal((I, O)).astype(np.float32) * 0.5
    q = to_out_major(quantize(jnp.asarray(w), "int4", group))
    return QuantizedWeight(np.asarray(q.codes), np.asarray(q.scales), q.scheme, q.group, q.compute, out_major=True)


def blocks_of(I: int, group: int) -> np.ndarray:
    """The kernel's block of x for each input: the inputs of 16 consecutive code bytes (low and high nibbles)."""
    i = np.arange(I)
    byte = i // group * (group // 2) + i % group % (group // 2)
    return byte // 16


def excess(got, x, q: QuantizedWeight, want) -> float:
    """The largest |got - want| over its allowance: what quantizing x adds (confidence_for the compared count
    standard deviations) plus the f32 roundings of the kernel's sums, whose terms are at most
    s (nibble + offset) |x| <= 30 s |x| (a chunk sum a lane over I / 128 chunks, the lanes, the G-term offset).
    q: the out-major int4 or uint4 weight want was computed from."""
    group = q.group
    w = dequantize(q)                                                             # [I, O]
    std = tol.activation_quantization_std(x, w, blocks_of(x.shape[1], group))
    s = np.repeat(np.asarray(q.scales, np.float64), group, axis=1)                # [O, I]
    terms = 30.0 * np.abs(np.asarray(x, np.float64)) @ s.T
    I = x.shape[1]
    allowed = tol.confidence_for(want.size) * std + tol.bound(I // 128 + 8 + I // group) * terms
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / allowed))


# Rows across the tiles (4 x 4 with AVX-512, 2 x 2 otherwise: 1 to 8 rows, partial tiles) and the items' blocks of
# 64 rows (130: prefill, a partial block); outputs past whole tiles and 32-output items; inputs a whole number of
# 64-byte chunks and not (96 and 160 with groups of 32, 192 with 64: the row's last chunk partial).
SHAPES = {32: ((101, 256), (7, 96), (5, 160), (50, 2048)), 64: ((101, 256), (7, 192), (50, 2048)),
          128: ((101, 256), (9, 384), (50, 2048))}


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 16, 17, 32, 130])
def test_int4_kernel_matches_reference(group, rows):
    rng = np.random.default_rng(rows * 1000 + group)
    for O, I in SHAPES[group]:
        q = out_major_int4(rng, I, O, group)
        x = rng.standard_normal((rows, I)).astype(np.float32)
        got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(q.codes), jnp.asarray(q.scales)))
        assert got.shape == (rows, O) and got.dtype == np.float32
        want = quantized_matmul_reference(x, q)
        assert_within(excess(got, x, q, want), 1.0,
                      f"native int4 projection, g {group}, {rows} x {I} -> {O}")


@pytest.mark.parametrize("group", [32, 128])
def test_controls_a_wrong_nibble_order_or_a_dropped_scale_fail(group):
    """The kernel fed the codes with each byte's nibbles swapped (a kernel reading them in the wrong order), or
    with one group's scale replaced by 1 (a kernel that drops it), is out of the bound the right one keeps."""
    rng = np.random.default_rng(group)
    O, I, rows = 40, 512, 3
    q = out_major_int4(rng, I, O, group)
    x = rng.standard_normal((rows, I)).astype(np.float32)
    want = quantized_matmul_reference(x, q)
    u = q.codes.view(np.uint8)
    swapped = ((u >> 4) | (u << 4)).astype(np.uint8).view(np.int8)
    dropped = q.scales.copy()
    dropped[:, 1] = 1.0
    for codes, scales in ((q.codes, q.scales), (swapped, q.scales), (q.codes, dropped)):
        got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scales)))
        ratio = excess(got, x, q, want)
        if codes is q.codes and scales is q.scales:
            assert_within(ratio, 1.0, f"native int4 projection, g {group}")
        else:
            assert ratio > 10, ratio


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5])
def test_zero_points_come_off_per_group(group, rows):
    """uint4: unsigned nibbles less their group's zero point ((code - zero) * scale), against numpy; a row's last
    chunk partial (320 inputs) where the group allows it, one row and a tile and one more."""
    rng = np.random.default_rng(3)
    O, I = 37, 320 if group < 128 else 384
    u = rng.integers(0, 16, (O, I)).astype(np.uint8)
    zeros = rng.integers(0, 16, (O, I // group)).astype(np.int8)
    scales = (rng.random((O, I // group)) * 0.1 + 0.01).astype(np.float32)
    g = u.reshape(O, I // group, 2, group // 2)
    codes = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(O, I // 2).view(np.int8)
    w = ((u.reshape(O, I // group, group).astype(np.float64) - zeros[..., None]) * scales[..., None]).reshape(O, I)
    x = rng.standard_normal((rows, I)).astype(np.float32)
    want = x.astype(np.float64) @ w.T
    got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(zeros)))
    std = tol.activation_quantization_std(x, w.T, blocks_of(I, group))
    terms = 30.0 * np.abs(x.astype(np.float64)) @ np.repeat(scales.astype(np.float64), group, axis=1).T
    allowed = tol.confidence_for(want.size) * std + tol.bound(I // 128 + 8 + I // group) * terms
    assert_within(float(np.max(np.abs(got - want) / allowed)), 1.0, f"uint4 zero points, g {group}")
    # Control: the same bytes read as int4 (signed nibbles, no zero points) are far out.
    wrong = np.asarray(kernel(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scales)))
    assert float(np.max(np.abs(wrong - want) / allowed)) > 10


@pytest.mark.parametrize("rows", [1, 4, 300])
def test_quantized_matmul_takes_the_kernel_under_native_projections(rows):
    """Out-major int4 weights take the kernel at every row count under native_projections (prefill too), and
    only there; its result is quantized_matmul's within the activation bound."""
    rng = np.random.default_rng(rows)
    q = out_major_int4(rng, 128, 24, 32)
    qj = QuantizedWeight(jnp.asarray(q.codes), jnp.asarray(q.scales), "int4", 32, "float32", out_major=True)
    x = jnp.asarray(rng.standard_normal((rows, 128)).astype(np.float32))

    def native(x):
        with native_projections():
            return quantized_matmul(x, qj)

    assert NATIVE_INT4_PROJECTION in jax.jit(native).lower(x).as_text()
    assert NATIVE_INT4_PROJECTION not in jax.jit(lambda x: quantized_matmul(x, qj)).lower(x).as_text()
    want = quantized_matmul_reference(np.asarray(x), q)
    assert_within(excess(jax.jit(native)(x), np.asarray(x), q, want), 1.0,
                  f"quantized_matmul native int4, {rows} rows")


def test_shapes_the_kernel_cannot_take_are_refused_by_name():
    x = jnp.zeros((2, 64), jnp.float32)
    codes = jnp.zeros((8, 32), jnp.int8)
    with pytest.raises(ValueError, match=r"g one of \(32, 64, 128\).*--projections xla"):
        native_int4_projection(x, codes, jnp.ones((8, 4), jnp.float32))          # groups of 16
    with pytest.raises(ValueError, match="codes int8"):
        native_int4_projection(x, jnp.zeros((8, 16), jnp.int8), jnp.ones((8, 2), jnp.float32))
    with pytest.raises(ValueError, match="zeros int8"):
        native_int4_projection(x, codes, jnp.ones((8, 2), jnp.float32), jnp.zeros((8, 2), jnp.float32))
