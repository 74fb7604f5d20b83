"""Projections of out-major weights through a C kernel on CPU (kernels/projection.c).

The kernel is a typed XLA FFI handler, called as `stablehlo.custom_call @tlaloc_projection_v1`; a served body that
holds it names it in its manifest for the runtime to build and register (as the native decode attention). It
widens a bf16 or int8 weight in registers (or in blocks that stay in cache), where XLA's dot first writes a
weight-sized f32 copy and XLA's multiply-reduce runs far below the read rate; up to 8 rows it reads the weights in
one stream, from 9 it runs panels of rows against broadcast weights; for f32 weights from 64 rows XLA's dot is as
fast.

`native_projections()` turns it on while a function is traced (the exporter does so for cpu bodies staged with
projections "native"); `out_major_product` then takes it for the rows and dtypes of NATIVE_ROWS.

Out-major 4-bit weights (int4 codes and group scales, uint4 with zero points) have their own kernel,
kernels/projection_int4.c (`tlaloc_int4_projection_v1`), taken at every row count under native_projections():
it quantizes x to int8 per block of 32 and runs integer dots (tolerances.activation_quantization_std bounds what
that adds).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from .paged_attention import _refuse_derivative
from .paged_attention_native import register_in_process

NATIVE_PROJECTION = "tlaloc_projection_v1"
NATIVE_INT4_PROJECTION = "tlaloc_int4_projection_v1"
INT4_GROUPS = (32, 64, 128)
# Weight dtype -> the most rows a projection takes the kernel for (bench/native_kernels.py; docs/cpu.md, "Kernels
# outside XLA"). int8: every call, prefill too (XLA's dot widens the codes into a weight-sized f32 copy first);
# bf16: the calls XLA runs as a multiply-reduce (NARROW_REDUCE_ROWS; past them its dot takes bf16 operands, which
# CPUs with bf16 dot instructions run faster); f32: up to 32 rows (XLA's dot is as fast from 64).
NATIVE_ROWS = {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.bfloat16): 16, jnp.dtype(jnp.int8): float("inf")}

_active = contextvars.ContextVar("tlaloc_native_projections", default=False)


@contextlib.contextmanager
def native_projections(on: bool = True):
    """While tracing in this context, out-major projections take the C kernel where NATIVE_ROWS says."""
    token = _active.set(on)
    try:
        yield
    finally:
        _active.reset(token)


def takes(rows: int, dtype) -> bool:
    """Whether a projection of `rows` rows of a `dtype` weight, traced now, takes the kernel."""
    return _active.get() and 0 < rows <= NATIVE_ROWS.get(jnp.dtype(dtype), 0)


def native_projection(flat: jax.Array, w: jax.Array) -> jax.Array:
    """flat: [M, I] (any float dtype, read as f32), w: [O, I] f32, bf16 or int8 -> [M, O] f32: sum_i flat[m, i]
    w[o, i], w widened exactly, products and sums in f32 (out_major_product's semantics), by the C kernel."""
    if jnp.dtype(w.dtype) not in NATIVE_ROWS:
        raise ValueError(f"native_projection (the C kernel) reads f32, bf16 or int8 weights, not {w.dtype}")
    register_in_process(NATIVE_PROJECTION)
    return _native_projection(flat.astype(jnp.float32), w)


@jax.custom_jvp
def _native_projection(flat, w):
    call = jax.ffi.ffi_call(NATIVE_PROJECTION, jax.ShapeDtypeStruct((flat.shape[0], w.shape[0]), jnp.float32))
    return call(flat, w)


_native_projection.defjvp(_refuse_derivative("native_projection"))


def takes_int4(rows: int) -> bool:
    """Whether an out-major 4-bit projection of `rows` rows, traced now, takes the int4 kernel (every row count:
    from prefill's hundreds of rows its integer dots still beat XLA's widening dot, bench/native_kernels.py)."""
    return _active.get() and rows > 0


def native_int4_projection(flat: jax.Array, codes: jax.Array, scales: jax.Array,
                           zeros: jax.Array | None = None) -> jax.Array:
    """flat: [M, I] (any float dtype, read as f32), codes int8 [O, I / 2] (two 4-bit codes a byte, packed as
    quantized_matmul's out-major int4), scales f32 [O, I / g] (g = 32, 64 or 128), zeros int8 [O, I / g] or None
    -> [M, O] f32: sum over groups of scale * sum_i (code - zero) flat[m, i], with int4's signed codes and no zero
    when zeros is None (uint4: unsigned codes). flat is quantized to int8 per block of 32 inside the kernel."""
    M, I = flat.shape
    O, half = codes.shape
    if codes.dtype != jnp.int8 or half * 2 != I or scales.shape[0] != O or I % scales.shape[1] \
            or I // scales.shape[1] not in INT4_GROUPS:
        raise ValueError(f"native_int4_projection (the C kernel) takes codes int8 [O, I / 2] and scales [O, I / g], "
                         f"g one of {INT4_GROUPS}: got x {flat.shape}, codes {codes.dtype} {codes.shape}, scales "
                         f"{scales.shape}; export with --projections xla for other shapes")
    if zeros is not None and (zeros.dtype != jnp.int8 or zeros.shape != scales.shape):
        raise ValueError(f"native_int4_projection: zeros int8 {scales.shape}, not {zeros.dtype} {zeros.shape}")
    register_in_process(NATIVE_INT4_PROJECTION)
    operands = [flat.astype(jnp.float32), codes, scales.astype(jnp.float32)]
    return _native_int4_projection(*operands, *([] if zeros is None else [zeros]))


@jax.custom_jvp
def _native_int4_projection(flat, codes, scales, *zeros):
    call = jax.ffi.ffi_call(NATIVE_INT4_PROJECTION, jax.ShapeDtypeStruct((flat.shape[0], codes.shape[0]), jnp.float32))
    return call(flat, codes, scales, *zeros)


_native_int4_projection.defjvp(_refuse_derivative("native_int4_projection"))
