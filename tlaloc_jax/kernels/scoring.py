"""Prompt scoring inside a prefill body: for every position of a call, the logprob of the token that follows it
(the next prompt token), its rank, and the N largest logprobs with their ids: what `echo` + `logprobs` and vLLM's
`prompt_logprobs` report for a prompt.

`score_positions` is what a scoring prefill entry (manifest EntryKind.PREFILL_SCORED, export/_stage.py) appends
after the model's last layer; `score_reference` is the naive form, one position at a time in float64 numpy.

Per position t of row b of a call (docs/glossary.md names B, T, E, V; N the top logprobs):

  hidden  [B, T, E]   the final-normed hidden state after each token of the call (rows right-aligned)
  targets [B, T] i32  the token position t is scored against (the next prompt token); -1: none (padding, or
                      a position whose next token is not a prompt token)
  head    x [R, E] -> logits [R, V]: the model's output head

  logprob [B, T] f32     log_softmax(head(hidden))[target]; 0 where target is -1
  rank    [B, T] i32     1 + the number of tokens whose logprob is larger than the target's (vLLM's rank, the
                         host fallback's); 0 where target is -1
  top     [B, T, N] f32  the N largest logprobs, largest first, and their ids [B, T, N] i32
                         (tlaloc_jax/kernels/in_body_sampler.py `top_logprobs`, the decode sampler's own: of equal
                         values the smaller id first); zeros where target is -1

The logits of a whole call are T x V per row: a 512-token chunk of a 150k vocabulary is 300 MiB of f32 per row.
So the positions are scored in blocks, a `lax.map` over blocks of at most `max_elements` logits (vLLM scores
prompt hidden states in chunks for the same reason), and a block with no target is skipped (`lax.cond`): the
padding of a short prompt in a long chunk costs nothing.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .in_body_sampler import top_logprobs

# The most logits one block materializes: 16 Mi f32 = 64 MiB.
MAX_BLOCK_ELEMENTS = 1 << 24


def block_positions(batch: int, tokens: int, vocab: int, max_elements: int = MAX_BLOCK_ELEMENTS) -> int:
    """The positions scored together: the largest divisor of `tokens` whose block of batch x it x vocab logits
    stays within max_elements (at least 1)."""
    fit = max(1, max_elements // max(1, batch * vocab))
    return max(d for d in range(1, tokens + 1) if tokens % d == 0 and d <= fit)


def score_positions(hidden, targets, head: Callable, *, top_n: int, max_elements: int = MAX_BLOCK_ELEMENTS):
    """-> (logprob [B, T] f32, rank [B, T] i32, top logprobs [B, T, N] f32, top ids [B, T, N] i32); the module
    docstring says what each holds."""
    B, T, E = hidden.shape
    V = jax.eval_shape(head, jax.ShapeDtypeStruct((1, E), hidden.dtype)).shape[-1]
    tb = block_positions(B, T, V, max_elements)
    nb = T // tb
    R = B * tb
    blocks = hidden.reshape(B, nb, tb, E).transpose(1, 0, 2, 3).reshape(nb, R, E)
    wanted = targets.astype(jnp.int32).reshape(B, nb, tb).transpose(1, 0, 2).reshape(nb, R)

    def score(h, t):
        lsm = jax.nn.log_softmax(head(h).astype(jnp.float32), axis=-1)              # [R, V]
        chosen = jnp.take_along_axis(lsm, jnp.maximum(t, 0)[:, None], axis=1)       # [R, 1]
        rank = 1 + jnp.sum(lsm > chosen, axis=-1, dtype=jnp.int32)
        vals, ids = top_logprobs(lsm, top_n)
        live = t >= 0
        return (jnp.where(live, chosen[:, 0], 0.0), jnp.where(live, rank, 0),
                jnp.where(live[:, None], vals, 0.0), jnp.where(live[:, None], ids, 0))

    def skip(h, t):
        return (jnp.zeros((R,), jnp.float32), jnp.zeros((R,), jnp.int32), jnp.zeros((R, top_n), jnp.float32),
                jnp.zeros((R, top_n), jnp.int32))

    def block(args):
        h, t = args
        return lax.cond(jnp.any(t >= 0), score, skip, h, t)

    lp, rank, vals, ids = lax.map(block, (blocks, wanted))

    def unblock(x):
        return x.reshape(nb, B, tb, *x.shape[2:]).swapaxes(0, 1).reshape(B, T, *x.shape[2:])

    return unblock(lp), unblock(rank), unblock(vals), unblock(ids)


def score_reference(logits, targets, *, top_n: int):
    """The naive form over the logits of every position, float64, one position at a time: logits [B, T, V],
    targets [B, T] -> (logprob [B, T], rank [B, T], top logprobs [B, T, N], top ids [B, T, N])."""
    logits = np.asarray(logits, np.float64)
    B, T, V = logits.shape
    lp, rank = np.zeros((B, T)), np.zeros((B, T), np.int32)
    vals, ids = np.zeros((B, T, top_n)), np.zeros((B, T, top_n), np.int32)
    for b in range(B):
        for t in range(T):
            x = logits[b, t]
            lsm = x - (x.max() + np.log(np.sum(np.exp(x - x.max()))))
            order = np.argsort(-lsm, kind="stable")[:top_n]
            vals[b, t], ids[b, t] = lsm[order], order
            target = int(targets[b, t])
            if target >= 0:
                lp[b, t] = lsm[target]
                rank[b, t] = 1 + int(np.sum(lsm > lsm[target]))
    return lp, rank, vals, ids
