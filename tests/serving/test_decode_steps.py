"""decode_steps entries (export/_decode_steps.py) served by the engine: K tokens per call, the same ids as single steps.

The oracle of every check is the same engine on the same artifact with its decode_steps entries turned off
(`use_decode_steps = False`): single decode steps, whose parity with HF transformers tests/runtime/test_runtime.py
checks. Ids must be equal, not near: both paths run the same step function on the same inputs.
"""

from __future__ import annotations

import json

import pytest

from hf_models import build_checkpoint
from tlaloc_jax import artifact as af
from tlaloc_jax.export import Sampler, export_checkpoint
from tlaloc_jax.serve import Engine, Sampling
from tlaloc_jax.serve.core import inputs as inputs_mod
from tlaloc_jax.serve.core import call_plan as sched_mod
from tlaloc_jax.serve.core.call_plan import CallPlanner, ScheduledCall

K = 4
# One batch bucket: three entries (decode, prefill, decode_steps) to compile; single steps and K-step calls of
# one to three sequences all run on it.
LADDER = dict(batch_ladder=(4,), context_ladder=(64,), block_size=8, prefill_chunk=16, prefill_long_chunk=0,
              progress=False)
PROMPTS = [[5, 17, 99, 3, 250, 8, 61], [42], [7, 7, 7, 1, 2, 3, 200, 100, 11, 13]]
SEEDED = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, serve_cache_dir):
    """A tiny Llama with the in-body sampler and decode_steps entries of K steps."""
    root = tmp_path_factory.mktemp("decode_steps")
    ck = build_checkpoint(root / "ck", "llama", seed=31)
    export_checkpoint(ck, root / "art", sampler=Sampler(top_logprobs=4, logit_bias=4), decode_steps=K, **LADDER)
    with Engine.load(root / "art", cache_dir=serve_cache_dir, progress=False) as eng:
        yield eng


def _run(eng: Engine, requests, *, decode_steps: bool, arrivals=None):
    """Drive the engine over `requests` [(prompt, max_new_tokens, stop ids, sampling)] -> (ids by request, the
    tokens by request in event order, decode_steps calls made). arrivals: {step number: [requests]} added
    before that step."""
    eng.use_decode_steps = decode_steps
    arrivals = dict(arrivals or {})
    before = eng.stats()["decode_steps_calls"]
    rids = [eng.add_request(p, n, stop, s) for p, n, stop, s in requests]
    streamed: dict[str, list[int]] = {r: [] for r in rids}
    step = 0
    try:
        while eng.has_unfinished():
            for p, n, stop, s in arrivals.pop(step, []):
                rid = eng.add_request(p, n, stop, s)
                rids.append(rid)
                streamed[rid] = []
            for ev in eng.step():
                assert ev.token is not None, ev.error
                streamed[ev.request_id].append(ev.token)
            step += 1
        out = [eng.output(r) for r in rids]
        reasons = [eng.request_info(r).finish_reason for r in rids]
    finally:
        for r in rids:
            eng.release(r)
    assert [streamed[r] for r in rids] == out
    return out, reasons, eng.stats()["decode_steps_calls"] - before


def _both(eng, requests, **kw):
    single = _run(eng, requests, decode_steps=False, **kw)
    stepped = _run(eng, requests, decode_steps=True, **kw)
    assert single[2] == 0
    return single, stepped


def test_greedy_same_ids_finishing_at_different_steps(llama):
    # max_new_tokens 3, 9 and 14: with K = 4 the first ends inside the first K-step call, the second inside the
    # second, the last runs on alone.
    reqs = [(p, n, (), None) for p, n in zip(PROMPTS, (3, 9, 14))]
    single, stepped = _both(llama, reqs)
    assert stepped[0] == single[0] and stepped[1] == single[1] == ["length"] * 3
    assert [len(x) for x in stepped[0]] == [3, 9, 14]
    assert stepped[2] >= 3
    st = llama.stats()
    assert st["pool_in_place"] == st["pool_address_checks"] > 0          # the pools were donated, not copied
    assert st["pools"]["kv"]["pages_in_use"] == 0 and st["running"] == st["waiting"] == 0


