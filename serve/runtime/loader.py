"""The background loader of a preloading Runner: one thread that runs its jobs in the order they came, except that a
job asked for (`hurry`: the entry a call would take, were it loaded) runs before the others not started yet."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable, Hashable


class Loader:
    """Jobs by key, each with its Future (as ThreadPoolExecutor.submit's), run one at a time on a thread of `name`."""

    def __init__(self, name: str):
        self._jobs: dict[Hashable, tuple[cf.Future, Callable, tuple]] = {}     # not started, in running order
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: Hashable, fn: Callable, *args: Any) -> cf.Future:
        """Queue fn(*args) after the jobs queued before; -> its Future."""
        future: cf.Future = cf.Future()
        with self._cv:
            self._jobs[key] = (future, fn, args)
            self._cv.notify()
        return future

    def hurry(self, key: Hashable) -> None:
        """Run job `key` next, if it has not started."""
        with self._cv:
            if key in self._jobs and next(iter(self._jobs)) != key:
                self._jobs = {key: self._jobs[key], **{k: v for k, v in self._jobs.items() if k != key}}

    def cancel(self) -> None:
        """Cancel the jobs not started; the one running ends as it will (join waits for it)."""
        with self._cv:
            for future, _, _ in self._jobs.values():
                future.cancel()
            self._jobs.clear()
            self._closed = True
            self._cv.notify()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                key = next(iter(self._jobs))
                future, fn, args = self._jobs.pop(key)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(err)
