"""Pearson's chi-square test for the sampling tests (numpy only: scipy is not a dependency)."""

from __future__ import annotations

import math

import numpy as np


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(upper-tail p-value, statistic) of Pearson's statistic, by the Wilson-Hilferty normal approximation
    (df >= 3)."""
    stat = float(np.sum((counts - expected) ** 2 / expected))
    k = len(counts) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2)), stat
