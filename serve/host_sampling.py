"""A request's sampling parameters, what the engine feeds an in-body sampler (tlaloc_jax/kernels/in_body_sampler.py: the
artifact's SAMPLING row, its seed words, token mask and logit bias), and the host-side sampler that serves artifacts
without one (numpy only).

The host path applies the same steps in the same order as the body's sampler (logit bias, the repetition
penalty over the sequence's tokens, presence and frequency penalties over its output tokens, the token mask,
temperature, min-p, top-k, top-p) and draws with the request's numpy Generator; it reports the same
logprobs (log_softmax of the unprocessed logits). Its random stream is numpy's, not the body's threefry.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from tlaloc_jax.artifact import mask_words

SEED_LIMIT = 2**64      # seeds are 0 <= seed < 2**64: one 64-bit word (numpy's SeedSequence; the body's two words)
MAX_TOP_LOGPROBS = 20   # OpenAI's limit on top_logprobs


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy. Any finite temperature > 0 is served, however small: logits are shifted by
    their maximum before the division, so a tiny temperature puts all the mass on the largest logit instead
    of overflowing.

    top_k 0, top_p 1.0 and min_p 0 keep every token. presence_penalty and frequency_penalty (OpenAI's, over
    the tokens generated so far) and repetition_penalty (vLLM's, > 0, over the prompt and the output; 1 is
    off). logit_bias: (token id, value) pairs added to the logits. min_tokens: the stop tokens are masked
    until this many tokens were generated. logprobs: None for none, else how many top logprobs to report
    beside the chosen token's (0 to 20). prompt_logprobs: the same for each prompt token. A seed
    (0 <= seed < 2**64) makes a request's draws reproducible.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first field out of range (the engine checks again at admission)."""
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_integer(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0 \
                or not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and _is_integer(p[0]) and _is_real(p[1])
                and math.isfinite(p[1]) for p in self.logit_bias):
            raise ValueError(f"logit_bias must be a tuple of (token id, finite value) pairs, got {self.logit_bias!r}")
        if not _is_integer(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_integer(v) or not 0 <= v <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def plain(self) -> bool:
        """Greedy with nothing that changes the logits: the body's NEXT_TOKEN is its token."""
        return self.greedy and not self.penalized and not self.logit_bias

    def row(self, columns: tuple[str, ...]) -> list[float]:
        """The SAMPLING row of the artifact's sampler, in its column order: each column is the field of its name,
        but top_logprobs, which is 1 when the request wants logprobs."""
        return [float(bool(self.logprobs)) if c == "top_logprobs" else float(getattr(self, c)) for c in columns]


GREEDY = Sampling()


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed as the body's RNG_SEED words (low, high), each as a signed int32."""
    lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return tuple(int(np.array(w, np.uint32).view(np.int32)) for w in (lo, hi))


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """allowed [V] bool -> the packed TOKEN_MASK row [ceil(V / 32)] int32 (bit t % 32 of word t // 32)."""
    bits = np.zeros(mask_words(len(allowed)) * 32, np.uint8)
    bits[:len(allowed)] = allowed
    return np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).view(np.int32).ravel()


def unpack_mask(words: np.ndarray, vocab: int) -> np.ndarray:
    """A packed TOKEN_MASK row -> allowed [V] bool."""
    w = np.asarray(words, np.int32).view(np.uint32)
    return ((w[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(bool).ravel()[:vocab]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    top = x.max()
    return x - (top + np.log(np.sum(np.exp(x - top))))


def top_logprobs(lsm: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n largest (id, logprob) of a log_softmax row, largest first (ties: the smaller id first)."""
    if n <= 0:
        return []
    order = np.argsort(-lsm, kind="stable")[:n]
    return [(int(t), float(lsm[t])) for t in order]


def processed(logits: np.ndarray, s: Sampling, history: list[int], generated: int,
              allowed: np.ndarray | None) -> np.ndarray:
    """The logits after bias, penalties and the mask (-inf outside it), float64."""
    x = np.asarray(logits, np.float64).copy()
    for t, b in s.logit_bias:
        if 0 <= t < len(x):
            x[t] += b
    if s.penalized:
        seen = np.unique(np.asarray(history, np.int64))
        r = s.repetition_penalty
        x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
        out = np.asarray(history[len(history) - generated:] if generated else [], np.int64)
        counts = np.bincount(out, minlength=len(x))[:len(x)].astype(np.float64)
        x -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0)
    if allowed is not None:
        x = np.where(allowed, x, -np.inf)
    return x


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator, *, history: list[int] = (),
           generated: int = 0, allowed: np.ndarray | None = None) -> int:
    """logits: [V] -> one token id drawn as `s` says. ValueError when the logits hold NaN or +inf, or the mask
    leaves no token."""
    if s.plain and allowed is None:
        return int(np.argmax(logits))
    x = processed(logits, s, list(history), generated, allowed)
    top = x.max()
    if not np.isfinite(top):
        raise ValueError(f"cannot sample from logits whose largest value is {top}")
    if s.greedy:
        return int(np.argmax(x))
    # Shifted first, every value is <= 0 before the division: exp cannot overflow whatever the temperature.
    # A tiny temperature sends the others to -inf (probability 0), which is the intended limit.
    with np.errstate(over="ignore"):
        x = (x - top) / s.temperature
    order = np.argsort(-x, kind="stable")
    order = order[np.isfinite(x[order])]
    if s.min_p > 0:
        order = order[x[order] >= math.log(s.min_p)]
    if s.top_k:
        order = order[:s.top_k]
    p = np.exp(x[order])
    p /= p.sum()
    if s.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        keep = int(np.searchsorted(np.cumsum(p), s.top_p) + 1)
        p = p[:keep] / p[:keep].sum()
        order = order[:keep]
    return int(order[rng.choice(len(p), p=p)])
