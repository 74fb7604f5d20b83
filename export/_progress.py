"""The export's progress: a bar on a terminal (or in a notebook), plain lines now and then in a log.

A tqdm bar redraws itself with carriage returns; written to a file or a pipe that is one line growing by a
redraw per item, tens of kilobytes long. Off a terminal the export prints a line every `interval` seconds instead.
"""

from __future__ import annotations

import sys
import time


class LineProgress:
    """tqdm's update / set_postfix_str / close, printed as a plain line at most every `interval` seconds (and at
    the end)."""

    def __init__(self, total: int, desc: str, stream=None, interval: float = 10.0):
        self.total, self.desc, self.interval = total, desc, interval
        self.stream = stream if stream is not None else sys.stderr
        self.n, self.postfix, self.start = 0, "", time.monotonic()
        self.last = self.start

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._line(now)

    def _line(self, now: float, closing: bool = False) -> None:
        what = "" if closing or not self.postfix else f" ({self.postfix})"
        print(f"{self.desc}: {self.n}/{self.total}{what}, {now - self.start:.0f} s", file=self.stream, flush=True)

    def close(self) -> None:
        self._line(time.monotonic(), closing=True)


def progress_bar(total: int, desc: str, enabled: bool, stream=None):
    """A tqdm bar where a person watches (stderr a terminal, or a notebook), else LineProgress; a silent bar when
    not enabled."""
    stream = stream if stream is not None else sys.stderr
    if not enabled:
        from tqdm import tqdm
        return tqdm(total=total, disable=True)
    if "ipykernel" in sys.modules or (hasattr(stream, "isatty") and stream.isatty()):
        # Imported only when shown: tqdm.auto warns in a notebook without ipywidgets even when disabled.
        from tqdm.auto import tqdm
        return tqdm(total=total, desc=desc, unit="item", file=stream)
    return LineProgress(total, desc, stream)
