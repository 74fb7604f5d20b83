"""Warming entries up (Engine.warm_up; the server's loop does it while nothing runs): one run of each entry with
rows that read a few pages and write nothing, so that an executable's one-time costs of its first run (its loops
over keys included) are not a request's.

A warm-up leaves every pool bit for bit as it was and changes no id, for a paged artifact, one with state pools (and
its copy_slots entry) and one with a sliding window's rings. Control: the same run with one real row writes the pool, which the comparison
catches."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hf_models import build_checkpoint
from tlaloc_jax import artifact as af
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.core import inputs as call_inputs
from tlaloc_jax.serve.loop import EngineLoop, SeqSpec
from tlaloc_jax.serve.metrics import Metrics
from tlaloc_jax.serve.runtime import sharded
from tlaloc_jax.serve.host_sampling import Sampling

PROMPTS = [[5, 17, 99, 3, 250, 8, 61, 4, 4, 9, 10], [42, 7], [8] * 20]


# llama runs in `make test-slow`: mistral's paged pools plus its ring cover what llama's would.
@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.slow), "qwen3_5_text", "mistral"])
def artifact(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"warm-{request.param}")
    ck = build_checkpoint(d / "ck", request.param, seed=61)
    m = export_checkpoint(ck, d / "art", batch_ladder=(1, 4), context_ladder=(64,), block_size=8,
                          prefill_chunk=16, prefill_long_chunk=0, progress=False)
    return m, d / "art"


def _pools(eng) -> dict[str, np.ndarray]:
    return {name: np.array(eng.runner.device.to_host(sharded.first(buf))) for name, buf in eng.runner.pools.items()}


def test_warm_up_writes_nothing_and_changes_no_id(artifact, serve_cache_dir):
    m, art = artifact
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as cold:
        want = cold.generate(PROMPTS, 8)
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as eng:
        eng.generate(PROMPTS[:1], 4)                 # pools that hold something
        before = _pools(eng)
        cold_entries = eng.cold_entries()
        assert cold_entries and len(cold_entries) < len(m.entries)
        for e in cold_entries:
            inputs = call_inputs.warm_up_inputs(e, eng.runner, eng.ring_pages)
            if e.kind not in (af.EntryKind.DECODE_STEPS, af.EntryKind.COPY_SLOTS):
                # Its rows read pages, as a request's do (so the body's loops over keys run), and name no slot.
                lens = [v for k, v in inputs.items() if str(k).endswith("seq_lens")]
                assert lens and all(x.min() > 0 for x in lens), e.name
                assert all((v == -1).all() for k, v in inputs.items()
                           if str(k).endswith(("slot_mapping", "state_slots"))), e.name
            eng.warm_up(e)
        assert eng.cold_entries() == []
        after = _pools(eng)
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=f"pool {name} after warming up")
        st = eng.stats()
        assert st["warm_ups"] == len(cold_entries)
        assert not set(st["executions_by_entry"]) & {e.name for e in cold_entries}
        assert eng.generate(PROMPTS, 8) == want

        # Control: the same run of a decode entry with one real row writes its position, and the check sees it.
        e = next(x for x in m.entries if x.kind == af.EntryKind.DECODE)
        inputs = call_inputs.empty_call_inputs(e, eng.runner, eng.ring_pages)
        kinds = {p.kind for p in m.pools}
        real = build_step_inputs([RowCall([7], 0, [0], ring=[0], state_slot=0)], batch=e.batch, tokens=1,
                                 width=e.context // m.block_size, block_size=m.block_size, ring_pages=eng.ring_pages,
                                 state_slots=af.PoolKind.STATE_SLOTS in kinds)
        inputs.update(real)
        before = _pools(eng)
        eng.runner.run(e, inputs, set(), count=False)
        after = _pools(eng)
        assert any(not np.array_equal(after[n], before[n]) for n in before)


def test_the_server_loop_warms_its_entries_while_nothing_runs(artifact, serve_cache_dir):
    """The loop warms every entry not run yet while it has nothing to run, then serves the ids of an engine that
    was never warmed."""
    m, art = artifact
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as eng:
        want = eng.generate(PROMPTS[2:], 6)
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as eng:
        loop = EngineLoop(eng, 4, Metrics("test"))
        loop.start()
        try:
            deadline = time.perf_counter() + 120
            while eng.runner.stats["warm_ups"] < len(m.entries) and time.perf_counter() < deadline:
                time.sleep(0.05)
            assert eng.runner.stats["warm_ups"] == len(m.entries) and eng.runner.stats["executions"] == 0
            updates = []
            ids = loop.submit([SeqSpec(PROMPTS[2], 6, frozenset(), Sampling())], updates.extend,
                              time.perf_counter()).result(30)
            deadline = time.perf_counter() + 60
            while not any(u.finished for u in updates) and time.perf_counter() < deadline:
                time.sleep(0.02)
        finally:
            loop.stop()
        assert len(ids) == 1 and [u.token for u in updates if u.token is not None] == want[0]


def test_a_second_thread_running_entries_while_one_does_is_refused_by_name(artifact, serve_cache_dir):
    """An Engine has one driver: a step or warm-up from a second thread while a warm-up runs is refused, naming the
    thread that runs, before it touches the pools the first one donates; the ids stay the undisturbed ones. Control:
    the same step from the same second thread once the first is done runs."""
    import threading
    m, art = artifact
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as eng:
        want = eng.generate(PROMPTS, 8)
        inside, release = threading.Event(), threading.Event()
        run = eng.runner.run

        def held_run(*args, **kw):
            inside.set()
            release.wait(30)
            return run(*args, **kw)
        eng.runner.run = held_run
        e = m.entries[0]                 # warm_up runs any entry with every row empty
        warming = threading.Thread(target=eng.warm_up, args=(e,), name="the-warm-up")
        warming.start()
        refusals, ran = [], []

        def second():
            for call in (eng.step, lambda: eng.warm_up(e)):
                try:
                    call()
                except RuntimeError as err:
                    refusals.append(str(err))
        try:
            assert inside.wait(30)
            other = threading.Thread(target=second)
            other.start()
            other.join(30)
        finally:
            release.set()
            warming.join(30)
            eng.runner.run = run
        assert len(refusals) == 2 and all("'the-warm-up' is running this artifact's entries" in r for r in refusals)
        assert refusals[0].startswith("Engine.step") and refusals[1].startswith("Engine.warm_up")
        other = threading.Thread(target=lambda: ran.append(eng.step()))
        other.start()
        other.join(30)
        assert ran == [[]]
        assert eng.generate(PROMPTS, 8) == want
