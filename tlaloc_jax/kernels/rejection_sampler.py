"""Speculative decoding's acceptance in the body: which drafted tokens a verify row keeps and the token it emits
after them, for greedy and sampled rows, keeping the target's distribution exactly (vLLM's rejection sampler).

A verify row b holds its last token and up to K drafts at positions [start, start + n), right-aligned in T
columns (position -1 before them). Column t's logits are the target's distribution after the row's tokens through
t, which is where the row's (j + 1)-th emitted token comes from, j = t - (the row's first column): the drafts
before t are j of its output tokens. Each column's logits are processed as the sampler processes a decode row's
(kernels/in_body_sampler.py: bias, penalties over the history through t with steps + j output tokens, column t's
mask (a grammar's after the drafts through t; a row's one mask in a verify entry staged with one), then
temperature, min-p, top-k, top-p), so the target p_t is exactly the distribution the sampler would draw from
had the drafts before t been sampled.

The drafts come from a deterministic proposer (n-gram): the draft distribution q is one-hot at the draft d. So
draft d after column t is accepted with probability min(1, p_t(d) / q(d)) = p_t(d), against a uniform drawn at
counter (steps + j, 1); at the first rejection the row emits a draw from norm(max(0, p_t - q)), p_t with d's mass
removed, and if every draft is accepted, a draw from p at the last column (the bonus token); both at counter
(steps + j, 0), the counter a decode step's draw for that token uses. Each emitted token is then distributed as
p_t given the tokens before it (Leviathan et al., ICML 2023; Chen et al., 2023). A greedy row (temperature 0)
keeps a draft while it is the argmax of the processed logits and emits the argmax after them: what greedy
decoding gives, token for token.

Reported logprobs are the raw model's (log_softmax of the logits, as the sampler's): the emitted token's at each
column and the N largest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tlaloc_jax.artifact import SAMPLING_COLUMNS

from . import in_body_sampler as sampler

# The counter's second word: a draft's acceptance draw, beside the token draws (lane 0) of the same step.
ACCEPT_LANE = 1


def accepted_prefix(ok: jax.Array, positions: jax.Array) -> jax.Array:
    """ok [B, T] (column t's test of the draft after it), positions [B, T] -> [B] int32: how many drafts the row
    keeps, the longest run of passed tests from its first column (the last column has no draft after it)."""
    pad = positions[:, :-1] < 0
    keep = ok[:, :-1] | pad
    return (jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1) - jnp.sum(pad, axis=1)).astype(jnp.int32)


def residual(weights: jax.Array, draft: jax.Array) -> jax.Array:
    """weights [R, V] (the target's, unnormalized), draft [R] (-1: none) -> norm(max(0, p - q)) unnormalized for a
    one-hot q: the weights with the draft's removed; at a column with no draft after it, the target itself (the
    bonus token's distribution). A target all on the draft accepts it always: its weights stand, never drawn from."""
    ids = lax.broadcasted_iota(jnp.int32, weights.shape, 1)
    rest = jnp.where(ids == draft[:, None], 0.0, weights)
    return jnp.where(jnp.sum(rest, axis=1, keepdims=True) > 0, rest, weights)


def _per_column(a: jax.Array, T: int) -> jax.Array:
    """A row input [B, ...] -> [B * T, ...]: each row's value at each of its columns."""
    return jnp.repeat(a, T, axis=0)


def verify_sample(logits, token_ids, positions, params, seeds, steps, mask, bias_ids, bias, history, *, top_n: int):
    """logits [B, T, V], token_ids and positions [B, T], the sampler's row inputs [B, ...] (RNG_STEP: the row's
    generated tokens before this call; mask [B, T, W], each column's, or [B, W], the row's for all) -> (tokens
    [B, T]: the token the row emits at t when it stops there, accepted [B], the emitted token's logprob at each
    column [B, T], the top_n logprobs [B, T, N] and their ids)."""
    B, T, V = logits.shape
    logits = logits.reshape(B * T, V).astype(jnp.float32)
    first = jnp.sum(positions < 0, axis=1)
    drafted = jnp.maximum(jnp.arange(T)[None, :] - first[:, None], 0)                 # [B, T]: j
    col_steps = (steps[:, None] + drafted).reshape(-1)
    col_params = _per_column(params, T)
    col_mask = mask.reshape(B * T, -1) if mask.ndim == 3 else _per_column(mask, T)
    x = sampler.process_logits(logits, col_params, col_mask, _per_column(bias_ids, T),
                               _per_column(bias, T), _per_column(history, T), (positions + 1).reshape(-1), col_steps)
    draft = jnp.concatenate([token_ids[:, 1:], jnp.full((B, 1), -1, token_ids.dtype)], axis=1).reshape(-1)
    greedy = sampler.first_max(x)
    temperature = col_params[:, SAMPLING_COLUMNS.index("temperature")]

    def draw(x):
        z = sampler.tempered(x, col_params)
        weights = jnp.where(sampler.kept_tokens(x, col_params), jnp.exp(z), 0.0)
        ids = lax.broadcasted_iota(jnp.int32, weights.shape, 1)
        p_draft = jnp.sum(jnp.where(ids == draft[:, None], weights, 0.0), axis=1) / jnp.sum(weights, axis=1)
        rest = residual(weights, draft)
        col_seeds = _per_column(seeds, T)
        accept = sampler.uniforms(col_seeds, col_steps, lane=ACCEPT_LANE) < p_draft
        cdf = jnp.cumsum(rest, axis=-1)
        target = sampler.uniforms(col_seeds, col_steps)[:, None] * cdf[:, -1:]
        drawn = jnp.minimum(jnp.sum(cdf < target, axis=-1), V - 1).astype(jnp.int32)
        sampled = temperature > 0
        return jnp.where(sampled, drawn, greedy), jnp.where(sampled, accept, greedy == draft)

    tokens, ok = lax.cond(jnp.any(temperature > 0), draw, lambda x: (greedy, greedy == draft), x)
    tokens, ok = tokens.reshape(B, T), ok.reshape(B, T)
    accepted = accepted_prefix(ok, positions)
    # The token each column emits: its draft while the row keeps it, then the row's own token.
    emitted = jnp.where(drafted < accepted[:, None], draft.reshape(B, T), tokens)
    lsm = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lsm, emitted.reshape(-1, 1), axis=1)[:, 0]
    vals, ids = sampler.top_logprobs(lsm, top_n)
    return tokens, accepted, chosen.reshape(B, T), vals.reshape(B, T, top_n), ids.reshape(B, T, top_n)
