"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the latent cache write, paged attention over the latent
pages in its absorbed and expanded forms, the causal training form with a custom_vjp, and naive references.

Dimensions (docs/glossary.md): B, T, H, P, S, M, N as everywhere; C the latent (kv_lora_rank), R the rotated key
(qk_rope_head_dim), Dn a head's key part expanded from the latent (qk_nope_head_dim), Dv a head's value
(v_head_dim). Einsum letters: c, r, n (Dn), v (Dv), j (a key position).

A position j keeps its normed latent c_j [C] and its rotated key r_j [R], shared by every head. Head h expands
them with Wk [C, H, Dn] and Wv [C, H, Dv] into its key [c_j Wk_h, r_j] and its value c_j Wv_h, and its query
is [qn_h, qr_h] ([Dn], [R]):

    score(h, t, j) = scale (qn_h . c_j Wk_h + qr_h . r_j)        out(h, t) = sum_j softmax_j(score) c_j Wv_h

Absorbed form: qn_h . (c_j Wk_h) = (Wk_h qn_h) . c_j, so the query [Wk_h qn_h, qr_h] [C + R] scores the cached
[c_j, r_j] as it is: one key head of C + R that all H query heads share, whose value is its first C entries;
then out = (sum_j p_j c_j) Wv_h. No key or value is expanded: a call reads each cached position once.
Expanded form: each gathered block's latents are expanded into H keys [Dn + R] and values [Dv], then attended
as plain multi-head attention. The absorbed form costs about T N H (2C + R) multiply-adds per row, the
expanded one N C H (Dn + Dv) + T N H (Dn + R + Dv): absorbed wins for few tokens per call (decode), expanded
for long prefill chunks; `cheaper_form` counts both from the call's static shapes.

The pool: [L, 1, P, S, 1, C + R], a paged pool (manifest kind paged_kv) whose page holds per position the
latent and the rotated key, no heads; pages, block tables and slot mapping as tlaloc_jax/kernels/paged_attention.py's.
Paged attention and the cache write are inference-only; `mla_causal` (the training form: a row's keys are its
own tokens from position 0) carries a custom_vjp whose residuals are the latents, not the expanded keys and
values (H (Dn + R + Dv) per token against C + R), and whose backward is the causal attention's blockwise one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import attention as _causal
from ._softmax import HIGHEST, block_scores, finish, fold_block, init_state, visible_keys
from .paged_attention import _blockwise, _refuse_derivative, _window_array

ABSORBED, EXPANDED = "absorbed", "expanded"
FORMS = ("auto", ABSORBED, EXPANDED)


def _einsum(spec: str, *args) -> jax.Array:
    return jnp.einsum(spec, *(a.astype(jnp.float32) for a in args), precision=HIGHEST,
                      preferred_element_type=jnp.float32)


def cheaper_form(tokens: int, keys: int, heads: int, latent: int, rope: int, nope: int, value: int) -> str:
    """The form with fewer multiply-adds for a row of `tokens` queries over `keys` positions (module docstring)."""
    absorbed = tokens * heads * (nope * latent + keys * (2 * latent + rope) + latent * value)
    expanded = keys * latent * heads * (nope + value) + tokens * keys * heads * (nope + rope + value)
    return ABSORBED if absorbed <= expanded else EXPANDED


# --- the cache write --------------------------------------------------------------------------------


def mla_cache_write(pool: jax.Array, latent: jax.Array, rope_key: jax.Array, slot_mapping: jax.Array,
                    layer) -> jax.Array:
    """Scatter the call's latents and rotated keys into the pool.

    pool: [L, 1, P, S, 1, C + R]; latent: [B, T, C]; rope_key: [B, T, R]; slot_mapping: [B, T] int32 (page * S +
    offset; -1 writes nothing); layer: int or int32 scalar. -> the updated pool, one scatter (in place when
    donated). float8_e4m3fn pools get their entries clamped to +-448 first (e4m3fn has no infinity)."""
    return _mla_cache_write(pool, latent, rope_key, slot_mapping, jnp.asarray(layer, jnp.int32))


