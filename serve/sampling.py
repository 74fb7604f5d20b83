"""Host-side sampling over a row of logits: greedy, temperature, top-k, top-p (numpy only)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

SEED_LIMIT = 2**64      # seeds are 0 <= seed < 2**64: one 64-bit word of numpy's SeedSequence


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (the entry's NEXT_TOKEN output; no logits are pulled to the host). Any finite
    temperature > 0 is served, however small: logits are shifted by their maximum before the division, so
    a tiny temperature puts all the mass on the largest logit instead of overflowing.

    top_k 0 and top_p 1.0 keep every token. A seed (0 <= seed < 2**64) makes a request's draws reproducible.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """logits: [V] -> one token id drawn as `s` says. ValueError when the logits hold NaN or +inf."""
    if s.greedy:
        return int(np.argmax(logits))
    x = logits.astype(np.float64)
    top = x.max()
    if not np.isfinite(top):
        raise ValueError(f"cannot sample from logits whose largest value is {top}")
    # Shifted first, every value is <= 0 before the division: exp cannot overflow whatever the temperature.
    # A tiny temperature sends the others to -inf (probability 0), which is the intended limit.
    with np.errstate(over="ignore"):
        x = (x - top) / s.temperature
    order = np.argsort(-x, kind="stable")
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
