"""The background loader of a preloading Runner. Urgent jobs (what a server waits for before it is ready, and a job
asked for: `hurry`, the entry a call would take, were it loaded) run on `threads` threads in the order they came;
the others on as many threads of the lowest CPU priority (nice 19), so that while a server serves they take only
the time its own threads leave idle (a load is a core's tenth of a second or more)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import threading
from typing import Any, Callable, Hashable

#: The background thread's nice value: the lowest priority, which a thread may always take without privileges.
BACKGROUND_NICE = 19


class Loader:
    """Jobs by key, each with its Future (as ThreadPoolExecutor.submit's), run on threads named after `name`."""

    def __init__(self, name: str, threads: int = 1):
        # Not started, in running order: (future, fn, args, urgent).
        self._jobs: dict[Hashable, tuple[cf.Future, Callable, tuple, bool]] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, args=(urgent,), daemon=True,
                                          name=f"{name}-{i}" if urgent else f"{name}-background-{i}")
                         for urgent in (True, False) for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def submit(self, key: Hashable, fn: Callable, *args: Any, urgent: bool = False) -> cf.Future:
        """Queue fn(*args) after the jobs queued before; -> its Future."""
        future: cf.Future = cf.Future()
        with self._cv:
            self._jobs[key] = (future, fn, args, urgent)
            self._cv.notify_all()
        return future

    def hurry(self, key: Hashable) -> None:
        """Make job `key` urgent and run it before the other urgent ones, if it has not started (one a background
        thread runs ends there)."""
        with self._cv:
            if key in self._jobs and not (next(iter(self._jobs)) == key and self._jobs[key][3]):
                future, fn, args, _ = self._jobs.pop(key)
                self._jobs = {key: (future, fn, args, True), **self._jobs}
                self._cv.notify_all()

    def cancel(self) -> None:
        """Cancel the jobs not started; those running end as they will (join waits for them)."""
        with self._cv:
            for future, *_ in self._jobs.values():
                future.cancel()
            self._jobs.clear()
            self._closed = True
            self._cv.notify_all()

    def join(self) -> None:
        for t in self._threads:
            t.join()

    def _next(self, urgent: bool) -> Hashable | None:
        """The first job an urgent thread (urgent ones) or a background thread (the others) runs, if any."""
        return next((k for k, job in self._jobs.items() if job[3] == urgent), None)

    def _run(self, urgent: bool) -> None:
        if not urgent and sys.platform.startswith("linux"):     # Linux: a thread id names that thread alone
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
            except OSError:
                pass                            # not allowed here: the background runs as the rest
        while True:
            with self._cv:
                while (key := self._next(urgent)) is None and not self._closed:
                    self._cv.wait()
                if key is None:
                    return
                future, fn, args, _ = self._jobs.pop(key)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(err)
