"""Host-side sampling over a row of logits: greedy, temperature, top-k, top-p (numpy only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (the entry's NEXT_TOKEN output; no logits are pulled to the host).

    top_k 0 and top_p 1.0 keep every token. A seed makes a request's draws reproducible.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """logits: [V] -> one token id drawn as `s` says."""
    if s.greedy:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / s.temperature
    order = np.argsort(-x, kind="stable")
    if s.top_k:
        order = order[:s.top_k]
    x = x[order]
    p = np.exp(x - x.max())
    p /= p.sum()
    if s.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        keep = int(np.searchsorted(np.cumsum(p), s.top_p) + 1)
        p = p[:keep] / p[:keep].sum()
        order = order[:keep]
    return int(order[rng.choice(len(p), p=p)])
