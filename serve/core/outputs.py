"""From a call's outputs to each row's token: the token mask a row may choose from, the outputs to pull, the
token (the body's sampler's choice, or one sampled here from pulled logits), its logprobs and prompt scores."""

from __future__ import annotations

import numpy as np

from tlaloc_jax import artifact as af

from ..host_sampling import log_softmax, sample, top_logprobs, unpack_mask
from .request import Request
from .scheduler import ScheduledCall


def allowed_mask(s: Request, vocab: int) -> np.ndarray | None:
    """The packed mask of the tokens the sequence may choose now ([ceil(V / 32)] int32: its constraint, and no stop
    token before min_tokens), or None when it may choose any."""
    words = None
    if s.constraint is not None:
        words = np.full(af.mask_words(vocab), -1, np.int32)
        s.constraint.fill(words)
    stops = _stop_mask(s, vocab)
    if stops is not None:
        words = stops.copy() if words is None else words & stops
    return words


def draft_masks(s: Request, drafts, vocab: int) -> np.ndarray | None:
    """A verify row's mask at each of its positions ([len(drafts) + 1, W]: row j after the drafts before it, from its
    constraint; no stop token before min_tokens, which the drafts stop short of), or None when it may choose any."""
    if s.constraint is None or not drafts:
        return allowed_mask(s, vocab)
    rows = np.full((len(drafts) + 1, af.mask_words(vocab)), -1, np.int32)
    s.constraint.fill(rows[0])
    stops = _stop_mask(s, vocab)
    if stops is not None:
        rows &= stops
    s.constraint.draft_masks(drafts, rows)
    return rows


def _stop_mask(s: Request, vocab: int) -> np.ndarray | None:
    """Every token but the sequence's stop ids while it is short of min_tokens, else None."""
    if len(s.generated) >= s.sampling.min_tokens or not s.stop:
        return None
    if s.stop_mask is None:     # made once per sequence: a request may carry many stop ids
        bits = np.zeros(af.mask_words(vocab) * 32, bool)      # no bit past the vocabulary
        bits[:vocab] = True
        bits[np.array(s.stop_ids(vocab), np.int64)] = False
        s.stop_mask = np.packbits(bits, bitorder="little").view(np.int32)
    return s.stop_mask


def wanted(call: ScheduledCall, producing: list[bool], allowed: list, sampler: af.Sampler | None) -> set[af.Role]:
    """The outputs to pull to the host for this call."""
    want = set()
    if call.entry.kind == af.EntryKind.PREFILL_SCORED:
        want |= set(af.SCORER_OUTPUTS) if any(s.sampling.prompt_logprobs for s in call.seqs) else \
            {af.Role.PROMPT_LOGPROB, af.Role.PROMPT_RANK}
    elif any(s.prompt_logprobs is not None and not s.generated for s in call.seqs):
        want.add(af.Role.LOGITS)
    if sampler is not None:
        want.add(af.Role.SAMPLED_TOKEN)
        if any(s.sampling.logprobs is not None for s in call.seqs):
            want.add(af.Role.TOKEN_LOGPROB)
        if any(s.sampling.logprobs for s in call.seqs):
            want |= {af.Role.TOP_LOGPROBS, af.Role.TOP_IDS}
        return want
    want.add(af.Role.NEXT_TOKEN)
    if any(p and (not s.sampling.plain or s.sampling.logprobs is not None or a is not None)
           for s, p, a in zip(call.seqs, producing, allowed)):
        want.add(af.Role.LOGITS)
    return want


def row_token(out: dict, b: int, s: Request, allowed: np.ndarray | None, lsm: np.ndarray | None,
              sampler: af.Sampler | None, vocab: int):
    """Row b's token, its logprob and top logprobs (None unless asked), from the body's sampler or, without one,
    sampled here from the pulled logits."""
    n = s.sampling.logprobs
    if sampler is not None:
        tok = int(out[af.Role.SAMPLED_TOKEN][b])
        if allowed is not None and not (int(allowed.view(np.uint32)[tok // 32]) >> (tok % 32)) & 1:
            raise ValueError(f"the sampler chose token {tok}, which the mask forbids (no allowed token left?)")
        if n is None:
            return tok, None, None
        top = tuple(zip(out[af.Role.TOP_IDS][b][:n].tolist(), out[af.Role.TOP_LOGPROBS][b][:n].tolist())) \
            if n else ()
        return tok, float(out[af.Role.TOKEN_LOGPROB][b]), top
    if af.Role.LOGITS not in out:
        return int(out[af.Role.NEXT_TOKEN][b]), None, None
    logits = out[af.Role.LOGITS][b]
    if s.sampling.plain and allowed is None:
        tok = int(out[af.Role.NEXT_TOKEN][b])
    else:
        extra = {}
        if s.sampling.penalized:
            extra.update(history=s.prompt + s.generated, generated=len(s.generated))
        if allowed is not None:
            extra["allowed"] = unpack_mask(allowed, vocab)
        tok = sample(logits, s.sampling, s.rng, **extra)
    if n is None:
        return tok, None, None
    lsm = log_softmax(logits) if lsm is None else lsm
    return tok, float(lsm[tok]), tuple(top_logprobs(lsm, n))


def prompt_scores(out: dict, b: int, s: Request, start: int, n: int, tokens: int) -> list[tuple]:
    """Row b's prompt logprob entries from a scoring prefill's outputs (the row read n prompt tokens from `start`):
    per position whose next token is a prompt token, (that token's logprob, its rank, the top (id, logprob) pairs
    the request asked for)."""
    scored = min(n, len(s.prompt) - 1 - start)
    k = s.sampling.prompt_logprobs
    cols = range(tokens - n, tokens - n + scored)
    lp, rank = out[af.Role.PROMPT_LOGPROB][b], out[af.Role.PROMPT_RANK][b]
    if not k:
        return [(float(lp[c]), int(rank[c]), ()) for c in cols]
    ids, vals = out[af.Role.PROMPT_TOP_IDS][b], out[af.Role.PROMPT_TOP_LOGPROBS][b]
    return [(float(lp[c]), int(rank[c]), tuple(zip(ids[c, :k].tolist(), vals[c, :k].tolist()))) for c in cols]


def next_prompt_score(lsm: np.ndarray, s: Request, end: int) -> tuple | None:
    """From the distribution after prompt position end - 1 (pulled logits), the entry scoring prompt token `end`
    (its logprob, its rank, the top pairs asked), or None past the prompt."""
    if end >= len(s.prompt):
        return None
    t = s.prompt[end]
    return float(lsm[t]), int(np.sum(lsm > lsm[t])) + 1, tuple(top_logprobs(lsm, s.sampling.prompt_logprobs))
