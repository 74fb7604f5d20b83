"""Sampling inside the body: one token per row from its logits, as the row's own parameters say, with a
counter-based random stream per row, and the logprobs an OpenAI response reports.

`sample_tokens` is what `tlaloc_jax.stage` appends to every entry (export/_stage.py); `sample_reference` is
the naive form, one row at a time in float64 numpy, and `filtered_probs` the distribution a sampled row
draws from (what the chi-square tests compare frequencies against).

Per row b of a call (docs/glossary.md names B, V, C; NB is the logit-bias slots, N the top logprobs, W the
mask's words):

  params  [B, P] f32   SAMPLING_COLUMNS: temperature (0: greedy), top_p (1: off), top_k (0: off), min_p
                       (0: off), presence, frequency and repetition penalties (0, 0, 1: off), top logprobs
                       wanted (0: none; any positive value computes all N of TOP_LOGPROBS)
  seeds   [B, 2] i32   the row's 64-bit seed as two words (low, high)
  steps   [B] i32      the tokens the sequence generated before this call: its random stream's counter, and
                       how many of the history's last tokens are output tokens
  mask    [B, W] i32   allowed tokens, packed: bit t % 32 of word t // 32 (all ones: no constraint)
  bias_ids, bias [B, NB]  logit bias: token id (-1: an empty slot) and the value added to its logit
  history [B, C] i32   the sequence's tokens by position through this call's last token, -1 past its end
  seq_lens [B] i32     how many of history's entries are the sequence's

What a row computes, in order (vLLM's order): x = logits + bias; the repetition penalty on every token of
the history (x / r where x > 0, x * r elsewhere); x -= frequency * count + presence * (count > 0) over the
output tokens; tokens outside the mask -> -inf. A greedy row takes argmax(x) (with no bias, penalty or
mask that is argmax(logits) exactly: each step above is the identity at its neutral value). A sampled row
takes z = (x - max x) / temperature, keeps z >= log(min_p), the top_k largest and the smallest prefix of
the sorted distribution whose mass reaches top_p, and draws by the inverse CDF of the kept tokens' weights
exp(z), in token-id order, at one uniform number: a threefry2x32 block keyed by the seed with the step as
its counter. The draw depends only on the row's own logits, parameters, seed and step: a seeded request
gives the same tokens alone or batched with any others. (One random number a row, not V: Gumbel-max over V
would cost V threefry blocks a step.)

The reported logprobs are the model's own distribution, log_softmax(logits) before any processing (vLLM's
default, "raw logprobs"): the chosen token's, and the N largest with their ids.

Whole-batch work that no row needs is skipped with `lax.cond` (penalties, the sort for top-k / top-p, the
noise, the top-N): each branch gives a row the same result, so skipping never changes a row's token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from tlaloc_jax.artifact import SAMPLING_COLUMNS

# Each SAMPLING column's index: the kernel reads its parameters by name.
_COL = {name: i for i, name in enumerate(SAMPLING_COLUMNS)}


def unpack_mask(mask: jax.Array, vocab: int) -> jax.Array:
    """mask [B, W] int32 -> allowed [B, V] bool (bit t % 32 of word t // 32)."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1          # [B, W, 32]
    return bits.reshape(mask.shape[0], -1)[:, :vocab].astype(bool)


def _rows(n: int, width: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(n)[:, None], (n, width))


def _penalize(x, params, history, seq_lens, steps):
    """The repetition penalty over the history, presence and frequency over its last `steps` tokens."""
    B, V = x.shape
    C = history.shape[1]
    pos = jnp.arange(C)[None, :]
    live = (pos < seq_lens[:, None]) & (history >= 0)
    output = live & (pos >= (seq_lens - steps)[:, None])
    ids = jnp.where(live, history, V)                           # V: out of range, dropped
    rows = _rows(B, C)
    seen = jnp.zeros((B, V), bool).at[rows, ids].set(True, mode="drop")
    counts = jnp.zeros((B, V), jnp.float32).at[rows, ids].add(output.astype(jnp.float32), mode="drop")
    rep = params[:, _COL["repetition_penalty"], None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    return (x - params[:, _COL["frequency_penalty"], None] * counts
            - params[:, _COL["presence_penalty"], None] * (counts > 0))


def process_logits(logits, params, mask, bias_ids, bias, history, seq_lens, steps):
    """logits [B, V] -> x [B, V]: bias, penalties, the mask (disallowed tokens -inf). The identity on a row
    whose bias slots are empty, penalties neutral and mask all ones."""
    B, V = logits.shape
    x = logits.astype(jnp.float32)
    x = x.at[_rows(B, bias_ids.shape[1]), jnp.where(bias_ids >= 0, bias_ids, V)].add(bias, mode="drop")
    needs = jnp.any((params[:, _COL["presence_penalty"]] != 0) | (params[:, _COL["frequency_penalty"]] != 0)
                    | (params[:, _COL["repetition_penalty"]] != 1))
    x = lax.cond(needs, _penalize, lambda x, *_: x, x, params, history, seq_lens, steps)
    return jnp.where(unpack_mask(mask, V), x, -jnp.inf)


def _keep(z, params):
    """z [B, V] (max-shifted, tempered; -inf where masked) -> the tokens a row may draw [B, V] bool."""
    V = z.shape[1]
    min_p = params[:, _COL["min_p"], None]
    keep = jnp.isfinite(z) & ((min_p <= 0) | (z >= jnp.log(jnp.maximum(min_p, 1e-30))))
    top_k = params[:, _COL["top_k"]].astype(jnp.int32)
    top_p = params[:, _COL["top_p"]]

    def sorted_cut(z, keep):
        # One descending sort serves both cuts: the k-th value, then the smallest prefix of what top-k left
        # whose mass reaches top_p (the tokens whose exclusive cumulative mass is below top_p).
        s = -jnp.sort(-jnp.where(keep, z, -jnp.inf), axis=-1)                  # [B, V], largest first
        kth = jnp.take_along_axis(s, jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=1)
        kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
        s = jnp.where(s < kth, -jnp.inf, s)
        p = jax.nn.softmax(s, axis=-1)
        inside = ((jnp.cumsum(p, axis=-1) - p) < top_p[:, None]) & jnp.isfinite(s)
        last = jnp.maximum(jnp.sum(inside, axis=-1) - 1, 0)
        cut = jnp.take_along_axis(s, last[:, None], axis=1)
        cut = jnp.where(top_p[:, None] >= 1.0, kth, jnp.maximum(cut, kth))
        return keep & (z >= cut)

    needs = jnp.any((top_k > 0) | (top_p < 1.0))
    return lax.cond(needs, sorted_cut, lambda z, keep: keep, z, keep)


def uniforms(seeds, steps, lane: int = 0):
    """[B] f32 in (0, 1): row b's draw is one threefry2x32 block keyed by its seed with counter (step, lane), a
    counter-based stream (Salmon et al., SC 2011): the same (seed, step, lane) gives the same number in any batch.
    The token draws use lane 0; speculative decoding's acceptance tests lane 1 (kernels/rejection_sampler.py)."""
    key = lax.bitcast_convert_type(seeds, jnp.uint32)                          # [B, 2]: low, high words
    counter = lax.bitcast_convert_type(steps, jnp.uint32)
    bits, _ = threefry2x32_p.bind(key[:, 0], key[:, 1], counter, jnp.full_like(counter, lane))
    # 23 bits, centred in their interval: never 0 or 1.
    return ((bits >> 9).astype(jnp.float32) + 0.5) * jnp.float32(2.0 ** -23)


def tempered(x, params):
    """z = (x - max x) / temperature per row (temperature 0 read as 1). Shifted first, every value is <= 0 before
    the division: no overflow however small the temperature."""
    temperature = params[:, _COL["temperature"]]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    top = jnp.max(x, axis=-1, keepdims=True)
    return (x - jnp.where(jnp.isfinite(top), top, 0.0)) / t


def kept_tokens(x, params):
    """x [B, V] (processed logits) -> [B, V] bool: the tokens a sampled row may draw (min-p, top-k, top-p)."""
    return _keep(tempered(x, params), params)


def first_max(x: jax.Array) -> jax.Array:
    """x [..., V] -> [...] int32: the first index of each row's largest value, a NaN counting as the largest (what
    jnp.argmax gives), as two plain reductions, which XLA's CPU backend vectorizes where it runs argmax's
    (value, index) reduce one element at a time (59 us for a row of 16000 logits in a decode step; these two, a few)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    ids = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), ids, x.shape[-1]), axis=-1)


def choose(x, params, seeds, steps):
    """x [B, V] (processed logits) -> the token of each row [B] int32: argmax for greedy rows; for the others
    the inverse CDF of the kept tokens' distribution, in token-id order, at the row's uniform draw."""
    temperature = params[:, _COL["temperature"]]
    greedy_ids = first_max(x)

    def draw(x):
        z = tempered(x, params)
        weights = jnp.where(_keep(z, params), jnp.exp(z), 0.0)
        cdf = jnp.cumsum(weights, axis=-1)
        target = uniforms(seeds, steps)[:, None] * cdf[:, -1:]
        # The first token whose cumulative mass reaches the target: its own weight is positive.
        sampled = jnp.minimum(jnp.sum(cdf < target, axis=-1), x.shape[1] - 1).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy_ids)

    return lax.cond(jnp.any(temperature > 0), draw, lambda x: greedy_ids, x)


def logprobs(logits, tokens, params, top_n: int):
    """(logprob of each row's token [B], the top_n largest logprobs [B, N] and their ids [B, N]) of
    log_softmax(logits). The top N are computed only when some row asks for them (zeros otherwise)."""
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lsm, tokens[:, None], axis=1)[:, 0]
    if top_n == 0:
        B = logits.shape[0]
        return chosen, jnp.zeros((B, 0), jnp.float32), jnp.zeros((B, 0), jnp.int32)

    def none(lsm):
        B = lsm.shape[0]
        return jnp.zeros((B, top_n), jnp.float32), jnp.zeros((B, top_n), jnp.int32)

    vals, ids = lax.cond(jnp.any(params[:, _COL["top_logprobs"]] > 0), lambda lsm: top_logprobs(lsm, top_n), none,
                         lsm)
    return chosen, vals, ids


def top_logprobs(lsm, top_n: int):
    """lsm [R, V] -> the top_n largest logprobs of each row [R, N] f32 and their ids [R, N] int32, largest first
    (lax.top_k: of equal values, the smaller id first). Prompt scoring (tlaloc_jax/kernels/scoring.py) reports the same."""
    vals, ids = lax.top_k(lsm, top_n)
    return vals, ids.astype(jnp.int32)


def sample_tokens(logits, params, seeds, steps, mask, bias_ids, bias, history, seq_lens, *, top_n: int):
    """One call's sampler: -> (token [B] int32, its logprob [B] f32, top logprobs [B, N] f32, their ids
    [B, N] int32). Shapes and columns: the module docstring."""
    x = process_logits(logits, params, mask, bias_ids, bias, history, seq_lens, steps)
    tokens = choose(x, params, seeds, steps)
    return (tokens, *logprobs(logits, tokens, params, top_n))


# -- the naive form -------------------------------------------------------------------------------------


def _row_params(params_row) -> dict:
    return {name: float(params_row[i]) for name, i in _COL.items()}


def reference_processed(logits_row, params_row, mask_row, bias_ids_row, bias_row, history_row, seq_len, step):
    """One row, float64 numpy, token by token: the processed logits x [V] (-inf where masked)."""
    p = _row_params(params_row)
    V = len(logits_row)
    x = np.asarray(logits_row, np.float64).copy()
    for t, b in zip(bias_ids_row, bias_row):
        if t >= 0:
            x[int(t)] += float(b)
    tokens = [int(t) for t in history_row[:seq_len] if t >= 0]
    outputs = tokens[len(tokens) - int(step):] if step else []
    for t in set(tokens):
        r = p["repetition_penalty"]
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(outputs):
        x[t] -= p["frequency_penalty"] * outputs.count(t) + p["presence_penalty"]
    for t in range(V):
        if not (int(mask_row[t // 32]) >> (t % 32)) & 1:
            x[t] = -math.inf
    return x


def filtered_probs(x_row, params_row) -> np.ndarray:
    """The distribution a sampled row draws from, float64 [V]: softmax of (x - max) / temperature over the
    tokens min-p, top-k and top-p keep (the greedy row's: one-hot at argmax x)."""
    p = _row_params(params_row)
    x = np.asarray(x_row, np.float64)
    V = len(x)
    if p["temperature"] <= 0:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out
    z = (x - np.max(x)) / p["temperature"]
    keep = np.isfinite(z)
    if p["min_p"] > 0:
        keep &= z >= math.log(p["min_p"])
    order = sorted((t for t in range(V) if keep[t]), key=lambda t: -z[t])
    k = int(p["top_k"])
    if k > 0 and len(order) > k:
        kth = z[order[k - 1]]
        order = [t for t in order if z[t] >= kth]
    if p["top_p"] < 1.0:
        w = np.exp([z[t] for t in order])
        w /= w.sum()
        before, kept = 0.0, []
        for t, wt in zip(order, w):
            if before >= p["top_p"]:
                break
            kept.append(t)
            before += wt
        cut = z[kept[-1]]
        order = [t for t in order if z[t] >= cut]
    out = np.zeros(V)
    w = np.exp([z[t] for t in order])
    out[order] = w / w.sum()
    return out


def sample_reference(logits, params, seeds, steps, mask, bias_ids, bias, history, seq_lens, *, top_n: int):
    """The naive form of `sample_tokens`, row by row in float64: the greedy rows' tokens, every row's
    filtered distribution and the logprobs. Sampled rows take the inverse CDF of the reference's distribution
    at the kernel's uniform draw (threefry's bits define the stream; they are not a computation to check).
    -> (tokens [B], logprob [B], top logprobs [B, N], top ids [B, N], filtered distributions [B, V])."""
    logits = np.asarray(logits, np.float64)
    B, V = logits.shape
    u = np.asarray(uniforms(jnp.asarray(seeds), jnp.asarray(steps)), np.float64)
    tokens, chosen, tops, top_ids, dists = [], [], [], [], []
    for b in range(B):
        x = reference_processed(logits[b], params[b], mask[b], bias_ids[b], bias[b], history[b], int(seq_lens[b]),
                                int(steps[b]))
        dist = filtered_probs(x, params[b])
        if params[b][_COL["temperature"]] > 0:
            cdf = np.cumsum(dist)
            tok = int(np.searchsorted(cdf, u[b] * cdf[-1]))
        else:
            tok = int(np.argmax(x))
        lsm = logits[b] - (np.max(logits[b]) + np.log(np.sum(np.exp(logits[b] - np.max(logits[b])))))
        order = np.argsort(-lsm, kind="stable")[:top_n]
        tokens.append(tok)
        chosen.append(lsm[tok])
        tops.append(lsm[order])
        top_ids.append(order)
        dists.append(dist)
    return (np.array(tokens, np.int32), np.array(chosen), np.array(tops).reshape(B, top_n),
            np.array(top_ids, np.int32).reshape(B, top_n), np.array(dists))
