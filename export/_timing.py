"""Where an export's time goes: seconds summed per phase (the weights' read, quantize and write, the entries'
tracing and lowering), which `python -m tlaloc_jax.export` prints at the end."""

from __future__ import annotations

import collections
import contextlib
import time

PHASES = ("entries", "read", "convert", "quantize", "write")
SECONDS: collections.Counter = collections.Counter()


@contextlib.contextmanager
def timed(phase: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        SECONDS[phase] += time.perf_counter() - t0


def summary() -> str:
    """"entries 12.3 s, read 4.5 s, ..." over the phases timed since the last reset()."""
    return ", ".join(f"{p} {SECONDS[p]:.1f} s" for p in PHASES if p in SECONDS)


def reset() -> None:
    SECONDS.clear()
