"""Quantized weights and the matmul that reads them: int8 and fp8 (e4m3fn) codes with one f32 scale per output
channel, int4 and uint4 codes packed two a byte with one f32 scale (and, uint4, one zero point) per group of input
channels.

A linear's weight is [..., I, O] (in, out), as everywhere in this library. Its quantized form:

* int8: codes int8 [..., I, O], code = clamp(round_half_even(W / s), -127, 127), s = max_i |W[i, o]| / 127
  (1 for an all-zero column), scales f32 [..., O].
* fp8: codes float8_e4m3fn [..., I, O], code = e4m3fn(W / s) rounded to nearest even, s = max_i |W| / 448.
* int4: codes int8 [..., I / 2, O], two codes a byte; scales f32 [..., I / g, O], one per group of g input
  channels (g = 32, 64 or 128), code = clamp(round_half_even(W / s), -7, 7), s = max over the group / 7
  (15 levels). Inside a group, byte j holds input j in its low nibble and input j + g / 2 in its high one,
  so unpacking is two shifts and a concatenation per group, with no interleave. Codes of -8 (symmetric GPTQ's
  q - 8) are read as well; the quantizer never writes them.
* uint4 (asymmetric, as AWQ and GPTQ with zero points store): codes 0..15 packed exactly as int4's; scales f32 and
  zero points int8 (integers 0..15) [..., I / g, O]; value = (code - zero) * scale. The quantizer (as GPTQ's)
  spans each group's range widened to hold 0, lo = min(min W, 0) and hi = max(max W, 0): s = (hi - lo) / 15,
  zero = round_half_even(-lo / s), code = clamp(round_half_even(W / s) + zero, 0, 15).

`quantized_matmul(x, w)` widens the codes to the compute dtype (exact: |code| <= 127 fits bf16's 8 bits),
contracts in f32 and multiplies the f32 output by the scales after the dot (per group, then sums the
groups, for int4; uint4's codes less their zero point are widened, exact too: |code - zero| <= 15). `quantized_matmul_reference` dequantizes the codes in float64 and multiplies: the op's
definition, with its quantization error, as a naive reference.

Out-major codes (`out_major=True`, what the per-layer layout stores, tlaloc_jax/layout.py): int8 and fp8 codes
[..., O, I] with scales [..., O]; int4 and uint4 codes [..., O, I / 2], packed along I as above, with scales (and
zeros) [..., O, I / g].
Each output's codes are then contiguous, and on XLA's CPU backend a call of a few rows (at most REDUCE_ROWS, one
included) runs as a multiply-reduce that widens each code in registers as it streams the codes once
(`out_major_product`), instead of a widening pass into a weight-sized f32 buffer and a dot.

`qat_linear(x, w_float, scheme)` is the training form: the forward quantizes the float weight and runs
`quantized_matmul`; its custom_vjp gives x its exact gradient (through the dequantized weight the forward
used) and the float weight the straight-through one (x^T dy, as if rounding were the identity).

On XLA's CPU backend the dot is a library call: in-major codes are widened by a separate pass into a
weight-sized buffer before it; out-major ones at few rows are not (tests/ops/test_quantized_matmul.py reads the
optimized HLO and says so). XLA's GPU backend fuses the widening into the dot. The stored and loaded bytes are
the codes' either way.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tlaloc_jax.artifact import GROUPED_SCHEMES, QUANT_CODE_DTYPES, QUANT_GROUPS, QuantScheme, numpy_dtype
from . import projection_native

HIGHEST = lax.Precision.HIGHEST
# The largest code of each scheme: int8 keeps 127 steps a side, e4m3fn's largest finite value is 448,
# int4 keeps 7 a side (15 levels), uint4 16 levels 0..15.
QMAX = {QuantScheme.INT8: 127.0, QuantScheme.FP8: 448.0, QuantScheme.INT4: 7.0, QuantScheme.UINT4: 15.0}
CODE_DTYPES = {scheme: jnp.dtype(numpy_dtype(name)) for scheme, name in QUANT_CODE_DTYPES.items()}


class QuantError(ValueError):
    """A scheme, group size or shape that quantization cannot take; the message names it."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A linear's weight as codes and scales (leaves), its scheme, group and compute dtype (static).

    codes: int8 / float8_e4m3fn [..., I, O], or int8 [..., I / 2, O] for int4 and uint4; scales f32 [..., O], or
    [..., I / group, O] for int4 and uint4; zeros (uint4 only, else None) int8 0..15, shaped as the scales.
    compute: the dtype the codes are widened to (the model's weight dtype).
    """

    codes: jax.Array
    scales: jax.Array
    scheme: str = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(default=0, metadata=dict(static=True))
    compute: str = dataclasses.field(default="float32", metadata=dict(static=True))
    out_major: bool = dataclasses.field(default=False, metadata=dict(static=True))
    zeros: jax.Array | None = None

    @property
    def in_features(self) -> int:
        return self.codes.shape[-1 if self.out_major else -2] * (2 if self.scheme in GROUPED_SCHEMES else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape [..., I, O]."""
        return (*self.codes.shape[:-2], self.in_features, self.codes.shape[-2 if self.out_major else -1])

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes) + int(self.scales.nbytes) + (0 if self.zeros is None else int(self.zeros.nbytes))


