"""The scheduler (serve/core/scheduler.py): queueing instead of refusing, pages taken as positions are written,
preemption of the youngest sequence when pages run out, and prefix caching of full pages.

Each check compares ids against the same artifact served without the feature (prefix caching off, a pool large
enough that nothing is preempted), with a control that must fail: a prefix hash that ignores a page's last token,
and a preemption that forgets to compute its sequence again."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from http_util import serving
from tlaloc_jax.serve import Engine, Sampling
from tlaloc_jax.serve.core import kv_cache
from tlaloc_jax.serve.core import scheduler as scheduler_module
from tlaloc_jax.serve.core.kv_cache_manager import KVCacheManager
from tlaloc_jax.serve.loop import EngineLoop, SeqSpec
from tlaloc_jax.serve.metrics import Metrics

SHARED = [(i * 13 + 7) % 250 + 3 for i in range(32)]          # four full pages of 8
TAILS = [[11, 12, 13], [200, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [77]]   # prompts of 33 to 41: 20 more fit 64
SEEDED = Sampling(temperature=0.9, top_k=40, seed=11)


@pytest.fixture(scope="module")
def engines(http_artifacts, serve_cache_dir):
    """(cached, uncached): the ids artifact with prefix caching on, and off."""
    with Engine.load(http_artifacts[1], cache_dir=serve_cache_dir, progress=False) as cached, \
            Engine.load(http_artifacts[1], cache_dir=serve_cache_dir, progress=False,
                        enable_prefix_caching=False) as uncached:
        yield cached, uncached


def _prompts(tails=TAILS):
    return [SHARED + t for t in tails]


def test_prefix_hits_give_the_ids_of_no_cache(engines):
    """Requests sharing a 32-token prefix, one after another and then together: with prefix caching the later
    ones compute only their tails (hits counted), and every id equals the uncached engine's; seeded samples too."""
    cached, uncached = engines
    prompts = _prompts()
    want = [uncached.generate([p], 20)[0] for p in prompts]
    before = cached.stats()
    got = [cached.generate([p], 20)[0] for p in prompts]
    assert got == want
    assert cached.generate(prompts, 20) == uncached.generate(prompts, 20) == want
    st = cached.stats()
    # Three of the first four, then all four together, skip the 32 shared positions.
    assert st["prefix_hits"] - before["prefix_hits"] >= 7 * 32
    assert uncached.stats()["prefix_hits"] == 0 and not uncached.stats()["prefix_caching"]
    assert cached.generate(prompts, 12, sampling=SEEDED) == uncached.generate(prompts, 12, sampling=SEEDED)
    assert st["pages_in_use"] == 0 and st["pools"]["kv"]["pages_cached"] > 0


@pytest.mark.parametrize("in_flight", [True, False], ids=["waits for the prefix", "control: starts at once"])
def test_requests_that_arrive_together_compute_their_shared_prefix_once(engines, monkeypatch, in_flight):
    """Four prompts with a new 32-token prefix, queued together: the first computes the prefix and the others wait
    until its pages are cached, then compute only their tails; ids equal the uncached engine's. The control turns
    the wait off: those admitted beside the first compute the prefix again."""
    cached, uncached = engines
    shared = [(i * 29 + 1 + 7 * in_flight) % 240 + 5 for i in range(32)]       # a prefix no earlier test cached
    prompts = [shared + t for t in TAILS]
    if not in_flight:
        monkeypatch.setattr(KVCacheManager, "computing", lambda self, running, s, hit: False)
    before = cached.stats()["prefix_hits"]
    assert cached.generate(prompts, 12) == uncached.generate(prompts, 12)
    hits = cached.stats()["prefix_hits"] - before
    assert hits == 3 * 32 if in_flight else hits < 3 * 32


def test_control_a_hash_that_ignores_a_pages_last_token_is_caught(engines, monkeypatch):
    """Two prompts that differ only in the last token of their first page: a hash blind to that token hands the
    second one the first one's page, and its ids part from the uncached engine's."""
    cached, uncached = engines
    first, second = [3, 4, 5, 6, 7, 8, 9, 10, 50, 51, 52], [3, 4, 5, 6, 7, 8, 9, 199, 50, 51, 52]
    want = uncached.generate([second], 16)[0]
    assert cached.generate([first], 16)[0] != want
    real = kv_cache.block_hash
    monkeypatch.setattr(kv_cache, "block_hash", lambda parent, tokens: real(parent, tokens[:-1]))
    cached.generate([first], 16)          # its first page is now cached under the blind hash
    assert cached.generate([second], 16)[0] != want
    monkeypatch.undo()
    assert cached.generate([second], 16)[0] == want


