"""Causal self-attention for training: blockwise online softmax with a flash-attention style backward.

No pages: the keys are the call's own tokens, k, v: [B, T, K, D]. The forward loops over key blocks and
saves only the output and each query row's logsumexp; the backward recomputes each block's scores from
them, so no [T, T] tensor is ever held. Names follow docs/glossary.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ._softmax import (HIGHEST, block_scores, finish, fold_block, group_heads, init_state, ungroup_heads,
                       visible_keys)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, key_block: int = 512,
                     window=None, soft_cap: float | None = None) -> jax.Array:
    """q: [B, T, H, D], k: [B, T, K, D], v: [B, T, K, Dv] -> [B, T, H, Dv] f32 (Dv is D but for latent
    attention's expanded heads, tlaloc_jax/kernels/mla.py).

    Token t sees keys 0..t, and only t - W + 1..t with a window W (None, int or int32 scalar; <= 0 = none).
    soft_cap: scores -> cap * tanh(scores / cap). Differentiable in q, k, v (jax.custom_vjp).
    key_block: keys per block of the online softmax, at most T (a shorter sequence is one block, not padded
    to key_block keys).
    """
    window = jnp.asarray(0 if window is None else window, jnp.int32)
    return _causal_attention(scale, soft_cap, min(key_block, q.shape[1]), q, k, v, window)


def _padded_blocks(x: jax.Array, key_block: int) -> jax.Array:
    """x: [B, T, K, D] -> [B, T', K, D] f32, T' the next multiple of key_block (padding keys are masked)."""
    T = x.shape[1]
    pad = -(-T // key_block) * key_block - T
    return jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))


def _masks(T: int, window: jax.Array):
    """-> a function from key positions [N] to mask [1, T, N]: query t is at position t of a length-T row."""
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    seq_lens = jnp.full((1,), T, jnp.int32)
    return lambda key_pos: visible_keys(key_pos, positions, seq_lens, window)


def _forward(scale, soft_cap, key_block, q, k, v, window):
    """-> (out [B, T, H, Dv] f32, logsumexp [B, K, G, T] f32)."""
    T, K = q.shape[1], k.shape[2]
    qg = group_heads(q.astype(jnp.float32), K)
    kp, vp = _padded_blocks(k, key_block), _padded_blocks(v, key_block)
    mask = _masks(T, window)

    def body(i, state):
        kb = lax.dynamic_slice_in_dim(kp, i * key_block, key_block, axis=1)
        vb = lax.dynamic_slice_in_dim(vp, i * key_block, key_block, axis=1)
        key_pos = i * key_block + jnp.arange(key_block, dtype=jnp.int32)
        return fold_block(state, block_scores(qg, kb, scale=scale, soft_cap=soft_cap), mask(key_pos), vb)

    out, lse = finish(lax.fori_loop(0, kp.shape[1] // key_block, body, init_state(qg, value_dim=v.shape[-1])))
    return ungroup_heads(out), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _causal_attention(scale, soft_cap, key_block, q, k, v, window):
    return _forward(scale, soft_cap, key_block, q, k, v, window)[0]


def _causal_attention_fwd(scale, soft_cap, key_block, q, k, v, window):
    out, lse = _forward(scale, soft_cap, key_block, q, k, v, window)
    return out, (q, k, v, window, out, lse)


def _causal_attention_bwd(scale, soft_cap, key_block, residuals, d_out):
    """Per key block: P = exp(s - lse), dV = P^T dO, dS = P * (dO.V^T - rowsum(dO * O)), then dQ, dK from dS."""
    q, k, v, window, out, lse = residuals
    T, K = q.shape[1], k.shape[2]
    qg = group_heads(q.astype(jnp.float32), K)
    d_out = group_heads(d_out.astype(jnp.float32), K)          # [B, T, K, G, D]
    delta = jnp.einsum("btkgd,btkgd->bkgt", d_out, group_heads(out, K), precision=HIGHEST)
    kp, vp = _padded_blocks(k, key_block), _padded_blocks(v, key_block)
    mask = _masks(T, window)

    def body(i, grads):
        dq, dk, dv = grads
        kb = lax.dynamic_slice_in_dim(kp, i * key_block, key_block, axis=1)
        vb = lax.dynamic_slice_in_dim(vp, i * key_block, key_block, axis=1)
        key_pos = i * key_block + jnp.arange(key_block, dtype=jnp.int32)
        s = block_scores(qg, kb, scale=scale, soft_cap=soft_cap)  # [B, K, G, T, N]
        # Select, not multiply: lse is -inf on rows that see nothing, so exp(s - lse) is inf there.
        p = jnp.where(mask(key_pos)[:, None, None], jnp.exp(s - lse[..., None]), 0.0)
        dv_block = jnp.einsum("bkgtn,btkgd->bnkd", p, d_out, precision=HIGHEST)
        dp = jnp.einsum("btkgd,bnkd->bkgtn", d_out, vb, precision=HIGHEST)
        ds = p * (dp - delta[..., None])
        if soft_cap is not None:
            ds = ds * (1.0 - jnp.square(s / soft_cap))  # s = cap * tanh(x / cap): ds/dx = 1 - tanh^2
        ds = ds * scale
        dq = dq + jnp.einsum("bkgtn,bnkd->btkgd", ds, kb, precision=HIGHEST)
        dk_block = jnp.einsum("bkgtn,btkgd->bnkd", ds, qg, precision=HIGHEST)
        dk = lax.dynamic_update_slice_in_dim(dk, dk_block, i * key_block, axis=1)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_block, i * key_block, axis=1)
        return dq, dk, dv

    grads = (jnp.zeros_like(qg), jnp.zeros_like(kp), jnp.zeros_like(vp))
    dq, dk, dv = lax.fori_loop(0, kp.shape[1] // key_block, body, grads)
    # The window is an integer: it has no cotangent.
    return (ungroup_heads(dq).astype(q.dtype), dk[:, :T].astype(k.dtype), dv[:, :T].astype(v.dtype), None)


_causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


def causal_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, window=None,
                               soft_cap: float | None = None) -> jax.Array:
    """Dense causal attention, for tests: q: [B, T, H, D], k, v: [B, T, K, D] -> [B, T, H, D] f32."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    keys = jnp.repeat(k.astype(jnp.float32), G, axis=2)  # [B, T, H, D]: query head h reads KV head h // G
    values = jnp.repeat(v.astype(jnp.float32), G, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), keys, precision=HIGHEST) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    t, s = jnp.arange(T)[:, None], jnp.arange(T)[None]
    mask = s <= t
    if window is not None:
        mask = mask & ((window <= 0) | (s > t - window))
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, values, precision=HIGHEST)
