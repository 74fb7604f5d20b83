"""Where a request's tokens are chosen under vLLM, and the logprobs vLLM reports.

The artifact's in-body sampler chooses a request's tokens whenever its parameters cover the request: temperature,
top-k, top-p, min-p, the presence / frequency / repetition penalties, a logit bias of at most the sampler's slots,
the seed, and a mask of allowed tokens, which carries vLLM's structured-output bitmask, `allowed_token_ids` and
`min_tokens` (the stop ids masked until then). Only the chosen token leaves the device. An artifact without a sampler
serves plain greedy requests from its in-body argmax the same way.

Anything else returns the row's logits to vLLM's own `Sampler` (`HostSampler`), with vLLM's logits processors
(min-p, logit bias, min-tokens, and any custom ones): `bad_words`, a logit bias larger than the sampler takes,
parameters outside the sampler's ranges, and every non-greedy request on an artifact without a sampler. vLLM's
sampler draws from a per-request torch generator, so such a request's seeded draws are vLLM's, not the body's.

Logprobs (`SamplingParams.logprobs`) are vLLM's default `raw_logprobs`: log_softmax of the row's unprocessed logits,
pulled from the device for the requests that ask, with the chosen token's rank counted as vLLM counts it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import LogprobsLists
from vllm.v1.sample.logits_processor import BatchUpdate, build_logitsprocs
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from ...host_sampling import Sampling, pack_mask

GREEDY_EPS = 1e-5          # vLLM's: a temperature below it is greedy


def body_sampling(sp: SamplingParams, sampler) -> Sampling | None:
    """The in-body Sampling of a request, or None when the artifact's sampler (None: the artifact has none, so
    only its argmax) does not cover it."""
    bias = tuple(sorted((int(t), float(v)) for t, v in (sp.logit_bias or {}).items()))
    try:
        s = Sampling(temperature=0.0 if sp.temperature < GREEDY_EPS else float(sp.temperature),
                     top_k=max(int(sp.top_k), 0), top_p=float(sp.top_p), min_p=float(sp.min_p),
                     presence_penalty=float(sp.presence_penalty), frequency_penalty=float(sp.frequency_penalty),
                     repetition_penalty=float(sp.repetition_penalty), logit_bias=bias)
    except ValueError:
        return None                  # a value vLLM allows and the body's sampler does not: vLLM samples
    if sp.bad_words_token_ids or getattr(sp, "extra_args", None):
        return None
    if sampler is None:
        return s if s.plain else None
    return s if len(bias) <= sampler.logit_bias else None


def request_seed(sp: SamplingParams) -> int:
    """The body's 64-bit seed of a request: its own, else a random one."""
    return int(sp.seed) % 2**64 if sp.seed is not None else int.from_bytes(os.urandom(8), "little")


