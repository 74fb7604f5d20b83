"""The gated delta rule: Gated DeltaNet's linear attention, in a decode form and a prefill form.

Per token and value head, with S the head's [Dk, Dv] recurrent state:

    S <- S * exp(g)                    g <= 0 is a log decay
    S <- S + k (x) beta (v - kᵀ S)     the delta rule: write only what S does not already predict for k
    o  = qᵀ S

q and k are L2-normalised (eps as transformers' and FLA's `l2norm`) and q is scaled by 1 / sqrt(Dk).

Dimensions (docs/glossary.md): B, T, H (value heads, one state each), K (key heads: q and k carry K
heads and value head h reads key head h // (H // K), as Qwen3-Next's repeat_interleave), Dk and Dv
(key and value head sizes), N (tokens per chunk) and J (chunks). Einsum letters: b h t, j (chunk),
n m (positions in a chunk), k (Dk), v (Dv).

`valid` [B, T] is False on padding tokens (rows are right-aligned, padding first, but any pattern
works here). A padding token leaves the state bit for bit and its output is 0; NaN in padding never
reaches the state.

- `gated_delta_rule_reference`: a per-token `lax.scan` written as the formula reads; the oracle.
- `gated_delta_rule_recurrent`: the decode form (T = 1, or a few tokens), with a `custom_vjp`.
- `gated_delta_rule_chunked`: the prefill form: N-token chunks of matmuls and a unit lower-triangular
  inverse per chunk, then a scan over the chunks carrying S; its `custom_vjp` runs chunk by chunk.

All three return (o [B, T, H, Dv] f32, final state [B, H, Dk, Dv] f32).
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# transformers' (and FLA's) l2norm: x * rsqrt(sum(x^2) + 1e-6).
L2NORM_EPS = 1e-6

_f32 = jnp.float32


def _einsum(spec, *operands):
    """Every contraction here is an attention dot: f32 at HIGHEST (no TF32 on GPU)."""
    return jnp.einsum(spec, *operands, precision=lax.Precision.HIGHEST)


def _l2norm(x):
    """x: [..., D] -> x / sqrt(|x|^2 + eps)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _live_mask(valid, batch, tokens):
    """valid: [B, T] bool or None (all live) -> [B, T] bool."""
    if valid is None:
        return jnp.ones((batch, tokens), bool)
    return valid.astype(bool)


def _check_heads(q, k, v, g, beta, state):
    key_heads, value_heads = k.shape[2], v.shape[2]
    if q.shape != k.shape:
        raise ValueError(f"q {q.shape} and k {k.shape} must have the same shape [B, T, K, Dk]")
    if value_heads % key_heads:
        raise ValueError(f"value heads H={value_heads} must be a multiple of key heads K={key_heads}")
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(f"g {g.shape} and beta {beta.shape} must be [B, T, H] = {v.shape[:3]}")
    expected = (v.shape[0], value_heads, k.shape[3], v.shape[3])
    if state.shape != expected:
        raise ValueError(f"state {state.shape} must be [B, H, Dk, Dv] = {expected}")