def _crowd(n: int) -> list[list[int]]:
    return [[(7 * i + j * 5) % 250 + 3 for j in range(5 + i % 7)] for i in range(n)]


def test_forced_preemption_gives_every_sequence_its_solo_ids_and_samples(http_artifacts, serve_cache_dir, engines):
    """Sixteen running sequences of up to 64 positions want up to 128 pages of a 64-page pool: the youngest are
    preempted (pages given back), computed again later, and every sequence still gets its solo ids, greedy and
    seeded, with caching on and off."""
    _, uncached = engines
    prompts = _crowd(16)
    want = [uncached.generate([p], 52)[0] for p in prompts]
    seeded = [uncached.generate([p], 40, sampling=SEEDED)[0] for p in prompts]
    for caching in (False, True):
        with Engine.load(http_artifacts[1], cache_dir=serve_cache_dir, progress=False, max_num_seqs=16,
                         enable_prefix_caching=caching) as eng:
            assert eng.generate(prompts, 52) == want
            assert eng.stats()["preemptions"] > 0
            assert eng.generate(prompts, 40, sampling=SEEDED) == seeded
            assert eng.stats()["pages_in_use"] == 0


def test_control_a_preemption_that_does_not_recompute_is_caught(http_artifacts, serve_cache_dir, engines,
                                                                 monkeypatch):
    """A preempted sequence that resumes where it was, its pages given back, reads pages it no longer holds:
    the check above fails."""
    _, uncached = engines
    prompts = _crowd(16)
    want = [uncached.generate([p], 52)[0] for p in prompts]
    real = scheduler_module.Scheduler._preempt

    def forgetful(self, s):
        computed = s.computed
        real(self, s)
        s.computed = computed
    monkeypatch.setattr(scheduler_module.Scheduler, "_preempt", forgetful)
    with Engine.load(http_artifacts[1], cache_dir=serve_cache_dir, progress=False, max_num_seqs=16,
                     enable_prefix_caching=False) as eng:
        got = eng.generate(prompts, 52)
        assert eng.stats()["preemptions"] > 0
    assert got != want


@pytest.mark.slow
def test_sixty_four_chats_without_max_tokens_all_succeed_on_a_small_pool(tmp_path_factory, serve_cache_dir):
    """64 concurrent chat requests without max_tokens (each may run to the end of the context), 8 running at once,
    on a pool that holds only 4 full contexts: every one gets its answer, none a 503."""
    import json

    from hf_models import build_checkpoint
    from tlaloc_jax.export import export_checkpoint
    from tokenizers_util import EOS, VOCAB, write_tokenizer
    root = tmp_path_factory.mktemp("small-pool")
    ck = build_checkpoint(root / "ck", "llama", seed=31, vocab_size=VOCAB, eos_token_id=EOS)
    write_tokenizer(ck)
    export_checkpoint(ck, root / "art", batch_ladder=(1, 8), context_ladder=(32, 64), block_size=8,
                      prefill_chunk=16, prefill_long_chunk=0, prefill_max_batch=1, num_blocks=32, progress=False)

    async def main():
        with Engine.load(root / "art", cache_dir=serve_cache_dir, progress=False) as eng:
            async with serving(eng, max_batch=8) as (http, _):
                async def chat(i):
                    r = await http.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": f"question {i}: " + "word " * (i % 5)}],
                        "temperature": 0})
                    return r
                answers = await asyncio.gather(*(chat(i) for i in range(64)))
                stats = eng.stats()
        return answers, stats
    answers, stats = asyncio.run(main())
    codes = [r.status_code for r in answers]
    assert codes == [200] * 64, [r.text for r in answers if r.status_code != 200][:2]
    assert all(json.loads(r.text)["choices"][0]["finish_reason"] in ("stop", "length") for r in answers)
    assert stats["pages_in_use"] == 0 and stats["requests_finished"] >= 64


def test_each_calls_tokens_are_handed_over_as_soon_as_the_call_has_run(engines):
    """Three short prompts on an artifact whose prefill entries hold one row: one step of three calls. Each call's
    tokens reach on_events right after that call (one more execution each time), and the step returns them all."""
    _, eng = engines
    rids = [eng.add_request(p, 4) for p in ([5, 6], [6, 7, 8], [8, 9, 10, 11])]
    seen = []
    try:
        events = eng.step(on_events=lambda evs: seen.append(([e.request_id for e in evs],
                                                           eng.runner.stats["executions"])))
        assert [ids for ids, _ in seen] == [[r] for r in rids] == [[e.request_id] for e in events]
        runs = [n for _, n in seen]
        assert runs == list(range(runs[0], runs[0] + 3))
    finally:
        for r in rids:
            eng.release(r)


