"""The engine's per-request invariant (serve/engine.py): whatever one request does, its own pages are released,
it alone fails, and every other sequence's ids are those of its solo run. The oracle for every id is
Engine.generate of that prompt alone on the same artifact."""

from __future__ import annotations

import pytest

import tlaloc_jax.serve.core.inputs as inputs_module
import tlaloc_jax.serve.core.outputs as outputs_module
from http_util import CONTEXT, GOOD, NUM_PAGES, solo_runner
from tlaloc_jax.serve import RequestRefused, Sampling

OTHER = [7, 7, 7, 1, 2, 3, 200, 100, 11, 13]
THIRD = [42, 43, 44]
SAMPLED = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=5)


@pytest.fixture(scope="module")
def engine(http_engine):
    return http_engine


@pytest.fixture(scope="module")
def solo(engine):
    return solo_runner(engine)


def _pool(engine) -> dict[str, tuple[int, int]]:
    """(pages held, pages free) per pool."""
    return {name: (p["pages_in_use"], p["pages_free"]) for name, p in engine.stats()["pools"].items()}


def _run_all(engine) -> list:
    events = []
    while engine.has_unfinished():
        events += engine.step()
    return events


@pytest.fixture
def clean(engine):
    """Each test starts and must end with an idle engine: no sequence, no page held."""
    assert _pool(engine) == {"kv": (0, NUM_PAGES)} and not engine.active_requests()
    yield
    assert _pool(engine) == {"kv": (0, NUM_PAGES)}, "a request left pages behind"
    assert not engine.scheduler.requests, f"requests left behind: {list(engine.scheduler.requests)}"


def test_a_negative_seed_is_refused_at_admission_and_holds_no_pages(engine, solo, clean):
    want = solo(GOOD, 16)
    running = engine.add_request(GOOD, 16)
    engine.step()
    before = _pool(engine)
    # Finding 1: seed -1 used to pass Sampling, reserve its pages, then fail in numpy's default_rng, leaking them.
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\), got -1"):
        engine.add_request(OTHER, 40, sampling=Sampling(temperature=1.0, seed=-1))
    assert _pool(engine) == before
    # The engine checks at admission too, whatever the object went through since it was built.
    bypassed = Sampling(temperature=1.0, seed=3)
    object.__setattr__(bypassed, "seed", -1)
    with pytest.raises(RequestRefused, match=r"seed must be an integer in \[0, 2\*\*64\), got -1") as err:
        engine.add_request(OTHER, 40, sampling=bypassed)
    assert err.value.kind == "bad_request" and _pool(engine) == before
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\), got 18446744073709551616"):
        Sampling(temperature=1.0, seed=2**64)
    _run_all(engine)
    assert engine.output(running) == want
    engine.release(running)
    # The largest seed is served, and reproducible.
    top = Sampling(temperature=1.0, seed=2**64 - 1)
    assert engine.generate([OTHER], 8, sampling=top) == engine.generate([OTHER], 8, sampling=top)


@pytest.mark.parametrize("temperature", [1e-308, 5e-324])
def test_a_tiny_temperature_samples_the_greedy_ids_beside_other_sequences(engine, solo, clean, temperature):
    """Finding 2: logits / 1e-308 overflowed to inf, the sampler raised inside step() and took every sequence of
    the step with it. A tiny temperature puts all the mass on the largest logit: the greedy ids."""
    greedy = engine.add_request(GOOD, 16)
    tiny = engine.add_request(OTHER, 16, sampling=Sampling(temperature=temperature, seed=1))
    sampled = engine.add_request(THIRD, 16, sampling=SAMPLED)
    _run_all(engine)
    assert engine.request_info(tiny).finish_reason in ("stop", "length")
    assert engine.output(tiny) == solo(OTHER, 16)
    assert engine.output(greedy) == solo(GOOD, 16)
    assert engine.output(sampled) == solo(THIRD, 16, SAMPLED)
    # Control: a moderate temperature does not reproduce the greedy ids, so the check above can fail.
    assert engine.generate([OTHER], 16, sampling=Sampling(temperature=1.0, seed=1))[0] != solo(OTHER, 16)
    for rid in (greedy, tiny, sampled):
        engine.release(rid)