def _prepare(q, k, v, g, beta, valid, use_qk_l2norm):
    """The steps both fast forms share, in f32.

    q, k: [B, T, K, Dk]; v: [B, T, H, Dv]; g, beta: [B, T, H]; valid: [B, T] bool or None.
    Returns q, k [B, T, H, Dk] (normalised; q scaled), v, g, beta, and live [B, T].

    Padding tokens become q = k = v = 0, g = beta = 0: an exact identity step (exp(0) = 1, a zero
    write, a zero output). `where` rather than a product, so a NaN in padding stays out.
    """
    batch, tokens, key_heads, key_size = k.shape
    group = v.shape[2] // key_heads
    live = _live_mask(valid, batch, tokens)
    at_token = live[:, :, None]
    q, k, v = (jnp.where(at_token[..., None], x.astype(_f32), 0.0) for x in (q, k, v))
    g, beta = (jnp.where(at_token, x.astype(_f32), 0.0) for x in (g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * key_size**-0.5
    q, k = jnp.repeat(q, group, axis=2), jnp.repeat(k, group, axis=2)
    return q, k, v, g, beta, live


# ---------------------------------------------------------------------------------------------
# Reference: one token at a time, the formula as written.


def gated_delta_rule_reference(q, k, v, g, beta, state, *, valid=None, use_qk_l2norm=True):
    """The per-token recurrence in f32: the oracle for both fast forms (differentiated by JAX).

    q, k: [B, T, K, Dk]; v: [B, T, H, Dv]; g, beta: [B, T, H]; state: [B, H, Dk, Dv];
    valid: [B, T] bool or None. Returns (o [B, T, H, Dv], state [B, H, Dk, Dv]), both f32.
    """
    _check_heads(q, k, v, g, beta, state)
    group = v.shape[2] // k.shape[2]
    q, k, v, g, beta = (x.astype(_f32) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q / jnp.sqrt(_f32(q.shape[-1]))
    q, k = jnp.repeat(q, group, axis=2), jnp.repeat(k, group, axis=2)
    live = _live_mask(valid, *v.shape[:2])

    def token(s, xs):
        q_t, k_t, v_t, g_t, beta_t, live_t = xs  # [B, H, Dk] x2, [B, H, Dv], [B, H] x2, [B]
        decayed = s * jnp.exp(g_t)[..., None, None]
        predicted = jnp.sum(k_t[..., :, None] * decayed, axis=-2)
        written = decayed + k_t[..., :, None] * (beta_t[..., None] * (v_t - predicted))[..., None, :]
        o_t = jnp.sum(q_t[..., :, None] * written, axis=-2)
        return (
            jnp.where(live_t[:, None, None, None], written, s),
            jnp.where(live_t[:, None, None], o_t, 0.0),
        )

    time_major = (jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, live))
    state, o = lax.scan(token, state.astype(_f32), tuple(time_major))
    return jnp.moveaxis(o, 0, 1), state


# ---------------------------------------------------------------------------------------------
# Decode form: the recurrence, with a backward that recomputes the states instead of saving them.


def _token_step(state, xs):
    """One token for all rows and heads.

    state: [B, H, Dk, Dv]; xs = (q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], live [B]).
    Returns (state, o [B, H, Dv]).
    """
    q, k, v, g, beta, live = xs
    decayed = state * jnp.exp(g)[..., None, None]
    delta = beta[..., None] * (v - _einsum("bhk,bhkv->bhv", k, decayed))
    written = decayed + _einsum("bhk,bhv->bhkv", k, delta)
    o = _einsum("bhk,bhkv->bhv", q, written)
    # Padding tokens are already identity steps; `where` also keeps signed zeros bit for bit.
    return jnp.where(live[:, None, None, None], written, state), o


def _time_major(q, k, v, g, beta, live):
    return tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, live))


def _scan_tokens(step, state, xs):
    """lax.scan over the leading (time) axis of xs; one token (decode) runs the step as straight-line
    ops, since a scan, even unrolled, lowers to a while loop."""
    if xs[0].shape[0] != 1:
        return lax.scan(step, state, xs)
    state, y = step(state, jax.tree.map(lambda x: x[0], xs))
    return state, jax.tree.map(lambda x: x[None], y)


@jax.custom_vjp
def _recurrent(q, k, v, g, beta, state, live):
    """Prepared inputs ([B, T, H, ...] f32, live [B, T]) -> (o [B, T, H, Dv], state)."""
    state, o = _scan_tokens(_token_step, state, _time_major(q, k, v, g, beta, live))
    return jnp.moveaxis(o, 0, 1), state


def _recurrent_fwd(q, k, v, g, beta, state, live):
    # Residuals are the inputs only: the backward recomputes the per-token states.
    return _recurrent(q, k, v, g, beta, state, live), (q, k, v, g, beta, state, live)