@pytest.mark.parametrize("wait,gap,reading,held", [
    (30.0, None, True, True), (0.0, None, True, False), (30.0, 1.0, False, True), (30.0, 0.0, False, False)],
    ids=["waits for the request being read", "control: no wait", "waits after a request came", "control: no gap"])
def test_a_step_of_new_prompts_waits_for_requests_being_read_or_just_come(http_artifacts, serve_cache_dir, wait,
                                                                          gap, reading, held):
    """The engine loop holds a step that would only start new prompts while the server is still reading another
    request (an open Arrival), so that both share the step's calls; the request's submit ends the wait. Requests
    read one after another open their Arrivals a few ms apart, so at some moments none is open: the step also waits
    while the last request came under arrival_gap_s ago (within arrival_wait_s), and one submitted shortly after
    shares its calls. Controls: with no wait, or (no Arrival open) no gap, the first request runs alone at once."""
    with Engine.load(http_artifacts[1], cache_dir=serve_cache_dir, progress=False) as eng:
        loop = EngineLoop(eng, 8, Metrics("test"))
        loop.arrival_wait_s = wait
        if gap is not None:
            loop.arrival_gap_s = gap
        first_done, done = threading.Event(), threading.Event()
        updates = []

        def sink(batch):
            updates.extend(batch)
            finished = sum(u.finished for u in updates)
            if finished >= 1:
                first_done.set()
            if finished == 2:
                done.set()
        loop.start()
        try:
            ticket = loop.arriving() if reading else None
            spec = SeqSpec([5, 6, 7], 3, frozenset(), Sampling())
            loop.submit([spec], sink, time.perf_counter()).result(10)
            # Held: the first request must not finish alone; unheld, it runs at once (however slow the machine).
            assert first_done.wait(0.3 if held else 30) is not held
            steps_before = loop.steps
            loop.submit([spec], sink, time.perf_counter(), ticket).result(10)
            assert done.wait(30)
        finally:
            loop.stop()
        assert steps_before == (0 if held else 3)      # held, or the first request's three tokens
        # Held, both requests share three steps; unheld, each takes its own three.
        assert loop.steps == (3 if held else 6)
        assert sum(u.token is not None for u in updates) == 6


@pytest.mark.parametrize("wait_for_the_thread", [True, False], ids=["stop", "control-stop-that-gives-up"])
def test_a_loop_stopped_mid_step_ends_before_the_next_loop_drives_the_engine(http_artifacts, serve_cache_dir,
                                                                            monkeypatch, caplog, wait_for_the_thread):
    """A server stopped while its loop is in a long call returns from stop only once the loop has ended, so a new
    server on the same Engine serves at once. Control: a stop that gives up waiting (as one with a timeout did)
    leaves the old loop running, and a second loop on the Engine is refused by name."""
    with Engine.load(http_artifacts[1], cache_dir=serve_cache_dir, progress=False) as eng:
        in_call, run = threading.Event(), eng.runner.run

        def slow_run(*args, **kw):
            if not in_call.is_set():
                in_call.set()
                time.sleep(1.0)         # inside Engine.step's hold on the runner
            return run(*args, **kw)
        monkeypatch.setattr(eng.runner, "run", slow_run)
        spec = SeqSpec([5, 6, 7], 3, frozenset(), Sampling())
        first = EngineLoop(eng, 8, Metrics("test"), warm_up=False)
        first.start()
        first.submit([spec], lambda updates: None, time.perf_counter()).result(10)
        assert in_call.wait(30)
        if wait_for_the_thread:
            first.stop(warn_every=0.2)
            assert not first.alive
            assert "still in its step" in caplog.text
        else:
            first._cmds.put(("stop",))
            first._thread.join(0.1)
            assert first.alive
        second, done, updates = EngineLoop(eng, 8, Metrics("test"), warm_up=False), threading.Event(), []
        if not wait_for_the_thread:
            with pytest.raises(RuntimeError, match="another engine loop runs on this Engine"):
                second.start()
            first.stop()
            assert not first.alive
            return

        def sink(batch):
            updates.extend(batch)
            if any(u.finished for u in updates):
                done.set()
        second.start()
        try:
            second.submit([spec], sink, time.perf_counter()).result(10)
            assert done.wait(30)
        finally:
            second.stop()
        assert len([u for u in updates if u.token is not None]) == 3 and second.failure is None