def test_a_failure_while_sampling_fails_only_its_sequence(engine, solo, clean, monkeypatch):
    """A sampler fault on the third token of one sequence, in a decode call it shares with two others."""
    real = outputs_module.sample
    draws = {"n": 0}
    doomed = Sampling(temperature=0.8, seed=666)

    def faulty(logits, s, rng):
        if s.seed == 666:
            draws["n"] += 1
            if draws["n"] == 3:
                raise FloatingPointError("injected sampler fault")
        return real(logits, s, rng)

    want_doomed = solo(OTHER, 16, doomed)
    monkeypatch.setattr(outputs_module, "sample", faulty)
    greedy = engine.add_request(GOOD, 16)
    for _ in range(3):          # the greedy sequence is decoding when the others join
        engine.step()
    bad = engine.add_request(OTHER, 16, sampling=doomed)
    sampled = engine.add_request(THIRD, 16, sampling=SAMPLED)
    failing_step, bad_events = None, []
    while engine.has_unfinished():
        events = engine.step()
        bad_events += [e for e in events if e.request_id == bad]
        if any(e.request_id == bad and e.finish_reason == "error" for e in events):
            failing_step = events
    assert [e.token for e in bad_events[:-1]] == want_doomed[:2]
    last = bad_events[-1]
    assert (last.token, last.finished, last.finish_reason) == (None, True, "error")
    assert "sampling failed: injected sampler fault" in last.error
    assert engine.request_info(bad).finish_reason == "error"
    # The call that met the fault gave the other two sequences their tokens.
    assert {e.request_id for e in failing_step if e.token is not None} == {greedy, sampled}
    assert engine.output(greedy) == solo(GOOD, 16)
    assert engine.output(sampled) == solo(THIRD, 16, SAMPLED)
    for rid in (greedy, bad, sampled):
        engine.release(rid)


def test_generate_names_a_failed_sequence_and_the_engine_stays_usable(engine, solo, clean, monkeypatch):
    """Finding 2 through the Python API: the sampler's exception left the sequences behind, and every later
    generate raised IndexError."""
    def broken(logits, s, rng):
        raise FloatingPointError("injected sampler fault")

    monkeypatch.setattr(outputs_module, "sample", broken)
    with pytest.raises(RuntimeError, match=r"request req-\d+ failed: sampling failed: injected sampler fault"):
        engine.generate([GOOD, OTHER], 8, sampling=Sampling(temperature=0.8, seed=3))
    monkeypatch.undo()
    assert engine.generate([GOOD, OTHER], 16) == [solo(GOOD, 16), solo(OTHER, 16)]


def test_an_exception_building_a_call_fails_that_call_and_the_others_go_on(engine, solo, clean, monkeypatch):
    real = inputs_module.build_step_inputs
    poisoned = [99, 98, 97]

    def faulty(rows, **kw):
        if any(list(r.token_ids[:3]) == poisoned for r in rows):
            raise RuntimeError("injected fault building a call")
        return real(rows, **kw)

    greedy = engine.add_request(GOOD, 16)
    engine.step()
    monkeypatch.setattr(inputs_module, "build_step_inputs", faulty)
    bad = engine.add_request(poisoned, 16)          # prefill batch 1: its prefill call holds it alone
    events = _run_all(engine)
    failed = [e for e in events if e.request_id == bad]
    assert [e.finish_reason for e in failed] == ["error"] and "injected fault building a call" in failed[0].error
    assert engine.output(greedy) == solo(GOOD, 16)
    for rid in (greedy, bad):
        engine.release(rid)


def test_bad_stop_token_ids_are_refused_before_any_page_is_promised(engine, clean):
    running = engine.add_request(GOOD, 16)
    before = _pool(engine)
    with pytest.raises(RequestRefused, match=r"stop_token_ids must be integer token ids, got 'x'") as err:
        engine.add_request(OTHER, 40, stop_token_ids=[3, "x"])
    assert err.value.kind == "bad_request" and _pool(engine) == before
    engine.release(running)


def test_what_could_run_later_is_queued_and_what_never_fits_is_refused(engine, solo, clean):
    """Finding 7, the engine's half: sequences that together need more pages than the pool are queued, each
    running when there is room (every one its solo ids); one past the largest context is refused for good."""
    longest = (4, CONTEXT - 4 + 1)                       # 64 positions: 8 pages of 8
    engine.check_could_fit([longest] * 9)                # 72 pages together: queued, not refused
    with pytest.raises(RequestRefused, match=r"prompt of 4 tokens plus max_new_tokens 62 exceeds the largest "
                                             r"context 64") as err:
        engine.check_could_fit([(4, 62)])
    assert err.value.kind == "too_long"
    prompts = [[1, 2, 3, 4 + i] for i in range(9)]
    rids = [engine.add_request(p, 61) for p in prompts]
    _run_all(engine)
    assert [engine.output(r) for r in rids] == [solo(p, 61) for p in prompts]
    for rid in rids:
        engine.release(rid)


def test_a_sequence_larger_than_the_pool_is_refused_by_name(engine):
    """exceeds_pool: a sequence needing more pages than the whole pool holds could never run (the scheduler alone,
    over the same artifact with a pool of 4 pages)."""
    from dataclasses import replace
    from tlaloc_jax.serve.core.scheduler import Scheduler
    m = engine.manifest
    small = replace(m, pools=tuple(replace(p, capacity=4) for p in m.pools))
    sched = Scheduler(small, CONTEXT)
    sched.check_could_fit([(4, 29)])                    # 32 positions: exactly the pool
    with pytest.raises(RequestRefused, match=r"a sequence of 4 prompt tokens plus max_new_tokens 30 needs 5 KV "
                                             r"pages, and the pool holds 4: it could never run") as err:
        sched.check_could_fit([(4, 30)])
    assert err.value.kind == "exceeds_pool"