def _recurrent_bwd(residuals, cotangents):
    q, k, v, g, beta, state, live = residuals
    d_o, d_state = cotangents
    xs = _time_major(q, k, v, g, beta, live)

    def incoming(s, x):
        return _token_step(s, x)[0], s

    _, states_in = _scan_tokens(incoming, state, xs)

    def back(d_s, per_token):
        s_in, x, live_t, d_o_t = per_token
        _, step_vjp = jax.vjp(lambda s, x: _token_step(s, (*x, live_t)), s_in, x)
        return step_vjp((d_s, d_o_t))

    d_state0, d_xs = lax.scan(back, d_state, (states_in, xs[:5], xs[5], jnp.moveaxis(d_o, 1, 0)), reverse=True)
    d_q, d_k, d_v, d_g, d_beta = (jnp.moveaxis(d, 0, 1) for d in d_xs)
    return d_q, d_k, d_v, d_g, d_beta, d_state0, None


_recurrent.defvjp(_recurrent_fwd, _recurrent_bwd)


def gated_delta_rule_recurrent(q, k, v, g, beta, state, *, valid=None, use_qk_l2norm=True, each=False):
    """Decode form: the recurrence token by token (one step for decode).

    q, k: [B, T, K, Dk]; v: [B, T, H, Dv]; g (log decay, <= 0), beta: [B, T, H];
    state: [B, H, Dk, Dv]; valid: [B, T] bool or None.
    Returns (o [B, T, H, Dv], state [B, H, Dk, Dv]), both f32; each: the state after every token instead,
    [B, T, H, Dk, Dv] (a padding token's is the state before it), so that a caller can keep any of them
    (speculative decoding keeps the one after its last accepted token); not differentiable.

    Differentiable: the backward saves only the inputs and recomputes the T states it needs, so
    for training over long sequences use `gated_delta_rule_chunked`.
    """
    _check_heads(q, k, v, g, beta, state)
    q, k, v, g, beta, live = _prepare(q, k, v, g, beta, valid, use_qk_l2norm)
    if each:
        def keep(s, xs):
            s, o = _token_step(s, xs)
            return s, (o, s)
        _, (o, states) = _scan_tokens(keep, state.astype(_f32), _time_major(q, k, v, g, beta, live))
        return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)
    return _recurrent(q, k, v, g, beta, state.astype(_f32), live)


# ---------------------------------------------------------------------------------------------
# Prefill form: chunks of matmuls (the WY form of the delta rule) and a scan over chunks.


