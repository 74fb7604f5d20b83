"""serve/runtime/loader.py: one thread runs the jobs in the order they came, a hurried one before the others not
started; cancel drops those not started. The first job holds the thread so that the order of the rest is decided
while they all wait (control: without hurry they run in the order they came)."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest

from tlaloc_jax.serve.runtime.loader import Loader


def _run(hurried: str | None) -> list[str]:
    gate, ran = threading.Event(), []
    loader = Loader("test-load")
    first = loader.submit("gate", lambda: gate.wait(30))
    futures = [loader.submit(k, ran.append, k) for k in "abcd"]
    if hurried:
        loader.hurry(hurried)
        loader.hurry("gate")            # running already: nothing to move
    gate.set()
    cf.wait([first, *futures], 30)
    loader.cancel()
    loader.join()
    return ran


@pytest.mark.parametrize("hurried, order", [(None, list("abcd")), ("c", list("cabd")), ("a", list("abcd"))])
def test_jobs_run_in_order_a_hurried_one_first(hurried, order):
    assert _run(hurried) == order


def test_cancel_drops_the_jobs_not_started_and_a_failure_reaches_its_future():
    gate, started = threading.Event(), threading.Event()
    loader = Loader("test-load")
    running = loader.submit("gate", lambda: started.set() or gate.wait(30))
    failing = loader.submit("bad", lambda: 1 / 0)
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
