"""Blockwise online softmax, shared by paged attention (serving) and causal attention (training).

Shapes (docs/glossary.md; G = H // K query heads share one KV head):
  queries grouped by KV head   q: [B, T, K, G, D]
  one block of keys and values k, v: [B, N, K, D]
  scores                       s: [B, K, G, T, N]
  visibility mask              mask: [B, T, N] (B may be 1 and broadcast)
  running state, per query row m, l: [B, K, G, T] (max, sum), acc: [B, K, G, T, Dv] (unnormalised P.V; the
                               values' size Dv is D unless init_state is told otherwise)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST


class SoftmaxState(NamedTuple):
    m: jax.Array    # [B, K, G, T] running max of the visible scores; -inf until a key is seen
    l: jax.Array    # [B, K, G, T] running sum of exp(score - m)
    acc: jax.Array  # [B, K, G, T, D] running sum of exp(score - m) * value


def group_heads(x: jax.Array, kv_heads: int) -> jax.Array:
    """x: [B, T, H, D] -> [B, T, K, G, D]; query head h reads KV head h // G (HF repeat_kv order)."""
    B, T, H, D = x.shape
    return x.reshape(B, T, kv_heads, H // kv_heads, D)


def ungroup_heads(x: jax.Array) -> jax.Array:
    """x: [B, T, K, G, D] -> [B, T, H, D]."""
    B, T, K, G, D = x.shape
    return x.reshape(B, T, K * G, D)


def visible_keys(key_pos: jax.Array, positions: jax.Array, seq_lens: jax.Array,
                 window: jax.Array) -> jax.Array:
    """Which keys each token sees.

    key_pos: [N] int32, or [B, N] when each row's keys sit at their own positions (a ring; a negative
    position is a slot never written); positions: [B, T] int32 (-1 = padding, sees nothing);
    seq_lens: [B] int32; window: int32 scalar, <= 0 = no window. -> mask [B, T, N] bool:
    0 <= key_pos <= position, key_pos < seq_len, and key_pos > position - window when windowed.
    """
    pos = positions[:, :, None]
    if key_pos.ndim == 2:
        key_pos = key_pos[:, None, :]
    causal = (key_pos >= 0) & (key_pos <= pos) & (key_pos < seq_lens[:, None, None])
    in_window = (window <= 0) | (key_pos > pos - window)
    return causal & in_window


def block_scores(q: jax.Array, k: jax.Array, *, scale: float, soft_cap: float | None) -> jax.Array:
    """q: [B, T, K, G, D] f32, k: [B, N, K, D] f32 -> scores [B, K, G, T, N] f32 (soft-capped when asked)."""
    s = jnp.einsum("btkgd,bnkd->bkgtn", q, k, precision=HIGHEST, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def init_state(q: jax.Array, sinks: jax.Array | None = None, value_dim: int | None = None) -> SoftmaxState:
    """q: [B, T, K, G, D] -> the state before any key block: m = -inf, l = 0, acc = 0.

    sinks: [H] or None. An attention sink (GPT-OSS) is a learned logit per query head that joins the softmax's
    denominator and has no value: the state starts as if one key with that score and a zero value had been
    seen (m = sink, l = 1, acc = 0). value_dim: the values' size when it is not the queries' D (latent
    attention, tlaloc_jax/kernels/mla.py).
    """
    B, T, K, G, D = q.shape
    acc = jnp.zeros((B, K, G, T, value_dim or D), jnp.float32)
    if sinks is None:
        return SoftmaxState(m=jnp.full((B, K, G, T), -jnp.inf, jnp.float32), l=jnp.zeros((B, K, G, T), jnp.float32),
                            acc=acc)
    m = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(K, G)[None, :, :, None], (B, K, G, T))
    return SoftmaxState(m=m, l=jnp.ones((B, K, G, T), jnp.float32), acc=acc)


def fold_block(state: SoftmaxState, s: jax.Array, mask: jax.Array, v: jax.Array) -> SoftmaxState:
    """Fold one key block into the running softmax.

    s: [B, K, G, T, N] scores; mask: [B, T, N]; v: [B, N, K, Dv] f32. Scores and values the mask hides
    may be NaN (free pages, never-written slots): they are replaced, never multiplied by zero.
    """
    # Select, not multiply: a NaN score times a zero weight is still NaN.
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    # A value no token of the row can see would reach P.V as 0 * value; zero it first.
    v = jnp.where(jnp.any(mask, axis=1)[:, :, None, None], v, 0.0)
    m = jnp.maximum(state.m, jnp.max(s, axis=-1))
    # Rows that have seen no key yet keep m = -inf; shift those by 0 so no -inf - -inf appears.
    shift = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(s - shift[..., None])
    rescale = jnp.exp(state.m - shift)
    pv = jnp.einsum("bkgtn,bnkd->bkgtd", p, v, precision=HIGHEST, preferred_element_type=jnp.float32)
    return SoftmaxState(m=m, l=rescale * state.l + jnp.sum(p, axis=-1), acc=rescale[..., None] * state.acc + pv)


def finish(state: SoftmaxState) -> tuple[jax.Array, jax.Array]:
    """-> (out [B, T, K, G, D] f32, logsumexp [B, K, G, T] f32). A row that saw no key gives out = 0, lse = -inf."""
    seen = state.l > 0
    l = jnp.where(seen, state.l, 1.0)
    out = jnp.where(seen[..., None], state.acc / l[..., None], 0.0)
    lse = jnp.where(seen, state.m + jnp.log(l), -jnp.inf)
    return jnp.transpose(out, (0, 3, 1, 2, 4)), lse