@jax.custom_vjp
def _unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower triangular a: [..., N, N], by forward substitution.

    Plain ops in a `fori_loop`: `lax.linalg.triangular_solve` lowers to a LAPACK custom call on
    CPU that the JAX-free runtime's plugin cannot compile.
    """
    n = a.shape[-1]
    eye = jnp.eye(n, dtype=a.dtype)

    def solve_row(i, x):
        # Row i of X = e_i - a[i] X. a[i, m] = 0 for m >= i, so rows not yet solved are not read.
        a_i = lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=False)
        x_i = lax.dynamic_index_in_dim(eye, i, axis=0, keepdims=False) - _einsum("...m,...mn->...n", a_i, x)
        return lax.dynamic_update_index_in_dim(x, x_i, i, axis=-2)

    return lax.fori_loop(1, n, solve_row, jnp.broadcast_to(eye, a.shape))


def _unit_lower_inverse_fwd(a):
    x = _unit_lower_inverse(a)
    return x, x


def _unit_lower_inverse_bwd(x, d_x):
    # X = M^-1 gives dM = -Xᵀ dX Xᵀ: matmuls, no loop. Only the strict lower triangle of `a` is read.
    d_m = -_einsum("...ca,...cd,...bd->...ab", x, d_x, x)
    n = x.shape[-1]
    return (jnp.where(jnp.tri(n, k=-1, dtype=bool), d_m, 0.0),)


_unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


class _ChunkTerms(NamedTuple):
    """What a chunk contributes independently of the state S it starts from. Leading dims [..] are
    [J, B, H] (all chunks) or [B, H] (one chunk).

    Within a chunk, with gamma the cumulative log decay from its start, the delta-rule writes are
    u = w_v - w_k S, the outputs are o = q_in S + qk u, and the state at its end is
    decay S + k_outᵀ u.
    """

    w_v: jax.Array  # [.., N, Dv]  (I + A)^-1 (beta v)
    w_k: jax.Array  # [.., N, Dk]  (I + A)^-1 (beta exp(gamma) k)
    q_in: jax.Array  # [.., N, Dk]  q exp(gamma): reads of the incoming state
    qk: jax.Array  # [.., N, N]   causal q kᵀ exp(gamma_n - gamma_m), diagonal included
    k_out: jax.Array  # [.., N, Dk]  k exp(gamma_N - gamma): each write decayed to the chunk's end
    decay: jax.Array  # [..]         exp(gamma_N)


def _chunk_terms(q, k, v, g, beta):
    """All chunks at once: q, k [J, B, H, N, Dk]; v [J, B, H, N, Dv]; g, beta [J, B, H, N] -> _ChunkTerms.

    A[n, m] = beta_n (k_n . k_m) exp(gamma_n - gamma_m) for m < n couples each token's write to
    the earlier writes of its chunk; inverting I + A turns the N sequential delta steps into matmuls.
    """
    n = g.shape[-1]
    gamma = jnp.cumsum(g, axis=-1)
    causal = jnp.tri(n, dtype=bool)
    # Masked before exp: above the diagonal gamma_n - gamma_m > 0 and could overflow.
    pair_decay = jnp.exp(jnp.where(causal, gamma[..., :, None] - gamma[..., None, :], -jnp.inf))
    a = beta[..., :, None] * _einsum("...nk,...mk->...nm", k, k) * pair_decay
    inverse = _unit_lower_inverse(jnp.where(jnp.tri(n, k=-1, dtype=bool), a, 0.0))
    return _ChunkTerms(
        w_v=_einsum("...nm,...mv->...nv", inverse, beta[..., None] * v),
        w_k=_einsum("...nm,...mk->...nk", inverse, (beta * jnp.exp(gamma))[..., None] * k),
        q_in=q * jnp.exp(gamma)[..., None],
        qk=_einsum("...nk,...mk->...nm", q, k) * pair_decay,
        k_out=k * jnp.exp(gamma[..., -1:] - gamma)[..., None],
        decay=jnp.exp(gamma[..., -1]),
    )


def _chunk_step(state, terms, live):
    """One chunk: state [B, H, Dk, Dv], terms (_ChunkTerms of [B, H]), live [B, N] -> (state, o [B, H, N, Dv])."""
    u = terms.w_v - _einsum("bhnk,bhkv->bhnv", terms.w_k, state)
    o = _einsum("bhnk,bhkv->bhnv", terms.q_in, state) + _einsum("bhnm,bhmv->bhnv", terms.qk, u)
    written = terms.decay[..., None, None] * state + _einsum("bhnk,bhnv->bhkv", terms.k_out, u)
    # An all-padding chunk is an identity already; `where` also keeps signed zeros bit for bit.
    return jnp.where(jnp.any(live, axis=-1)[:, None, None, None], written, state), o


# [B, J, N, ...] -> [J, B, (H,) N, ...] by rank: live [B, T], g and beta [B, T, H], q k v [B, T, H, D].
_CHUNK_AXES = {3: (1, 0, 2), 4: (1, 0, 3, 2), 5: (1, 0, 3, 2, 4)}


def _to_chunks(x, chunk):
    """[B, T] -> [J, B, N]; [B, T, H] -> [J, B, H, N]; [B, T, H, D] -> [J, B, H, N, D]."""
    b, t = x.shape[:2]
    x = x.reshape(b, t // chunk, chunk, *x.shape[2:])
    return x.transpose(_CHUNK_AXES[x.ndim])


def _from_chunks(x):
    """The inverse of `_to_chunks`."""
    x = x.transpose(np.argsort(_CHUNK_AXES[x.ndim]))
    return x.reshape(x.shape[0], -1, *x.shape[3:])


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def _chunked(q, k, v, g, beta, state, live, chunk):
    """Prepared inputs ([B, T, H, ...] f32 with T a multiple of `chunk`, live [B, T]) -> (o, state)."""
    terms = _chunk_terms(*(_to_chunks(x, chunk) for x in (q, k, v, g, beta)))
    state, o = lax.scan(lambda s, x: _chunk_step(s, *x), state, (terms, _to_chunks(live, chunk)))
    return _from_chunks(o), state


def _chunked_fwd(q, k, v, g, beta, state, live, chunk):
    chunks = tuple(_to_chunks(x, chunk) for x in (q, k, v, g, beta))
    live_chunks = _to_chunks(live, chunk)
    terms = _chunk_terms(*chunks)

    def step(s, per_chunk):
        s_next, o = _chunk_step(s, *per_chunk)
        return s_next, (o, s)

    state, (o, states_in) = lax.scan(step, state, (terms, live_chunks))
    # Residuals: the inputs and the state entering each chunk ([J, B, H, Dk, Dv], T/N times smaller
    # than per-token states). The chunk terms are recomputed in the backward.
    return (_from_chunks(o), state), (chunks, live_chunks, states_in)


def _chunked_bwd(chunk, residuals, cotangents):
    chunks, live_chunks, states_in = residuals
    d_o, d_state = cotangents
    terms, terms_vjp = jax.vjp(_chunk_terms, *chunks)

    def back(d_s, per_chunk):
        s_in, terms_j, live_j, d_o_j = per_chunk
        _, step_vjp = jax.vjp(lambda s, t: _chunk_step(s, t, live_j), s_in, terms_j)
        return step_vjp((d_s, d_o_j))

    d_o_chunks = _to_chunks(d_o, chunk)
    d_state0, d_terms = lax.scan(back, d_state, (states_in, terms, live_chunks, d_o_chunks), reverse=True)
    d_q, d_k, d_v, d_g, d_beta = (_from_chunks(d) for d in terms_vjp(d_terms))
    return d_q, d_k, d_v, d_g, d_beta, d_state0, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def gated_delta_rule_chunked(q, k, v, g, beta, state, *, valid=None, use_qk_l2norm=True, chunk=64):
    """Prefill form: `chunk`-token chunks of matmuls, then a scan over the chunks carrying S.

    q, k: [B, T, K, Dk]; v: [B, T, H, Dv]; g (log decay, <= 0), beta: [B, T, H];
    state: [B, H, Dk, Dv]; valid: [B, T] bool or None.
    Returns (o [B, T, H, Dv], state [B, H, Dk, Dv]), both f32.

    T need not be a multiple of `chunk`: the tail is padded with identity tokens. The backward
    recomputes each chunk's terms and runs the chunks in reverse carrying dS; its largest
    intermediate is [J, B, H, N, N], never [T, T].
    """
    _check_heads(q, k, v, g, beta, state)
    tokens = v.shape[1]
    q, k, v, g, beta, live = _prepare(q, k, v, g, beta, valid, use_qk_l2norm)
    tail = -tokens % chunk

    def pad(x):
        return jnp.pad(x, [(0, 0), (0, tail)] + [(0, 0)] * (x.ndim - 2))

    o, state = _chunked(*map(pad, (q, k, v, g, beta)), state.astype(_f32), pad(live), chunk)
    return o[:, :tokens], state