def test_seeded_sampled_same_ids(llama):
    reqs = [(p, 12, (), SEEDED) for p in PROMPTS]
    single, stepped = _both(llama, reqs)
    assert stepped[0] == single[0] and stepped[2] > 0
    assert len({tuple(x) for x in stepped[0]}) == 3


def test_stop_mid_call(llama):
    """A stop id produced inside a K-step call ends the sequence there: no token past it, its pages freed, the
    other sequence's ids unchanged."""
    # ids[0] is the prefill's; K-step calls produce ids[1:5], ids[5:9], ...: a stop at index i ends a call early
    # when i % K != 0. A prompt whose greedy run has a token that first appears at such an index, past the first call:
    for prompt in PROMPTS:
        ids = _run(llama, [(prompt, 20, (), None)], decode_steps=False)[0][0]
        first = next((i for i in range(K + 1, len(ids)) if ids.index(ids[i]) == i and i % K), None)
        if first is not None:
            break
    assert first is not None, "no prompt stops inside a call: the test would mean nothing"
    stop = ids[first]
    reqs = [(prompt, 20, (stop,), None), (PROMPTS[1], 14, (), None)]
    single, stepped = _both(llama, reqs)
    assert stepped[:2] == single[:2]
    assert stepped[0][0] == ids[:first + 1] and stepped[1][0] == "stop"
    assert llama.stats()["pools"]["kv"]["pages_in_use"] == 0


def test_stop_ids_outside_the_vocabulary_are_no_stop(llama):
    """A stop id no token can be (past the vocabulary, past int32) neither fails a K-step call nor stops a row."""
    reqs = [(PROMPTS[0], 9, (2**40, 10**6), None), (PROMPTS[1], 9, (), None)]
    single, stepped = _both(llama, reqs)
    assert stepped[0] == single[0] and stepped[1] == ["length"] * 2 and stepped[2] > 0


def test_arrival_during_k_call(llama):
    """A request added while another decodes waits one call at most: the next step reads its prompt."""
    reqs = [(PROMPTS[0], 14, (), SEEDED)]
    single, stepped = _both(llama, reqs, arrivals={3: [(PROMPTS[1], 10, (), None)], 4: [(PROMPTS[2], 6, (), SEEDED)]})
    assert stepped[0] == single[0] and stepped[2] > 0

    llama.use_decode_steps = True
    a, b = llama.add_request(PROMPTS[0], 14), None
    try:
        llama.step()                      # prefill
        events = llama.step()             # one K-step call
        assert len(events) == K and llama.stats()["decode_steps_calls"] > 0
        b = llama.add_request(PROMPTS[1], 5)
        multi = llama.stats()["decode_steps_calls"]
        got = [ev.request_id for ev in llama.step()]
        # The next step reads the new prompt (one token: it shares the running sequence's decode call), on single
        # steps: one token each.
        assert sorted(got) == sorted([a, b]) and llama.stats()["decode_steps_calls"] == multi
    finally:
        for r in (a, b):
            if r is not None:
                llama.release(r)


@pytest.mark.parametrize("what", ["logprobs", "penalty", "min_tokens", "single_step", "many_stops"])
def test_host_each_step_keeps_single_steps(llama, what):
    """Requests whose tokens need the host between steps never run in a decode_steps call."""
    sampling = {"logprobs": Sampling(logprobs=2), "penalty": Sampling(repetition_penalty=1.3),
                "min_tokens": Sampling(min_tokens=8)}.get(what)
    stop = tuple(range(20)) if what == "many_stops" else (3,) if what == "min_tokens" else ()
    llama.use_decode_steps = True
    before = llama.stats()["decode_steps_calls"]
    rid = llama.add_request(PROMPTS[0], 8, stop, sampling, single_step=what == "single_step")
    try:
        while llama.has_unfinished():
            llama.step()
    finally:
        llama.release(rid)
    assert llama.stats()["decode_steps_calls"] == before


