"""A request as the engine holds it, what a step reports of it, and the checks a request passes before admission."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from tlaloc_jax import artifact as af

from ..host_sampling import GREEDY, Sampling
from ..speculative import SpecState


class RequestRefused(ValueError):
    """A request the engine will not run; nothing of any sequence changed.

    kind: "empty_prompt", "placeholder_token", "out_of_vocabulary", "too_long", "bad_request",
    "exceeds_pool" (more pages than the whole pool: never admitted), "exceeds_queue" (more sequences than may wait:
    never admitted), or "queue_full" (the HTTP loop's waiting queue is full: retry once fewer wait). A request that
    fits the pool but finds it full waits, unrefused.
    """

    def __init__(self, kind: str, message: str, pool: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.pool = pool            # exceeds_pool: the kind of pool (af.PoolKind) the sequences would not fit


@dataclass(frozen=True)
class StepEvent:
    """A token produced for a request in one step (token None: the request failed).

    logprob and top_logprobs (when the request asked for logprobs): the token's logprob under the model
    (log_softmax of the logits) and the `logprobs` largest as (id, logprob) pairs. prompt_logprobs (with a
    request's first token, when it asked for them): per prompt token, None for the first, else
    (its logprob, its rank, the top pairs)."""

    request_id: str
    token: int | None
    finished: bool
    finish_reason: str | None = None   # "stop" | "length" | "error" | "aborted"
    error: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    prompt_logprobs: tuple | None = None
    request_error: bool = False         # the failure is the request's own (its grammar, its min_tokens)


class Constraint:
    """What a structured-output request asks of each token (serve/openai/structured.py implements it with a grammar).

    fill(words): clear, in `words` (the packed mask: [ceil(V / 32)] int32, bit t % 32 of word t // 32, all ones
    on entry), the tokens the constraint forbids now. accept(token): advance past the chosen token; False if
    the constraint refuses it. ready(): whether fill can answer now (a constraint that works out its next mask
    on another thread is not ready until it has: its sequence sits out the steps until then). failure(): why
    the constraint cannot go on (its sequence ends with that error), or None.

    Speculative decoding (serve/speculative.py), asked only when ready: drafts_allowed(tokens): how many of the
    drafted tokens, in order, it allows from where it is (0: it does not look ahead, and its sequence does not
    draft); draft_masks(tokens, words [n + 1, W]): clear in row j what it forbids after tokens[:j], j >= 1 (row 0
    is fill's; tokens: ones it allows), leaving it where it was; accept_tokens(tokens): accept, several at once
    (a verify call's emitted tokens)."""

    def fill(self, words: np.ndarray) -> None:
        raise NotImplementedError

    def accept(self, token: int) -> bool:
        raise NotImplementedError

    def ready(self) -> bool:
        return True

    def failure(self) -> str | None:
        return None

    def drafts_allowed(self, tokens: Sequence[int]) -> int:
        return 0

    def draft_masks(self, tokens: Sequence[int], words: np.ndarray) -> None:
        raise NotImplementedError

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        return all(self.accept(t) for t in tokens)


@dataclass
class Request:
    """One sequence: its prompt and what it generated, its sampling, and what it holds of each kind of pool.

    Positions below `computed` are written in the pools. A call that writes positions [start, end) produces the
    next token when end is the length of prompt + generated; a preempted sequence computes them all again."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    stop: frozenset[int]
    sampling: Sampling
    rng: np.random.Generator
    held: dict[af.PoolKind, list[int]]   # pages (or state slots) the sequence holds, per kind of pool
    arrival: float
    order: int = 0                       # arrival order: ties between equal priorities go to the earlier
    priority: int = 0                    # lower runs first (vLLM's priority scheduling)
    seed: int = 0                        # the body's 64-bit seed (the request's, else a random one)
    cache_salt: str | None = None        # shares cached pages only with requests of the same salt
    constraint: Constraint | None = None
    single_step: bool = False            # the caller checks each token (stop strings): no decode_steps calls
    prompt_logprobs: list | None = None  # filled while the prompt is read, when the request asked
    computed: int = 0
    running: bool = False
    hashes: list[bytes] = field(default_factory=list)   # block hashes of its full pages (kv_cache.extend_hashes)
    cached_pages: int = 0                # leading held pages registered in the prefix cache
    junction: int = 0                    # a position its first chunk stops at, to leave a state snapshot there
    preemptions: int = 0
    first_scheduled: float | None = None     # when the first call that reads this sequence started
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    stop_mask: np.ndarray | None = None      # packed: every token but the stop ids (min_tokens), made once
    lora: Any = None                     # the LoRA adapter it runs with (serve.lora_slots.Adapter); None: the base model
    lora_slot: int = 0                   # the adapter's slot while it runs (0: none)
    spec: SpecState = field(default_factory=SpecState)     # its drafts so far (speculative decoding)

    def stop_ids(self, vocab: int) -> list[int]:
        """The stop ids a token can be (those inside the vocabulary), sorted."""
        return sorted(t for t in self.stop if 0 <= t < vocab)

    @property
    def prefix_salt(self) -> str | None:
        """What its prefix-cache hashes start from: its cache_salt, and its adapter's load (an adapter's keys and
        values are its own)."""
        return self.cache_salt if self.lora is None else f"{self.cache_salt or ''}\x00lora\x00{self.lora.key}"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def reading_prompt(self) -> bool:
        """Still computing its prompt for the first time (no token generated yet)."""
        return not self.generated and not self.finished

    @property
    def decoding(self) -> bool:
        """Its next call writes its last token and produces the next one."""
        return self.running and not self.finished and self.generated and self.computed == self.length - 1

    @property
    def key(self) -> tuple[int, int]:
        """Scheduling order: priority, then arrival."""
        return self.priority, self.order


def check_stop(stop_token_ids: Iterable[int]) -> frozenset[int]:
    try:
        items = list(stop_token_ids)
    except TypeError:
        raise RequestRefused("bad_request", f"stop_token_ids must be an iterable of token ids, got "
                                            f"{type(stop_token_ids).__name__}") from None
    for t in items:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise RequestRefused("bad_request", f"stop_token_ids must be integer token ids, got {t!r}")
    return frozenset(int(t) for t in items)


def check_cache_salt(salt) -> str | None:
    """A request's cache_salt: None, or a non-empty string (vLLM's rule)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestRefused("bad_request", f"cache_salt must be a non-empty string, got {salt!r}; leave it out "
                                            "(None) to share cached prefixes with every request without one")
    return salt


def check_sampling(sampling: Sampling | None) -> Sampling:
    """The request's sampling, checked again here: a frozen dataclass can still be changed after it was built."""
    if sampling is None:
        return GREEDY
    if not isinstance(sampling, Sampling):
        raise RequestRefused("bad_request", f"sampling must be a Sampling, got {type(sampling).__name__}")
    try:
        sampling.validate()
    except ValueError as e:
        raise RequestRefused("bad_request", f"bad sampling parameters: {e}") from None
    return sampling


def check_sampler_fits(sampler: af.Sampler | None, s: Sampling, vocab: int) -> None:
    """What the artifact's sampler cannot carry is refused by name (the host fallback carries anything)."""
    if sampler is None:
        return
    if len(s.logit_bias) > sampler.logit_bias:
        raise RequestRefused("bad_request", f"logit_bias has {len(s.logit_bias)} entries; this artifact's sampler "
                                            f"takes at most {sampler.logit_bias}")
    if s.logprobs is not None and s.logprobs > sampler.top_logprobs:
        raise RequestRefused("bad_request", f"{s.logprobs} top logprobs asked; this artifact's sampler returns at "
                                            f"most {sampler.top_logprobs}")
    for t, _ in s.logit_bias:
        if not 0 <= t < vocab:
            raise RequestRefused("out_of_vocabulary", f"logit_bias token id {t} is outside the vocabulary (size "
                                                      f"{vocab})")
