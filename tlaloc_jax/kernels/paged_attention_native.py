"""Decode paged attention through a C kernel on CPU (kernels/decode_attention.c).

The kernel is a typed XLA FFI handler, called as `stablehlo.custom_call @tlaloc_decode_attention_v1`: a body that
holds it is served by a runtime that builds and registers the handler (the manifest names it, so a runtime without
it refuses the artifact at load). In this process jax runs it too: the handler is built and registered with jax
when a call is traced. Semantics: paged_attention's with T = 1 over a full-history pool (not a ring).
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp

from tlaloc_jax import native

from .paged_attention import _refuse_derivative, _window_array

NATIVE_DECODE_ATTENTION = "tlaloc_decode_attention_v1"
# The most query heads a KV head and the largest head the kernel is compiled for (tlaloc_jax.native.DEFINES).
MAX_GROUP, MAX_HEAD_DIM = (native.DEFINES[NATIVE_DECODE_ATTENTION][k] for k in ("MAX_GROUP", "MAX_HEAD_DIM"))


@functools.cache
def register_in_process(target: str = NATIVE_DECODE_ATTENTION) -> None:
    """Build the kernel here (once) and register it with jax's CPU backend."""
    handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(native.handler(target))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")


def refusal(tokens: int, heads: int, kv_heads: int, head_dim: int, pool_dtype) -> str | None:
    """Why the kernel cannot take a call of this shape, or None."""
    if tokens != 1:
        return f"it takes one token a row, not {tokens}"
    if heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return f"{heads} query heads over {kv_heads} KV heads: it takes at most {MAX_GROUP} query heads a KV head"
    if head_dim > MAX_HEAD_DIM:
        return f"heads of {head_dim}: it takes heads of at most {MAX_HEAD_DIM}"
    if jnp.dtype(pool_dtype) not in (jnp.float32, jnp.bfloat16):
        return f"a {jnp.dtype(pool_dtype).name} pool: it reads f32 or bf16 pools"
    return None


def native_decode_attention(q: jax.Array, kv_pool: jax.Array, layer, block_tables: jax.Array, positions: jax.Array,
                            seq_lens: jax.Array, *, scale: float, window=None, soft_cap: float | None = None,
                            sinks: jax.Array | None = None) -> jax.Array:
    """paged_attention of one token a row (q [B, 1, H, D]) over kv_pool [L, 2, P, S, K, D] (f32 or bf16) by the C
    kernel. -> [B, 1, H, D] f32; 0 where nothing is seen. Refuses (ValueError) what the kernel does not take."""
    why = refusal(q.shape[1], q.shape[2], kv_pool.shape[4], q.shape[3], kv_pool.dtype)
    if why:
        raise ValueError(f"native_decode_attention (the C kernel): {why}")
    register_in_process()
    return _native_decode(float(scale), float(soft_cap or 0.0), q, kv_pool, jnp.asarray(layer, jnp.int32),
                          block_tables, positions, seq_lens, _window_array(window), sinks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _native_decode(scale, soft_cap, q, kv_pool, layer, block_tables, positions, seq_lens, window, sinks):
    ints = jnp.stack([layer, window]).astype(jnp.int32)
    reals = jnp.array([scale, soft_cap], jnp.float32)
    operands = [q.astype(jnp.float32), kv_pool, ints, block_tables.astype(jnp.int32), positions.astype(jnp.int32),
                seq_lens.astype(jnp.int32), reals]
    if sinks is not None:
        operands.append(sinks.astype(jnp.float32))
    call = jax.ffi.ffi_call(NATIVE_DECODE_ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(*operands)


_native_decode.defjvp(_refuse_derivative("native_decode_attention"))
