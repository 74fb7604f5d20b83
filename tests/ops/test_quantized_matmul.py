"""tlaloc_jax/kernels/quantized_matmul.py: the quantizers' formulas, the op against its float64 reference on the same
codes (the quantization error is part of the op's definition, so only the op's own roundings are bounded),
the training form's gradients against jax.grad of the plain-jnp reference, and what XLA's CPU backend makes of
the op (the optimized HLO)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from margins import assert_within
from quant_controls import wrong_axis
from tlaloc_jax.artifact import GROUPED_SCHEMES
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.quantized_matmul import (NARROW_REDUCE_ROWS, QuantError, QuantizedWeight, dequantize, pack_int4,
                                                 qat_linear, qat_linear_reference, quantize, quantize_asymmetric,
                                                 quantize_parts, quantized_matmul, quantized_matmul_reference,
                                                 to_out_major, unpack_int4)
from tlaloc_jax.kernels.tolerances import relative_error

I, O, M = 256, 48, 3
SCHEMES = [("int8", 0), ("fp8", 0), ("int4", 32), ("int4", 64), ("int4", 128), ("uint4", 32), ("uint4", 128)]


def _data(seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((I, O)) * rng.uniform(0.2, 3.0, (1, O))).astype(np.float32)
    w[:, 5] = 0.0                                    # an all-zero output channel: scale 1, codes 0
    return rng.standard_normal((M, I)).astype(np.float32), w


def _op_roundings(scheme: str, group: int) -> int:
    """The op's f32 roundings on an output: the I-term dot and the scale; int4: a group's dot, its scale and
    the G-term sum over groups."""
    return group + 1 + I // group if scheme in GROUPED_SCHEMES else I + 1


# --- the formulas -------------------------------------------------------------------------------------


def test_int8_and_fp8_codes_follow_the_formulas():
    _, w = _data()
    s8 = np.where(np.abs(w).max(0) > 0, np.abs(w).max(0) / np.float32(127), 1).astype(np.float32)
    q = quantize(jnp.asarray(w), "int8")
    # XLA divides by the constant 127 as a product with its reciprocal: within one ulp of the quotient.
    np.testing.assert_allclose(np.asarray(q.scales), s8, rtol=2.0 ** -23, atol=0)
    s8 = np.asarray(q.scales)
    want = np.clip(np.round(w / s8), -127, 127).astype(np.int8)         # np.round: half to even
    np.testing.assert_array_equal(np.asarray(q.codes), want)
    assert np.asarray(q.scales)[5] == 1.0 and not np.asarray(q.codes)[:, 5].any()

    f = quantize(jnp.asarray(w), "fp8")
    s448 = np.where(np.abs(w).max(0) > 0, np.abs(w).max(0) / np.float32(448), 1).astype(np.float32)
    np.testing.assert_allclose(np.asarray(f.scales), s448, rtol=2.0 ** -23, atol=0)
    s448 = np.asarray(f.scales)
    want8 = np.clip(w / s448, -448, 448).astype(ml_dtypes.float8_e4m3fn)   # ml_dtypes: nearest even
    np.testing.assert_array_equal(np.asarray(f.codes).view(np.uint8), want8.view(np.uint8))
    assert np.isfinite(np.asarray(f.codes).astype(np.float32)).all()


def test_int4_packs_two_codes_a_byte_and_unpacks_them():
    rng = np.random.default_rng(1)
    for g in (32, 64, 128):
        codes = rng.integers(-7, 8, (I, O)).astype(np.int8)
        packed = pack_int4(jnp.asarray(codes), g)
        assert packed.shape == (I // 2, O) and packed.dtype == jnp.int8
        back = np.asarray(unpack_int4(packed, g)).reshape(I, O)
        np.testing.assert_array_equal(back, codes)
    _, w = _data()
    q = quantize(jnp.asarray(w), "int4", 32)
    assert q.scales.shape == (I // 32, O)
    raw, _ = quantize_parts(jnp.asarray(w), "int4", 32)
    assert np.abs(np.asarray(raw)).max() == 7
    # The dequantized weight is within half a step (scale / 2) of the float one, group by group.
    err = np.abs(dequantize(q) - w).reshape(I // 32, 32, O).max(1)
    assert (err <= np.asarray(q.scales, np.float64) / 2 * (1 + 1e-6)).all()


def test_uint4_codes_follow_the_formulas_and_pack_as_int4():
    """uint4: codes 0..15 in int4's nibble layout, each group's range widened to hold 0 in 15 steps, the zero
    point where 0 falls; dequantized within half a step of the float weight, a channel of one sign too. An
    all-zero channel dequantizes to exact zeros."""
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 16, (I, O)).astype(np.int8)
    back = np.asarray(unpack_int4(pack_int4(jnp.asarray(codes), 64), 64, signed=False)).reshape(I, O)
    np.testing.assert_array_equal(back, codes)
    # Control: read as signed int4, codes 8..15 come back as -8..-1.
    signed = np.asarray(unpack_int4(pack_int4(jnp.asarray(codes), 64), 64)).reshape(I, O)
    assert (signed[codes >= 8] < 0).all()
    _, w = _data()
    w[:, 7] = np.abs(w[:, 7]) + 2.0                         # a channel of one sign: its zero point is 0
    raw, scales, zeros = (np.asarray(a) for a in quantize_asymmetric(jnp.asarray(w), 32))
    wg = w.reshape(I // 32, 32, O)
    lo, hi = np.minimum(wg.min(1), 0), np.maximum(wg.max(1), 0)
    np.testing.assert_allclose(scales, np.where(hi > lo, (hi - lo) / 15, 1), rtol=2.0 ** -22)
    np.testing.assert_array_equal(zeros, np.round(-lo / scales))
    assert raw.min() == 0 and raw.max() == 15 and (zeros[:, 7] == 0).all()
    q = quantize(jnp.asarray(w), "uint4", 32)
    assert q.zeros.dtype == jnp.int8 and q.zeros.shape == q.scales.shape == (I // 32, O)
    err = np.abs(dequantize(q) - w).reshape(I // 32, 32, O).max(1)
    assert (err <= np.asarray(q.scales, np.float64) / 2 * (1 + 1e-5)).all()
    assert not dequantize(q)[:, 5].any()


def test_int4_reads_a_code_of_minus_eight():
    """Symmetric GPTQ's codes are q - 8 in [-8, 7]: -8 packs, unpacks and dequantizes as itself, in- and
    out-major, and the matmul reads it."""
    codes = np.full((64, 4), -8, np.int8)
    codes[1::2] = 7
    q = QuantizedWeight(pack_int4(jnp.asarray(codes), 32), jnp.ones((2, 4), jnp.float32), "int4", 32)
    np.testing.assert_array_equal(dequantize(q), codes.astype(np.float64))
    np.testing.assert_array_equal(dequantize(to_out_major(jax.tree.map(np.asarray, q))), codes.astype(np.float64))
    x = np.ones((1, 64), np.float32)
    np.testing.assert_array_equal(np.asarray(quantized_matmul(jnp.asarray(x), q)), np.full((1, 4), -8 * 32 + 7 * 32))


def test_bad_schemes_and_groups_are_refused_by_name():
    _, w = _data()
    with pytest.raises(QuantError, match="scheme 'int3'"):
        quantize(jnp.asarray(w), "int3")
    with pytest.raises(QuantError, match="group size 48"):
        quantize(jnp.asarray(w), "int4", 48)
    with pytest.raises(QuantError, match="do not tile 96"):
        quantize(jnp.asarray(w[:96]), "int4", 64)
    with pytest.raises(QuantError, match="uint4 group size 0"):
        quantize(jnp.asarray(w), "uint4")
    with pytest.raises(QuantError, match="zero points: quantize_asymmetric"):
        quantize_parts(jnp.asarray(w), "uint4", 32)


# --- the op against its reference --------------------------------------------------------------------


@pytest.mark.numeric
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_op_matches_its_reference_on_the_same_codes(scheme, group, compute):
    x, w = _data()
    q = quantize(jnp.asarray(w), scheme, group, compute=compute)
    got = np.asarray(jax.jit(quantized_matmul)(jnp.asarray(x), q))
    want = quantized_matmul_reference(x, q)       # x rounded to the compute dtype on both sides
    bound = tol.bound(_op_roundings(scheme, group))
    assert_within(relative_error(got, want), bound, f"quantized_matmul {scheme} g{group} {compute}")
    # Control: the scales one output channel off break it far beyond the bound.
    shifted = dataclasses.replace(q, scales=jnp.roll(q.scales, 1, axis=-1))
    assert relative_error(quantized_matmul_reference(x, shifted), want) > 100 * bound
    if scheme == "uint4":       # Control: the zero points ignored (read as zero) break it too.
        unzeroed = dataclasses.replace(q, zeros=jnp.zeros_like(q.zeros))
        assert relative_error(quantized_matmul_reference(x, unzeroed), want) > 100 * bound


@pytest.mark.numeric
@pytest.mark.parametrize("rows", [1, 3, NARROW_REDUCE_ROWS + 1])
@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_out_major_codes_compute_what_in_major_ones_do(scheme, group, rows):
    """The per-layer layout's out-major codes (a multiply-reduce on CPU up to NARROW_REDUCE_ROWS rows, one included; a dot
    past it) against the float64 reference on the same codes, with bf16 compute; they stand for the same weight as
    the in-major codes. Control: the out-major codes read as if in-major (the wrong axis) break it."""
    x, w = _data(rows)
    x = np.resize(x, (rows, I))
    q = quantize(jnp.asarray(w), scheme, group, compute="bfloat16")
    qo = to_out_major(jax.tree.map(np.asarray, q))
    assert qo.out_major and qo.shape == q.shape and qo.codes.shape[-2] == O
    np.testing.assert_array_equal(dequantize(qo), dequantize(q))
    got = np.asarray(jax.jit(quantized_matmul)(jnp.asarray(x), qo))
    want = quantized_matmul_reference(x, q)
    bound = tol.bound(_op_roundings(scheme, group))
    assert_within(relative_error(got, want), bound, f"out-major quantized_matmul {scheme} g{group}, {rows} rows")
    wrong = dataclasses.replace(q, codes=jnp.asarray(qo.codes).reshape(q.codes.shape), scales=jnp.asarray(
        qo.scales).reshape(q.scales.shape), zeros=None if qo.zeros is None else jnp.asarray(qo.zeros).reshape(
        q.zeros.shape))
    assert relative_error(np.asarray(jax.jit(quantized_matmul)(jnp.asarray(x), wrong)), want) > 100 * bound


@pytest.mark.numeric
def test_quantized_weights_stay_close_to_the_float_ones():
    """The quantization error itself, as the formats allow: int8 steps of max/127 per channel, fp8's 3 mantissa
    bits, int4's 15 levels per group; a wrong axis (codes per input channel under output-channel scales) is
    several times worse than any of them."""
    x, w = _data()
    exact = x.astype(np.float64) @ w.astype(np.float64)
    errs = {f"{s}{g or ''}": relative_error(quantized_matmul_reference(x, quantize(jnp.asarray(w), s, g)), exact)
            for s, g in SCHEMES}
    int4 = max(errs[f"{s}{g}"] for s, g in SCHEMES if s in GROUPED_SCHEMES)
    assert errs["int8"] < errs["fp8"] < min(v for k, v in errs.items() if k.startswith("int4")), errs
    assert errs["int8"] < 0.02 and int4 < 0.3, errs
    wrong = wrong_axis(w, quantize(jnp.asarray(w), "int8"))
    assert relative_error(quantized_matmul_reference(x, wrong), exact) > 3 * int4


# --- the training form -------------------------------------------------------------------------------


@pytest.mark.numeric
@pytest.mark.parametrize("scheme,group", [("int8", 0), ("fp8", 0), ("int4", 64)])
def test_qat_gradients_exact_for_x_straight_through_for_w(scheme, group):
    x, w = _data(2)
    dy = np.random.default_rng(3).standard_normal((M, O)).astype(np.float32)
    xj, wj, dyj = jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) * dyj)

    dx, dw = jax.jit(jax.grad(loss(lambda x, w: qat_linear(x, w, scheme, group)), argnums=(0, 1)))(xj, wj)
    # x: the exact gradient of the quantized forward, jax.grad of the reference with its real rounding.
    dx_ref = jax.grad(loss(lambda x, w: qat_linear_reference(x, w, scheme, group)))(xj, wj)
    assert_within(relative_error(dx, dx_ref), tol.bound(O + 2), f"qat d/dx {scheme}")
    # w: straight-through, jax.grad of the reference with the rounding replaced by the identity.
    ident = lambda r: r  # noqa: E731
    dw_ste = jax.grad(loss(lambda x, w: qat_linear_reference(x, w, scheme, group, rounding=ident)), argnums=1)(xj, wj)
    # M-term sums, and the reference's w / s * s (a division, a product and the scale's max) around them.
    assert_within(relative_error(dw, dw_ste), tol.bound(M + 4), f"qat d/dw {scheme}")
    # Controls: with the real rounding jax.grad gives an integer scheme's weight almost no gradient (round is
    # flat; only the scales' max moves), and the x gradient through the float weight is off by the
    # quantization error. (fp8's convert_element_type is differentiable in JAX, as the identity: its
    # real-rounding gradient is the straight-through one, so it has no such control.)
    if scheme != "fp8":
        dw_round = jax.grad(loss(lambda x, w: qat_linear_reference(x, w, scheme, group)), argnums=1)(xj, wj)
        assert relative_error(dw, dw_round) > 0.5
    dx_float = jax.grad(loss(lambda x, w: x @ w))(xj, wj)
    assert relative_error(dx, dx_float) > 100 * tol.bound(O + 2)


@pytest.mark.numeric
def test_qat_linear_trains():
    """A few steps of gradient descent through the int8 forward lower the loss of a regression onto a fixed
    linear map (the straight-through weight gradient moves the float weights)."""
    rng = np.random.default_rng(4)
    target = rng.standard_normal((32, 16)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32))
    y = x @ target
    w = jnp.zeros_like(jnp.asarray(target)) + 0.01 * jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    loss = jax.jit(lambda w: jnp.mean(jnp.sum((qat_linear(x, w, "int8") - y) ** 2, axis=-1)))
    step = jax.jit(lambda w: w - 0.2 * jax.grad(loss)(w))
    first = float(loss(w))
    for _ in range(80):
        w = step(w)
    assert float(loss(w)) < 0.01 * first


# --- the optimized HLO -------------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\][^ ]* (\w+)\(", re.M)


def weight_sized_buffers(hlo: str, n_elements: int) -> list[tuple[str, str, str]]:
    """The entry computation's instructions that produce a float buffer of n_elements (name, dtype, op or the
    fused computation's kind)."""
    entry = hlo[hlo.index("ENTRY"):]
    out = []
    for name, dtype, dims, op in _INSTR.findall(entry):
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        if size == n_elements and dtype in ("f32", "bf16", "f16"):
            out.append((name, dtype, op))
    return out


