"""Waiting for a server started as a subprocess (the Triton, vLLM and benchmark servers)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], log: Path, what: str, timeout: float = 300,
               errors: tuple[type[BaseException], ...] = (OSError,)) -> None:
    """Poll `ready()` (an exception of `errors` counts as not yet) until it answers True; RuntimeError with the
    log's tail if the process exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-5000:]}")
        try:
            if ready():
                return
        except errors:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start in {timeout:.0f} s:\n{log.read_text()[-5000:]}")
        time.sleep(0.5)