def test_control_fails(llama, monkeypatch):
    """The comparison bites: K-step calls whose rows start one position late (greedy), or whose random counter
    is one ahead (seeded), give other ids than single steps."""
    reqs = [(p, 12, (), None) for p in PROMPTS]
    single = _run(llama, reqs, decode_steps=False)[0]
    real = sched_mod.row_call

    def late(token_ids, start, held):
        return real(token_ids, start + 1, held)
    monkeypatch.setattr(CallPlanner, "_steps_call", _shifted(CallPlanner._steps_call, late))
    assert _run(llama, reqs, decode_steps=True)[0] != single
    monkeypatch.undo()

    seeded = [(p, 12, (), SEEDED) for p in PROMPTS]
    single = _run(llama, seeded, decode_steps=False)[0]
    real_inputs = inputs_mod.sampler_inputs

    def ahead(runner, call, producing, allowed):
        out = real_inputs(runner, call, producing, allowed)
        if call.entry.kind == af.EntryKind.DECODE_STEPS:
            out[af.Role.RNG_STEP] = out[af.Role.RNG_STEP] + 1
        return out
    monkeypatch.setattr(inputs_mod, "sampler_inputs", ahead)
    assert _run(llama, seeded, decode_steps=True)[0] != single


def _shifted(steps_call, row_fn):
    """CallPlanner._steps_call whose rows come from row_fn (a broken host for the control)."""
    def call(self, decoding):
        c = steps_call(self, decoding)
        if c is None:
            return None
        rows = tuple(row_fn(r.token_ids, r.start, s.held) for r, s in zip(c.rows, c.seqs))
        return ScheduledCall(c.entry, c.seqs, rows, c.limits)
    return call


def test_manifest_records_decode_steps(llama, tmp_path):
    m = llama.manifest
    stepped = [e for e in m.entries if e.kind == af.EntryKind.DECODE_STEPS]
    assert {(e.batch, e.context, e.steps) for e in stepped} == {(4, 64, K)}
    assert all(e.steps == 1 for e in m.entries if e.kind != af.EntryKind.DECODE_STEPS)
    e = stepped[0]
    assert e.outputs[0] == af.TensorSig(af.Role.STEP_TOKENS, "int32", (4, K))
    raw = json.loads(m.to_json())
    # An older v4 manifest (no `steps`, no decode_steps entries) loads as before.
    old = dict(raw, entries=[{k: v for k, v in x.items() if k != "steps"} for x in raw["entries"]
                             if x["kind"] != "decode_steps"])
    af.check_manifest(af.Manifest.from_json(json.dumps(old)))
    # A decode_steps entry that claims one step is refused by name.
    bad = dict(raw, entries=[dict(x, steps=1) if x["name"] == e.name else x for x in raw["entries"]])
    with pytest.raises(af.ManifestError, match=f"entry '{e.name}'.*decode_steps"):
        af.check_manifest(af.Manifest.from_json(json.dumps(bad)))


@pytest.mark.slow
def test_ring_pool_without_sampler(tmp_path, serve_cache_dir, monkeypatch):
    """Sliding layers (a ring of pages per sequence, window 8 < the lengths reached) and no sampler: argmax in
    the body, ring slots computed there; the same ids as single steps, and the control bites."""
    ck = build_checkpoint(tmp_path / "ck", "gemma3_text", seed=32)
    m = export_checkpoint(ck, tmp_path / "art", decode_steps=K, **{**LADDER, "batch_ladder": (2,)})
    assert m.ring is not None
    with Engine.load(tmp_path / "art", cache_dir=serve_cache_dir, progress=False) as eng:
        reqs = [(PROMPTS[0], 20, (), None), (PROMPTS[2], 13, (), None)]
        single, stepped = _both(eng, reqs)
        assert stepped[0] == single[0] and stepped[2] > 0
        # The control: the ring slots of a row one position late.
        real = sched_mod.row_call
        with monkeypatch.context() as mp:
            mp.setattr(CallPlanner, "_steps_call", _shifted(CallPlanner._steps_call,
                                                       lambda t, start, held: real(t, start + 1, held)))
            assert _run(eng, reqs, decode_steps=True)[0] != single[0]
        # Plain greedy only without a sampler: a sampled request keeps single steps.
        assert _run(eng, [(PROMPTS[1], 6, (), SEEDED)], decode_steps=True)[2] == 0