def _fused_bodies(hlo: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^%(\S+) .*?\{\n(.*?)\n\}", hlo, re.M | re.S)}


def test_cpu_hlo_widens_the_codes_and_scales_after_the_dot():
    """What XLA's CPU backend does with the decode-shaped op: the dot is a library call that takes float
    operands, so the int8 codes are widened by one convert-only pass into a weight-sized f32 buffer in front of
    it (reported, not hidden: bench/decode.py measures its cost). The scales are applied after the dot: no
    weight-sized multiply, unlike the control that dequantizes the weight first."""
    _, w = _data()
    q = quantize(jnp.asarray(w), "int8")
    x = jnp.zeros((1, I), jnp.float32)
    hlo = jax.jit(quantized_matmul).lower(x, q).compile().as_text()
    bodies = _fused_bodies(hlo)
    widened = weight_sized_buffers(hlo, I * O)
    assert len(widened) == 1, widened
    body = next((b for name, b in bodies.items() if widened[0][0].replace("wrapped_", "") in name
                 or name.startswith("wrapped_convert")), "")
    assert "convert(" in body and "multiply(" not in body, body
    # Control: dequantizing first (codes * scales, then the dot) makes the multiply weight-sized.
    deq = jax.jit(lambda x, c, s: x @ (c.astype(jnp.float32) * s)).lower(x, q.codes, q.scales).compile().as_text()
    assert any("multiply(" in b and f"f32[{I},{O}]" in b for b in _fused_bodies(deq).values())
    assert not any("multiply(" in b and f"f32[{I},{O}]" in b for b in bodies.values())


@pytest.mark.parametrize("scheme", ["int8", "bf16"])
def test_cpu_hlo_of_out_major_weights_widens_nothing_weight_sized(scheme):
    """The decode-shaped op (1 row) over out-major int8 codes, and linear over an out-major bf16 weight: XLA's CPU
    backend widens the values inside the reduce that reads them, with no weight-sized float buffer in the entry
    computation (and no dot). Control: the in-major int8 codes and an [I, O] bf16 weight through a dot get one."""
    from tlaloc_jax.layers import OutMajor, linear
    _, w = _data()
    x = jnp.zeros((1, I), jnp.float32)
    if scheme == "int8":
        q = quantize(jnp.asarray(w), "int8", compute="bfloat16")
        fast = to_out_major(QuantizedWeight(np.asarray(q.codes), np.asarray(q.scales), "int8", 0, "bfloat16"))
        slow = q
    else:
        wb = jnp.asarray(w, jnp.bfloat16)
        fast, slow = OutMajor(jnp.asarray(wb.T)), wb
    def widened(hlo):
        return [b for b in weight_sized_buffers(hlo, I * O) if b[1] == "f32"]
    hlo = jax.jit(linear).lower(x, fast).compile().as_text()
    assert widened(hlo) == [] and " dot(" not in hlo, widened(hlo)
    control = jax.jit(linear).lower(x, slow).compile().as_text()
    assert len(widened(control)) == 1, widened(control)


@pytest.mark.parametrize("rows", [1, NARROW_REDUCE_ROWS + 1])
def test_uint4_takes_the_int4_kernel_never_the_projection_kernel(rows):
    """With the C kernels on (as the exporter turns them on for cpu bodies), an out-major uint4 weight takes the
    int4 kernel with its zero points (kernels/projection_int4.c), never kernels/projection.c (which reads no zero
    points), and gives the reference's values within the int4 kernel's bound (tests/ops/test_projection_int4.py)."""
    from test_projection_int4 import excess
    from tlaloc_jax.kernels import projection_native
    x, w = _data(rows)
    x = np.resize(x, (rows, I))
    qo = to_out_major(jax.tree.map(np.asarray, quantize(jnp.asarray(w), "uint4", 32)))
    with projection_native.native_projections():
        lowered = jax.jit(quantized_matmul).lower(jnp.asarray(x), qo)
        got = np.asarray(lowered.compile()(jnp.asarray(x), qo))
    assert projection_native.NATIVE_PROJECTION not in lowered.as_text()
    assert projection_native.NATIVE_INT4_PROJECTION in lowered.as_text()
    # Control: an int8 weight under the same switch is lowered to the projection kernel's custom call.
    q8 = to_out_major(jax.tree.map(np.asarray, quantize(jnp.asarray(w), "int8")))
    with projection_native.native_projections():
        assert projection_native.NATIVE_PROJECTION in jax.jit(quantized_matmul).lower(jnp.asarray(x), q8).as_text()
    assert_within(excess(got, x, qo, quantized_matmul_reference(x, qo)), 1.0,
                  f"uint4 with native projections on, {rows} rows")