@jax.custom_jvp
def _mla_cache_write(pool, latent, rope_key, slot_mapping, layer):
    pages, page_size = pool.shape[2], pool.shape[3]
    page = jnp.where(slot_mapping >= 0, slot_mapping // page_size, pages)     # padding past the end: dropped
    offset = slot_mapping % page_size
    new = jnp.concatenate([latent, rope_key], axis=-1)                          # [B, T, C + R]
    if pool.dtype == jnp.float8_e4m3fn:
        new = jnp.clip(new, -448.0, 448.0)
    return pool.at[layer, 0, page, offset, 0].set(new.astype(pool.dtype), mode="drop")


_mla_cache_write.defjvp(_refuse_derivative("mla_cache_write"))


# --- paged attention over the latent pages -------------------------------------------------------------


def paged_mla(q_nope: jax.Array, q_rope: jax.Array, pool: jax.Array, layer, block_tables: jax.Array,
              positions: jax.Array, seq_lens: jax.Array, w_k: jax.Array, w_v: jax.Array, *, scale: float,
              key_block: int = 2048, form: str = "auto") -> jax.Array:
    """Latent attention of the call's tokens over their sequences' latent pages.

    q_nope: [B, T, H, Dn]; q_rope: [B, T, H, R] (rotated); pool: [L, 1, P, S, 1, C + R]; layer: int or int32
    scalar; block_tables: [B, M]; positions: [B, T] (-1 = padding); seq_lens: [B] (keys written for the row);
    w_k: [C, H, Dn]; w_v: [C, H, Dv]. Token (b, t) sees key j iff j <= positions[b, t] and j < seq_lens[b].
    form: "absorbed", "expanded" or "auto" (cheaper_form of the static shapes). -> [B, T, H, Dv] f32; 0 where
    nothing is seen. A context M * S past key_block (a multiple of S) is folded in key blocks.
    """
    page_size = pool.shape[3]
    if key_block % page_size:
        raise ValueError(f"paged_mla: key_block {key_block} is not a multiple of the page size S = {page_size}")
    if form not in FORMS:
        raise ValueError(f"paged_mla: form {form!r} is not one of {', '.join(FORMS)}")
    B, T, H, Dn = q_nope.shape
    C, Dv = w_k.shape[0], w_v.shape[-1]
    if form == "auto":
        form = cheaper_form(T, block_tables.shape[1] * page_size, H, C, q_rope.shape[-1], Dn, Dv)
    return _paged_mla(scale, key_block, form, q_nope, q_rope, pool, jnp.asarray(layer, jnp.int32), block_tables,
                      positions, seq_lens, w_k, w_v)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _paged_mla(scale, key_block, form, q_nope, q_rope, pool, layer, block_tables, positions, seq_lens, w_k, w_v):
    C, H = w_k.shape[0], w_k.shape[1]
    if form == ABSORBED:
        # One key head (K = 1) of C + R read by the H query heads (G = H); its value is the latent.
        q = jnp.concatenate([_einsum("bthn,chn->bthc", q_nope, w_k), q_rope.astype(jnp.float32)], axis=-1)
        q = q[:, :, None]                                                                 # [B, T, 1, H, C + R]
        state = init_state(q, value_dim=C)
    else:
        q = jnp.concatenate([q_nope, q_rope], axis=-1).astype(jnp.float32)[:, :, :, None]  # [B, T, H, 1, Dn + R]
        state = init_state(q, value_dim=w_v.shape[-1])
    fold = functools.partial(_fold_latent_pages, q=q, pool=pool, layer=layer, positions=positions,
                             seq_lens=seq_lens, scale=scale, w_k=w_k, w_v=w_v, form=form)
    M, page_size = block_tables.shape[1], pool.shape[3]
    if M * page_size <= key_block:
        state = fold(state, block_tables, 0)
    else:
        state = _blockwise(fold, state, block_tables, positions, seq_lens, _window_array(None), key_block, page_size)
    out = finish(state)[0]                                    # [B, T, 1, H, C] or [B, T, H, 1, Dv]
    B, T = out.shape[:2]
    if form == ABSORBED:
        return _einsum("bthc,chv->bthv", out.reshape(B, T, H, C), w_v)
    return out.reshape(B, T, H, -1)


_paged_mla.defjvp(_refuse_derivative("paged_mla"))


def _fold_latent_pages(state, pages, first_key, *, q, pool, layer, positions, seq_lens, scale, w_k, w_v, form):
    """Fold the positions on `pages` ([B, M']) into the softmax state of q (absorbed: [B, T, 1, H, C + R];
    expanded: [B, T, H, 1, Dn + R]). The pages are read in the pool's dtype and widened after."""
    entries = pool[layer, 0, pages]                                             # [B, M', S, 1, C + R]
    B, Mb, S = entries.shape[:3]
    entries = entries.reshape(B, Mb * S, entries.shape[-1]).astype(jnp.float32)  # [B, N, C + R]
    C, H = w_k.shape[0], w_k.shape[1]
    latent, rope_key = entries[..., :C], entries[..., C:]
    mask = visible_keys(first_key + jnp.arange(Mb * S, dtype=jnp.int32), positions, seq_lens, jnp.int32(0))
    if form == ABSORBED:
        k, v = entries[:, :, None], latent[:, :, None]                        # [B, N, 1, C + R], [B, N, 1, C]
    else:
        k_nope = _einsum("bjc,chn->bjhn", latent, w_k)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(rope_key[:, :, None], (B, Mb * S, H, rope_key.shape[-1]))],
                            axis=-1)                                          # [B, N, H, Dn + R]
        v = _einsum("bjc,chv->bjhv", latent, w_v)                             # [B, N, H, Dv]
    return fold_block(state, block_scores(q, k, scale=scale, soft_cap=None), mask, v)


