"""serve/runtime/loader.py: urgent jobs run in the order they came on the urgent threads, a hurried one before the
others not started; the other jobs run on background threads of nice 19, beside the urgent ones; cancel drops those
not started. A first job holds each thread so that the order of the rest is decided while they all wait (control:
without hurry they run in the order they came)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import threading

import pytest

from tlaloc_jax.serve.runtime.loader import BACKGROUND_NICE, Loader


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _run(hurried: str | None) -> list[str]:
    gate, ran = threading.Event(), []
    loader = Loader("test-load")
    first = loader.submit("gate", lambda: gate.wait(30), urgent=True)
    futures = [loader.submit(k, ran.append, k, urgent=True) for k in "abcd"]
    if hurried:
        loader.hurry(hurried)
        loader.hurry("gate")            # running already: nothing to move
    gate.set()
    cf.wait([first, *futures], 30)
    loader.cancel()
    loader.join()
    return ran


@pytest.mark.parametrize("hurried, order", [(None, list("abcd")), ("c", list("cabd")), ("a", list("abcd"))])
def test_urgent_jobs_run_in_order_a_hurried_one_first(hurried, order):
    assert _run(hurried) == order


def test_the_other_jobs_run_beside_the_urgent_ones_at_the_lowest_priority_until_hurried():
    """With the urgent thread held, a background job still runs, at nice 19; one hurried while the background thread
    is held runs on the urgent thread, at the process's priority (control: its nice is not the background's)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread priorities are Linux's")
    own = _nice()
    if own >= BACKGROUND_NICE:
        pytest.skip(f"this process already runs at nice {own}: the background's priority is not lower")
    held_urgent, held_background = threading.Event(), threading.Event()
    loader = Loader("test-load", threads=1)
    busy = loader.submit("urgent", lambda: held_urgent.wait(30), urgent=True)
    assert loader.submit("other", _nice).result(30) == BACKGROUND_NICE         # ran while "urgent" waits
    blocked = loader.submit("background", lambda: held_background.wait(30))
    asked = loader.submit("asked", _nice)
    loader.hurry("asked")
    held_urgent.set()
    assert asked.result(30) == own and busy.result(30) is True
    assert not blocked.done()
    held_background.set()
    assert blocked.result(30) is True
    loader.cancel()
    loader.join()


def test_cancel_drops_the_jobs_not_started_and_a_failure_reaches_its_future():
    gate, started = threading.Event(), threading.Event()
    loader = Loader("test-load")
    running = loader.submit("gate", lambda: started.set() or gate.wait(30), urgent=True)
    failing = loader.submit("bad", lambda: 1 / 0, urgent=True)
    assert started.wait(30)
    loader.cancel()
    gate.set()
    loader.join()
    assert running.result() is True and failing.cancelled()
    loader = Loader("test-load")
    with pytest.raises(ZeroDivisionError):
        loader.submit("bad", lambda: 1 / 0).result(30)
    loader.cancel()
    loader.join()