def check_scheme(scheme: str, group: int = 0, in_features: int | None = None) -> None:
    if scheme not in tuple(QuantScheme):
        raise QuantError(f"unknown weight quantization scheme {scheme!r} (known: {', '.join(QuantScheme)})")
    if scheme in GROUPED_SCHEMES:
        if group not in QUANT_GROUPS:
            raise QuantError(f"{scheme} group size {group} is not one of {QUANT_GROUPS}")
        if in_features is not None and in_features % group:
            raise QuantError(f"{scheme} groups of {group} do not tile {in_features} input channels")


# --- quantizing ----------------------------------------------------------------------------------------


def _safe_scale(amax: jax.Array, qmax: float) -> jax.Array:
    return jnp.where(amax > 0, amax / jnp.float32(qmax), jnp.float32(1.0))


def quantize_parts(w: jax.Array, scheme: str, group: int = 0, *, rounding=jnp.round):
    """w: [..., I, O] float -> (codes before packing, as f32 integers or e4m3fn values [..., I, O], scales).

    rounding: round half to even (jnp.round); the gradient check passes the identity instead. uint4 has its own
    quantizer (quantize_asymmetric: it has zero points too)."""
    check_scheme(scheme, group, w.shape[-2])
    if scheme == QuantScheme.UINT4:
        raise QuantError("uint4 codes come with zero points: quantize_asymmetric quantizes them")
    w = w.astype(jnp.float32)
    qmax = QMAX[scheme]
    exact = rounding is jnp.round

    def to_codes(ratio):
        # |ratio| <= qmax up to the division's rounding; the clip catches that (and fp8's convert, which would
        # give NaN past 448, needs it). The gradient check's identity rounding replaces the clip too.
        if not exact:
            return rounding(ratio)
        if scheme == QuantScheme.FP8:
            return jnp.clip(ratio, -qmax, qmax).astype(jnp.float8_e4m3fn)   # XLA's convert: nearest even
        return jnp.clip(jnp.round(ratio), -qmax, qmax)

    if scheme == QuantScheme.INT4:
        I, O = w.shape[-2:]
        wg = w.reshape(*w.shape[:-2], I // group, group, O)
        scales = _safe_scale(jnp.max(jnp.abs(wg), axis=-2), qmax)              # [..., G, O]
        return to_codes(wg / scales[..., None, :]).reshape(w.shape), scales
    scales = _safe_scale(jnp.max(jnp.abs(w), axis=-2), qmax)                    # [..., O]
    return to_codes(w / scales[..., None, :]), scales


def quantize_asymmetric(w: jax.Array, group: int):
    """w: [..., I, O] float -> uint4's (codes 0..15 as f32 integers [..., I, O], scales f32 and zeros f32
    integers 0..15 [..., I / group, O]): each group's range, widened to hold 0, in 15 steps (so 0 is a code
    and the zero point is in 0..15; an all-zero group: scale 1)."""
    check_scheme(QuantScheme.UINT4, group, w.shape[-2])
    w = w.astype(jnp.float32)
    I, O = w.shape[-2:]
    wg = w.reshape(*w.shape[:-2], I // group, group, O)
    lo, hi = jnp.minimum(jnp.min(wg, axis=-2), 0.0), jnp.maximum(jnp.max(wg, axis=-2), 0.0)   # [..., G, O]
    scales = jnp.where(hi > lo, (hi - lo) / jnp.float32(15.0), jnp.float32(1.0))
    zeros = jnp.clip(jnp.round(-lo / scales), 0.0, 15.0)
    codes = jnp.clip(jnp.round(wg / scales[..., None, :]) + zeros[..., None, :], 0.0, 15.0)
    return codes.reshape(w.shape), scales, zeros


def pack_int4(codes: jax.Array, group: int) -> jax.Array:
    """int4 codes (integers in [-8, 7], any dtype) or uint4 codes (0..15) [..., I, O] -> int8 [..., I / 2, O],
    packed as above (a nibble holds the code's low 4 bits either way)."""
    I, O = codes.shape[-2:]
    c = codes.astype(jnp.int8).reshape(*codes.shape[:-2], I // group, 2, group // 2, O)
    low, high = c[..., 0, :, :], c[..., 1, :, :]
    packed = jnp.bitwise_or(jnp.bitwise_and(low, jnp.int8(0x0F)), jnp.left_shift(high, jnp.int8(4)))
    return packed.reshape(*codes.shape[:-2], I // 2, O)


def _nibbles(p: jax.Array, signed: bool) -> tuple[jax.Array, jax.Array]:
    """int8 bytes -> (low, high) nibbles as int8: sign-extended (int4, -8..7) or not (uint4, 0..15)."""
    if signed:     # arithmetic shifts
        return jnp.right_shift(jnp.left_shift(p, jnp.int8(4)), jnp.int8(4)), jnp.right_shift(p, jnp.int8(4))
    return jnp.bitwise_and(p, jnp.int8(0x0F)), jnp.bitwise_and(jnp.right_shift(p, jnp.int8(4)), jnp.int8(0x0F))


def unpack_int4(packed: jax.Array, group: int, signed: bool = True) -> jax.Array:
    """int8 [..., I / 2, O] -> int8 codes [..., I / group, 2, group / 2, O] (low nibbles, then high ones);
    signed False reads uint4's codes."""
    half, O = packed.shape[-2:]
    p = packed.reshape(*packed.shape[:-2], half * 2 // group, 1, group // 2, O)
    return jnp.concatenate(_nibbles(p, signed), axis=-3)


def centred_codes(w: QuantizedWeight) -> jax.Array:
    """A grouped weight's codes less its zero points (int4: the codes), int8 [..., I / group, group, O] (in-major)
    or [..., O, I / group, group] (out-major): what multiplies the scales, exact in any float dtype."""
    signed = w.scheme == QuantScheme.INT4
    if w.out_major:
        c = _unpack_int4_out_major(w.codes, w.group, signed)
        return c if signed else c - w.zeros[..., None]
    c = unpack_int4(w.codes, w.group, signed)
    c = c.reshape(*c.shape[:-4], c.shape[-4], w.group, c.shape[-1])          # [..., G, g, O]
    return c if signed else c - w.zeros[..., None, :]


def quantize(w: jax.Array, scheme: str, group: int = 0, *, compute: str = "float32") -> QuantizedWeight:
    """A float weight [..., I, O] -> its QuantizedWeight (computed in f32 from w's values)."""
    if scheme == QuantScheme.UINT4:
        codes, scales, zeros = quantize_asymmetric(w, group)
        return QuantizedWeight(pack_int4(codes, group), scales, scheme, group, compute, zeros=zeros.astype(jnp.int8))
    codes, scales = quantize_parts(w, scheme, group)
    if scheme == QuantScheme.INT4:
        codes = pack_int4(codes, group)
    else:
        codes = codes.astype(CODE_DTYPES[scheme])
    return QuantizedWeight(codes, scales.astype(jnp.float32), scheme, group if scheme == QuantScheme.INT4 else 0,
                           compute)


@functools.partial(jax.jit, static_argnames=("scheme", "group", "compute"))
def _quantize_jit(w, scheme, group, compute):
    return quantize(w, scheme, group, compute=compute)


def quantize_array(w, scheme: str, group: int = 0, *, compute: str = "float32") -> QuantizedWeight:
    """quantize for a host array (the exporter): jitted, the leaves brought back as numpy arrays."""
    q = _quantize_jit(jnp.asarray(w), scheme, group, compute)
    return jax.tree.map(np.asarray, q)


def to_out_major(q: QuantizedWeight) -> QuantizedWeight:
    """The same codes and scales stored out-major (host arrays; an out-major weight is returned as it is)."""
    if q.out_major:
        return q
    codes, scales, zeros = np.asarray(q.codes), np.asarray(q.scales), q.zeros
    if q.scheme in GROUPED_SCHEMES:
        c = np.moveaxis(np.asarray(unpack_int4(jnp.asarray(codes), q.group)), -1, -4)   # [..., O, G, 2, g/2]
        low, high = c[..., 0, :].view(np.uint8), c[..., 1, :].view(np.uint8)
        codes = ((low & 0x0F) | (high << 4)).view(np.int8).reshape(*c.shape[:-3], -1)  # [..., O, I/2]
        scales = np.swapaxes(scales, -1, -2)                                          # [..., O, G]
        if zeros is not None:
            zeros = np.ascontiguousarray(np.swapaxes(np.asarray(zeros), -1, -2))
    else:
        codes = np.swapaxes(codes, -1, -2)
    return QuantizedWeight(np.ascontiguousarray(codes), np.ascontiguousarray(scales), q.scheme, q.group,
                           q.compute, out_major=True, zeros=zeros)


def _unpack_int4_out_major(packed: jax.Array, group: int, signed: bool = True) -> jax.Array:
    """int8 [..., O, I / 2] (out-major int4 or uint4) -> int8 codes [..., O, I / group, group], inputs in order."""
    *lead, O, half = packed.shape
    p = packed.reshape(*lead, O, half * 2 // group, 1, group // 2)
    codes = jnp.concatenate(_nibbles(p, signed), axis=-2)                     # [..., O, G, 2, g/2]
    return codes.reshape(*lead, O, half * 2 // group, group)


def dequantize(q: QuantizedWeight, dtype=np.float64) -> np.ndarray:
    """The float weight the codes stand for, [..., I, O], in numpy `dtype` (float64: exact)."""
    scales = np.asarray(q.scales, dtype)
    if q.scheme in GROUPED_SCHEMES:
        c = np.asarray(centred_codes(jax.tree.map(jnp.asarray, q)), dtype)
        if q.out_major:                                                         # [..., O, G, g]
            return np.swapaxes((c * scales[..., None]).reshape(*c.shape[:-2], -1), -1, -2)
        return (c * scales[..., :, None, :]).reshape(q.shape)                  # [..., G, g, O]
    w = np.asarray(np.asarray(q.codes).astype(np.float32), dtype)
    return np.swapaxes(w * scales[..., None], -1, -2) if q.out_major else w * scales[..., None, :]


# --- the matmul ----------------------------------------------------------------------------------------


# The most rows (tokens of a call, over its batch) an out-major projection computes as a multiply-reduce on CPU;
# more rows are compute-bound and go to the dot. On the runtime's XLA the multiply-reduce of the 82M Llama's
# projections is faster up to 64 rows and slower from 96 (`bench/dot_forms.py --runtime --batches 32,64,96`, deleted in 82403e3).
# A narrower weight keeps 16: from about 48 rows XLA rewrites its multiply-reduce into a dot in the weight's dtype,
# which rounds the products (tests/models/test_layout.py's bf16 case).
REDUCE_ROWS = 64
NARROW_REDUCE_ROWS = 16


def out_major_product(flat: jax.Array, w: jax.Array, *, reduce_one_row: bool) -> jax.Array:
    """flat: [M, I], w: [O, I] (any float or integer dtype) -> [M, O] f32: sum_i flat[m, i] w[o, i], w widened
    exactly, the products and their sum in f32 (a dot's arithmetic).

    The form XLA runs fastest on the platform: on CPU, for 2 to REDUCE_ROWS rows (NARROW_REDUCE_ROWS for a w
    narrower than f32; and at 1 row when reduce_one_row), a multiply-reduce that streams w once, each row of it reused for every input row from cache
    and widened in registers (a narrower w is never copied to f32); otherwise a dot that contracts both operands'
    last axes, which reads [O, I] in place. At 1 row an f32 weight's dot is XLA's own matrix-vector product, at
    full read speed; a bf16 or int8 weight's dot would first widen it into a weight-sized f32 buffer (6.5x the f32
    step on the runtime's XLA, bench/decode_quant.py), hence reduce_one_row for those."""
    rows = flat.shape[0]
    if projection_native.takes(rows, w.dtype):     # the C kernel, where the exporter turned it on (cpu bodies)
        return projection_native.native_projection(flat, w)

    def dot(flat, w):
        return lax.dot_general(flat, w.astype(flat.dtype), (((1,), (1,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)

    def multiply_reduce(flat, w):
        return jnp.sum(w.astype(jnp.float32)[None] * flat.astype(jnp.float32)[:, None, :], axis=-1)

    if (2 <= rows or reduce_one_row) and rows <= (REDUCE_ROWS if w.dtype == jnp.float32 else NARROW_REDUCE_ROWS):
        return lax.platform_dependent(flat, w, cpu=multiply_reduce, default=dot)
    return dot(flat, w)


def _out_major_matmul(xc: jax.Array, w: QuantizedWeight) -> jax.Array:
    """xc: [M, I] in the compute dtype, w out-major -> [M, O] f32 (see quantized_matmul)."""
    if w.scheme not in GROUPED_SCHEMES:
        return out_major_product(xc, w.codes, reduce_one_row=True) * w.scales
    # The int4 kernel (kernels/projection_int4.c) where the exporter turned it on (cpu bodies): int4, and uint4 with
    # its zero points; never kernels/projection.c, which reads no zero points. Else XLA's forms.
    if projection_native.takes_int4(xc.shape[0]):
        return projection_native.native_int4_projection(xc, w.codes, w.scales, w.zeros)
    codes = centred_codes(w)                                                    # [O, G, g]
    O, G, g = codes.shape
    xg = xc.reshape(-1, G, g)

    def multiply_reduce(xg, codes):     # each group's partial sum [M, O, G], its scale, then the G-term sum
        part = jnp.sum(codes.astype(jnp.float32)[None] * xg.astype(jnp.float32)[:, None], axis=-1)
        return jnp.sum(part * w.scales[None], axis=-1)

    def dot(xg, codes):
        part = lax.dot_general(xg, codes.astype(xg.dtype), (((2,), (2,)), ((1,), (1,))), precision=HIGHEST,
                               preferred_element_type=jnp.float32)               # [G, M, O]
        return jnp.sum(part * w.scales.T[:, None, :], axis=0)

    if xc.shape[0] > NARROW_REDUCE_ROWS:
        return dot(xg, codes)
    return lax.platform_dependent(xg, codes, cpu=multiply_reduce, default=dot)


def quantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x: [..., I] -> [..., O] f32: x times the weight the codes stand for.

    x is rounded to the compute dtype (as a bf16 linear rounds its input), the codes are widened to it
    (exact), the products accumulate in f32 and the scales multiply the f32 sums (int4: each group's partial
    sum, then the groups are summed). Out-major codes take the platform's fastest form (out_major_product)."""
    cd = jnp.dtype(w.compute)
    lead = x.shape[:-1]
    xc = x.reshape(-1, x.shape[-1]).astype(cd)
    if w.out_major:
        y = _out_major_matmul(xc, w)
    elif w.scheme in GROUPED_SCHEMES:
        G = w.scales.shape[-2]
        c = centred_codes(w).astype(cd)                                         # [G, g, O]
        xg = xc.reshape(-1, G, w.group)                                         # [M, G, g]
        part = lax.dot_general(xg, c, (((2,), (1,)), ((1,), (0,))), precision=HIGHEST,
                               preferred_element_type=jnp.float32)              # [G, M, O]
        y = jnp.sum(part * w.scales[:, None, :], axis=0)
    else:
        y = lax.dot_general(xc, w.codes.astype(cd), (((1,), (0,)), ((), ())), precision=HIGHEST,
                            preferred_element_type=jnp.float32) * w.scales
    return y.reshape(*lead, y.shape[-1])


def quantized_matmul_reference(x, w: QuantizedWeight) -> np.ndarray:
    """The naive form in float64: x (rounded to the compute dtype, as the op's input is) times the
    dequantized weight."""
    x = np.asarray(jnp.asarray(x).astype(jnp.dtype(w.compute)).astype(jnp.float32), np.float64)
    return x @ dequantize(w, np.float64)


# --- training: quantization-aware, straight-through ---------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def qat_linear(x: jax.Array, w: jax.Array, scheme: str, group: int = 0, compute: str = "float32") -> jax.Array:
    """x: [..., I], w: float [I, O] -> quantized_matmul(x, quantize(w)): the forward that serving runs.

    Gradients: x gets the exact one (dy times the dequantized weight's transpose); w gets the
    straight-through one, x^T dy, as if quantizing were the identity (quantization-aware fine-tuning)."""
    return quantized_matmul(x, quantize(w, scheme, group, compute=compute))


def _qat_fwd(x, w, scheme, group, compute):
    q = quantize(w, scheme, group, compute=compute)
    return quantized_matmul(x, q), (x, q, jnp.zeros((), w.dtype))


def _qat_bwd(scheme, group, compute, res, dy):
    x, q, w_like = res
    w_dtype = w_like.dtype
    cd = jnp.dtype(compute)
    scales = q.scales
    if scheme in GROUPED_SCHEMES:
        wq = (centred_codes(q).astype(jnp.float32) * scales[:, None, :]).reshape(q.shape)
    else:
        wq = q.codes.astype(jnp.float32) * scales
    dy = dy.astype(jnp.float32)
    # x's gradient: through the rounding of x to the compute dtype (identity) and the dequantized weight.
    dx = jnp.einsum("...o,io->...i", dy, wq, precision=HIGHEST).astype(x.dtype)
    xc = x.astype(cd).astype(jnp.float32).reshape(-1, x.shape[-1])
    dw = jnp.einsum("mi,mo->io", xc, dy.reshape(-1, dy.shape[-1]), precision=HIGHEST).astype(w_dtype)
    return dx, dw


qat_linear.defvjp(_qat_fwd, _qat_bwd)


def qat_linear_reference(x, w, scheme: str, group: int = 0, *, rounding=jnp.round) -> jax.Array:
    """The training form as plain jnp, for jax.grad: quantize with `rounding`, dequantize, multiply in f32.
    With rounding = identity its weight gradient is the straight-through one (fp8's convert is replaced too)."""
    codes, scales = quantize_parts(w, scheme, group, rounding=rounding)
    codes = codes.astype(jnp.float32)
    if scheme == QuantScheme.INT4:
        G = scales.shape[-2]
        wq = (codes.reshape(G, group, -1) * scales[:, None, :]).reshape(w.shape)
    else:
        wq = codes * scales
    return jnp.einsum("...i,io->...o", x.astype(jnp.float32), wq, precision=HIGHEST)