def paged_mla_reference(q_nope: jax.Array, q_rope: jax.Array, pool: jax.Array, layer, block_tables: jax.Array,
                        positions: jax.Array, seq_lens: jax.Array, w_k: jax.Array, w_v: jax.Array, *,
                        scale: float) -> jax.Array:
    """Naive, for tests: every page of every row gathered, every head's keys and values expanded from the latents
    (the model's own definition, transformers' form), a dense masked softmax. Same arguments and result as
    paged_mla."""
    B, T, H, _ = q_nope.shape
    C = w_k.shape[0]
    N = block_tables.shape[1] * pool.shape[3]
    entries = pool[layer, 0][block_tables].reshape(B, N, -1).astype(jnp.float32)
    j = jnp.arange(N)
    pos = positions[:, :, None]
    mask = ((j <= pos) & (j < seq_lens[:, None, None]))[:, None]                 # [B, 1, T, N]
    return _dense_latent_attention(q_nope, q_rope, entries[..., :C], entries[..., C:], w_k, w_v, scale, mask)


def _dense_latent_attention(q_nope, q_rope, latent, rope_key, w_k, w_v, scale, mask):
    """latent [B, N, C], rope_key [B, N, R], mask [B, 1, T, N] -> [B, T, H, Dv]: keys and values expanded per
    head, a dense softmax over the visible keys (0 where none is)."""
    keys_nope = _einsum("bjc,chn->bjhn", latent, w_k)
    values = _einsum("bjc,chv->bjhv", latent, w_v)
    scores = (_einsum("bthn,bjhn->bhtj", q_nope, keys_nope) + _einsum("bthr,bjr->bhtj", q_rope, rope_key)) * scale
    scores = jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    # Select, not multiply: a value no token sees may be NaN (a free page).
    values = jnp.where(jnp.any(mask, axis=(1, 2))[:, :, None, None], values, 0.0)
    return _einsum("bhtj,bjhv->bthv", probs, values)


# --- the training form -------------------------------------------------------------------------------


def mla_causal(q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, rope_key: jax.Array, w_k: jax.Array,
               w_v: jax.Array, *, scale: float, key_block: int = 512) -> jax.Array:
    """Causal latent attention of each row over its own tokens (positions 0..T-1), for training.

    q_nope: [B, T, H, Dn]; q_rope: [B, T, H, R]; latent: [B, T, C]; rope_key: [B, T, R]; w_k: [C, H, Dn];
    w_v: [C, H, Dv] -> [B, T, H, Dv] f32. Expanded form, the keys folded in blocks of key_block (at most T).
    Differentiable in every argument (jax.custom_vjp: the residuals hold the latents, not the expanded heads)."""
    return _mla_causal(scale, min(key_block, q_nope.shape[1]), q_nope, q_rope, latent, rope_key, w_k, w_v)


def _expand(q_nope, q_rope, latent, rope_key, w_k, w_v):
    """-> (q [B, T, H, Dn + R], k [B, T, H, Dn + R], v [B, T, H, Dv]): every head's query, key and value."""
    H = w_k.shape[1]
    q = jnp.concatenate([q_nope, q_rope], axis=-1).astype(jnp.float32)
    rope = jnp.broadcast_to(rope_key.astype(jnp.float32)[:, :, None], (*rope_key.shape[:2], H, rope_key.shape[-1]))
    k = jnp.concatenate([_einsum("btc,chn->bthn", latent, w_k), rope], axis=-1)
    return q, k, _einsum("btc,chv->bthv", latent, w_v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mla_causal(scale, key_block, q_nope, q_rope, latent, rope_key, w_k, w_v):
    return _causal._forward(scale, None, key_block, *_expand(q_nope, q_rope, latent, rope_key, w_k, w_v),
                            jnp.int32(0))[0]


def _mla_causal_fwd(scale, key_block, q_nope, q_rope, latent, rope_key, w_k, w_v):
    out, lse = _causal._forward(scale, None, key_block, *_expand(q_nope, q_rope, latent, rope_key, w_k, w_v),
                                jnp.int32(0))
    return out, (q_nope, q_rope, latent, rope_key, w_k, w_v, out, lse)


def _mla_causal_bwd(scale, key_block, residuals, d_out):
    """The heads re-expanded from the latents, the causal attention's blockwise backward on them, and the
    expansion's own vjp back to the latents and Wk, Wv."""
    *inputs, out, lse = residuals
    (q, k, v), expand_vjp = jax.vjp(_expand, *inputs)
    dq, dk, dv, _ = _causal._causal_attention_bwd(scale, None, key_block, (q, k, v, jnp.int32(0), out, lse), d_out)
    grads = expand_vjp((dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)))
    return tuple(g.astype(x.dtype) for g, x in zip(grads, inputs))


_mla_causal.defvjp(_mla_causal_fwd, _mla_causal_bwd)


def mla_causal_reference(q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, rope_key: jax.Array,
                         w_k: jax.Array, w_v: jax.Array, *, scale: float) -> jax.Array:
    """Dense causal latent attention, for tests (jax.grad differentiates it as it is): same arguments and result
    as mla_causal."""
    T = q_nope.shape[1]
    mask = (jnp.arange(T)[None, :] <= jnp.arange(T)[:, None])[None, None]         # [1, 1, T, T]
    return _dense_latent_attention(q_nope, q_rope, latent, rope_key, w_k, w_v, scale, mask)