def allowed_words(sp: SamplingParams, num_output: int, vocab: int, words: int,
                  grammar: np.ndarray | None) -> np.ndarray | None:
    """The packed mask of the tokens a request may choose now ([words] int32), or None for every token: vLLM's
    grammar bitmask row, its allowed_token_ids, and its stop ids before min_tokens."""
    mask = None
    if grammar is not None:
        mask = np.zeros(words, np.int32)
        n = min(words, len(grammar))
        mask[:n] = grammar[:n]
    if sp.allowed_token_ids:
        allowed = np.zeros(vocab, bool)
        allowed[[t for t in sp.allowed_token_ids if 0 <= t < vocab]] = True
        mask = pack_mask(allowed) if mask is None else mask & pack_mask(allowed)
    if num_output < sp.min_tokens and sp.all_stop_token_ids:
        mask = np.full(words, -1, np.int32) if mask is None else mask
        bits = mask.view(np.uint32)
        for t in sp.all_stop_token_ids:
            if 0 <= t < vocab:
                bits[t // 32] &= ~np.uint32(1 << (t % 32))
    return mask


def logprobs_lists(logits: dict[int, np.ndarray], tokens: dict[int, int], width: int, rows: int) -> LogprobsLists:
    """vLLM's LogprobsLists for `rows` requests: row i (those in `logits`) holds its chosen token and the
    `width` largest raw logprobs; the chosen token's rank is the count of logprobs at least its own."""
    ids = np.zeros((rows, width + 1), np.int32)
    vals = np.zeros((rows, width + 1), np.float32)
    ranks = np.zeros(rows, np.int32)
    for i, x in logits.items():
        x = np.asarray(x, np.float64)
        top = x.max()
        lp = x - (top + np.log(np.exp(x - top).sum()))
        tok = tokens[i]
        order = np.argsort(-lp, kind="stable")[:width]
        ids[i] = [tok, *order]
        vals[i] = [lp[tok], *lp[order]]
        ranks[i] = int(np.sum(lp >= lp[tok]))
    return LogprobsLists(ids, vals, ranks)


@dataclass
class HostRow:
    """One request's row for vLLM's sampler: its params, prompt, output so far, torch generator (a seeded request
    keeps one for its life, as vLLM's runner does), and its mask of allowed tokens (packed words) or None."""

    params: SamplingParams
    prompt: list[int]
    output: list[int]
    generator: torch.Generator | None
    mask: np.ndarray | None


class HostSampler:
    """vLLM's Sampler over pulled logits, with vLLM's logits processors (built-in and `--logits-processors`)."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.sampler = Sampler(logprobs_mode="raw_logprobs")
        self.custom = vllm_config.model_config.logits_processors or ()

    def sample(self, logits: np.ndarray, rows: list[HostRow]) -> list[int]:
        """logits [n, V] for the n rows -> each row's token."""
        n, vocab = logits.shape
        x = torch.from_numpy(np.asarray(logits, np.float32)).clone()
        procs = build_logitsprocs(self.vllm_config, torch.device("cpu"), False, False, self.custom)
        update = BatchUpdate(batch_size=n, removed=[], moved=[],
                             added=[(i, r.params, r.prompt, r.output) for i, r in enumerate(rows)])
        for p in procs.all:
            p.update_state(update)
        temp = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
        greedy = temp < GREEDY_EPS
        top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        masked = None
        if any(r.mask is not None for r in rows):
            masked = torch.zeros((n, vocab), dtype=torch.bool)
            for i, r in enumerate(rows):
                if r.mask is not None:
                    bits = (r.mask.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
                    masked[i] = torch.from_numpy(bits.astype(bool).ravel()[:vocab] == 0)
        no_penalties = all(r.params.presence_penalty == 0 and r.params.frequency_penalty == 0
                           and r.params.repetition_penalty == 1 for r in rows)
        prompt_ids = None
        if not no_penalties:
            longest = max(len(r.prompt) for r in rows)
            prompt_ids = torch.full((n, longest), vocab, dtype=torch.int64)
            for i, r in enumerate(rows):
                prompt_ids[i, :len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.int64)
        md = SamplingMetadata(
            temperature=torch.where(greedy, torch.zeros_like(temp), temp), all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            top_p=None if all(p >= 1.0 for p in top_p) else torch.tensor(top_p, dtype=torch.float32),
            top_k=None if all(k >= vocab for k in top_k) else torch.tensor(top_k, dtype=torch.int32),
            generators={i: r.generator for i, r in enumerate(rows) if r.generator is not None},
            max_num_logprobs=None, no_penalties=no_penalties, prompt_token_ids=prompt_ids,
            frequency_penalties=torch.tensor([r.params.frequency_penalty for r in rows], dtype=torch.float32),
            presence_penalties=torch.tensor([r.params.presence_penalty for r in rows], dtype=torch.float32),
            repetition_penalties=torch.tensor([r.params.repetition_penalty for r in rows], dtype=torch.float32),
            output_token_ids=[r.output for r in rows], allowed_token_ids_mask=masked,
            bad_words_token_ids={i: r.params.bad_words_token_ids for i, r in enumerate(rows)
                                 if r.params.bad_words_token_ids},
            logitsprocs=procs)
        if md.all_greedy:
            md.temperature = None
        out = self.sampler(x, md)
        return out.sampled_token_ids[:, 0].tolist()
