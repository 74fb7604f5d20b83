"""Ready means ready: a server that compiles every entry before it serves, and says how far it got.

The engine loop (loop.py) compiles the entries that are not in the compile cache one at a time before its first
step. Each entry then runs once while the server is idle (its one-time first-run costs, 50-200 ms), a cached one loaded
from the cache first (0.1-0.2 s): a warm start serves at once, compiling nothing. Until they are compiled /health
answers 503 with `reason()` ("compiling entries: 12/32") and generation requests 503 with Retry-After
(`retry_after()`, the time the entries left should take at the pace so far), as a vLLM server takes no traffic
before it is up. Progress goes to a bar on a terminal, else to a plain log line every LOG_EVERY_S seconds (a bar's
carriage returns make one long line in a log file); once ready, one line gives the start-up's phases.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import os
import time
from pathlib import Path

log = logging.getLogger("tlaloc_jax.serve")

LOG_EVERY_S = 10.0
# A preloading server also waits for its other entries' loads and the weights' move to huge pages (Runner.background)
# while its process is younger than this: a small artifact then serves its first requests with every entry loaded,
# and a large one is ready once the entries that hold every call are (Runner.loading).
READY_WITHIN_S = 4.5
MAX_RETRY_AFTER_S = 60      # the openai client honours a Retry-After of at most 60 s


def process_seconds() -> float | None:
    """Seconds since this process started (Linux /proc: Python's own start-up included), or None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Readiness:
    """How many of `total` entries are compiled (or loaded: `doing`'s words). `progress`: "bar" (tqdm, for a
    terminal), "log" (periodic lines) or None (the final line only). `phases`: the start-up's seconds before the loop began, by
    phase (the server's main fills it), for the start-up line."""

    def __init__(self, total: int, progress: str | None = "log", doing: tuple[str, str] = ("compiling", "compiled")):
        self.total = total
        self.doing, self.done_as = doing     # the words of the reason and of the ready line
        self.done = 0
        self.progress = progress
        self.phases: dict[str, float] = {}
        self._t0 = self._told = time.perf_counter()
        self._bar = None

    @property
    def ready(self) -> bool:
        return self.done >= self.total

    def reason(self) -> str | None:
        """Why the server does not serve yet, or None once it is ready."""
        return None if self.ready else f"{self.doing} entries: {self.done}/{self.total}"

    def retry_after(self) -> int:
        """Whole seconds until the entries left should be ready (at least 1, at most MAX_RETRY_AFTER_S)."""
        if self.done == 0:
            return 1
        per_entry = (time.perf_counter() - self._t0) / self.done
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(per_entry * (self.total - self.done))))

    def start(self) -> None:
        self._t0 = self._told = time.perf_counter()
        if self.ready:
            return
        log.info("%s %d entries before serving (/health answers 503 until then; --lazy-compile "
                 "serves at once and compiles on first use)", self.doing, self.total)
        if self.progress == "bar":
            from tqdm.auto import tqdm
            self._bar = tqdm(total=self.total, desc="ready", unit="entry")

    def advance(self, name: str) -> None:
        """Entry `name` is ready."""
        self.done += 1
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.set_postfix_str(name)
            self._bar.update(1)
        elif self.progress == "log" and now - self._told >= LOG_EVERY_S and not self.ready:
            self._told = now
            log.info("%s (%.0f s)", self.reason(), now - self._t0)

    def finish(self) -> None:
        """The readying ended: ready, or stopped part way (the server is shutting down)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self.ready:
            return
        took = time.perf_counter() - self._t0
        if self.total:
            log.info("ready: %d entries %s in %.1f s", self.total, self.done_as, took)
        age = process_seconds()
        log.info("start-up: %s; ready %s after the process started", ", ".join(
            [f"{k} {v:.1f} s" for k, v in self.phases.items()] + [f"{self.doing} {self.total} entries {took:.1f} s"]),
            "?" if age is None else f"{age:.1f} s")


def get_ready(readiness: Readiness, engine, handle_pending) -> bool:
    """Make `engine` ready: wait for the entries a preloading Runner loads first (Runner.loading: those that hold every
    call, and those in neither compile cache), compile those in neither cache (a Runner that does not preload), then
    wait for the rest of its loads while the process is younger than READY_WITHIN_S. handle_pending() answers the
    commands that came meanwhile (-> False: stop). -> False on a stop."""
    readiness.start()
    started = time.perf_counter() - (process_seconds() or 0.0)
    try:
        runner = engine.runner
        for e, loading in [*runner.loading(), *((e, None) for e in engine.entries_to_compile())]:
            if not handle_pending():
                return False
            while loading is not None and not cf.wait([loading], 0.1).done:
                if not handle_pending():
                    return False
            try:
                runner.executable(e)    # loaded in the background (a failed load compiles here), else compiled
            except Exception as err:  # noqa: BLE001 - the entry's first request fails the same way, by name
                log.error("compiling %s failed: %s", e.name, err)
            readiness.advance(e.name)
        rest = dict(runner.background())
        while rest and (left := started + READY_WITHIN_S - time.perf_counter()) > 0:
            if not handle_pending():
                return False
            cf.wait(list(rest.values()), min(0.1, left), return_when=cf.FIRST_COMPLETED)
            for name in [name for name, f in rest.items() if f.done()]:
                del rest[name]
                if name is not None:
                    readiness.advance(name)
        if behind := runner.still_loading():
            readiness.total = readiness.done        # the ready line counts those loaded
            log.info("%d more entries load in the background; a call meanwhile takes a loaded one", behind)
        readiness.done = readiness.total     # entries compiled before the loop started count as ready
        return True
    finally:
        readiness.finish()
