"""tlaloc_jax.stage on an authored model with one state pool (a gated linear recurrence, no KV at all), and the
runtime's state slots: slots held for a sequence's life, state carried across prompt chunks, padding rows
that never touch a slot; served equal to the in-process run, alone and batched, with controls that fail.
Also stage's option groups: the keywords it took before them, and a step given as a SplitStep."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tlaloc_jax
from margins import assert_within
from tlaloc_jax import Capacity, Features, Ladders, ModelInfo, Sampler, SplitStep
from tlaloc_jax import artifact as af
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.engine import RequestRefused

V, E = 48, 16
LADDER = dict(ladders=Ladders(batch=(1, 4), context=(32, 64), prefill_chunk=8, prefill_long_chunk=0),
              capacity=Capacity(block_size=8))
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [42 % V], [7, 7, 7, 1, 2, 3, 20, 10, 11]]


def toy_weights(seed=0):
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((V, E)).astype(np.float32),
            "decay": rng.standard_normal(E).astype(np.float32),
            "mix": (rng.standard_normal((E, E)) / np.sqrt(E)).astype(np.float32),
            "head": (rng.standard_normal((E, V)) * 2).astype(np.float32)}


def recurrence(w, h, x):
    """One token: h' = a * h + (1 - a) * tanh(x @ mix), a = sigmoid(decay) per channel. h, x: [..., E]."""
    a = jax.nn.sigmoid(w["decay"])
    return a * h + (1 - a) * jnp.tanh(x @ w["mix"])


def toy_step(w, pools, inputs, *, padding_writes=False):
    """The staged step: each row reads its state slot (zeros for a row starting at position 0, and for an
    empty row, slot -1), runs the recurrence over its live tokens and writes the slot back."""
    state = pools["state"]                                       # [slots, E]
    capacity = state.shape[0]
    slots = inputs.state_slots
    # -1 (an empty row) -> one past the last slot: reads give zeros and the write is dropped. The control
    # clips the write's index instead, so an empty row writes its zeros over slot 0.
    index = jnp.where(slots < 0, capacity, slots)
    write_index = jnp.clip(slots, 0, capacity - 1) if padding_writes else index
    h = state.at[index].get(mode="fill", fill_value=0.0)
    h = jnp.where(jnp.any(inputs.positions == 0, axis=1)[:, None], 0.0, h)
    x = w["embed"][inputs.token_ids]                             # [B, T, E]
    live = inputs.positions >= 0

    def token(h, xs):
        x_t, live_t = xs
        return jnp.where(live_t[:, None], recurrence(w, h, x_t), h), None

    h, _ = lax.scan(token, h, (x.swapaxes(0, 1), live.swapaxes(0, 1)))
    # Rows are right-aligned: the carry after the last column is each row's state after its last token.
    return h @ w["head"], {"state": state.at[write_index].set(h, mode="drop")}


def reference_greedy(w, prompt, n):
    """The model run token by token in numpy-backed jax, no pools: greedy ids and the final state."""
    h = jnp.zeros(E)
    for t in prompt:
        h = recurrence(w, h, w["embed"][t])
    out = []
    for _ in range(n):
        t = int(jnp.argmax(h @ w["head"]))
        out.append(t)
        h = recurrence(w, h, w["embed"][t])
    return out


@pytest.fixture(scope="module")
def weights():
    return {k: jnp.asarray(v) for k, v in toy_weights().items()}


def reference_greedy_ids(prompt, n):
    return reference_greedy({k: jnp.asarray(v) for k, v in toy_weights().items()}, prompt, n)


@pytest.fixture(scope="module")
def artifact(weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("toy") / "artifact"
    m = tlaloc_jax.stage(toy_step, weights, {"state": tlaloc_jax.StateSlots((E,))}, out, progress=False,
                         model=ModelInfo(name="toy-recurrence", embedding_slot="embed"), **LADDER)
    return m, out


def test_manifest_describes_the_state_pool_by_kind(artifact):
    m, _ = artifact
    assert m.schema == af.SCHEMA_V5 and m.model.vocab == V and m.model.model_type == "authored"
    (pool,) = m.pools
    # A slot for each sequence of the pool, and the largest batch again as spares for state snapshots.
    assert (pool.name, pool.kind, pool.shape, pool.slot_axis) == ("state", af.PoolKind.STATE_SLOTS, (8, E), 0)
    for e in m.entries:
        roles = [s.role for s in e.inputs if s.role in af.STEP_FIELDS]
        if e.kind == af.EntryKind.COPY_SLOTS:     # copies slots: no step inputs, the state pool donated
            assert [s.role for s in e.inputs] == [af.Role.COPY_SRC, af.Role.COPY_DST, af.Role.POOL_IN], e.name
            continue
        assert roles == [af.Role.TOKEN_IDS, af.Role.POSITIONS, af.Role.SEQ_LENS, af.Role.STATE_SLOTS], e.name
    assert sum(e.kind == af.EntryKind.COPY_SLOTS for e in m.entries) == 1


def test_served_ids_equal_the_in_process_run_alone_and_together(artifact, weights, tmp_path):
    """Prompts longer than the prefill chunk (8) carry their state across chunks; decoded together they
    share calls, each in its own slot."""
    want = [reference_greedy(weights, p, 12) for p in PROMPTS]
    with Engine.load(artifact[1], cache_dir=tmp_path, progress=False) as eng:
        assert [eng.generate([p], 12)[0] for p in PROMPTS] == want
        assert eng.generate(PROMPTS, 12) == want
        st = eng.stats()
        assert st["pools"]["state"]["pages_in_use"] == 0 and st["pools"]["state"]["num_pages"] == 8
        assert st["batch_sizes"].get(3, 0) > 0


def test_a_sequence_holds_one_slot_for_its_life_and_frees_it(artifact, tmp_path):
    with Engine.load(artifact[1], cache_dir=tmp_path, progress=False, max_num_seqs=16) as eng:
        rids = [eng.add_request(p, 6) for p in PROMPTS]
        held = []
        while eng.has_unfinished():
            eng.step()
            held.append(eng.stats()["pools"]["state"]["pages_in_use"])
        assert max(held) == 3 and held[-1] == 0
        # Eight slots: a ninth concurrent sequence waits until one of the eight ends, then runs.
        for r in rids:
            eng.release(r)
        eight = [eng.add_request([1, 2], 30) for _ in range(8)]
        ninth = eng.add_request([1, 2], 4)
        eng.step()
        assert eng.stats()["waiting"] == 1 and eng.stats()["pools"]["state"]["pages_in_use"] == 8
        while eng.has_unfinished():
            eng.step()
        assert eng.output(ninth) == reference_greedy_ids([1, 2], 4)
        for r in eight + [ninth]:
            eng.release(r)
        assert eng.stats()["pools"]["state"]["pages_in_use"] == 0


def _jit_step(padding_writes=False):
    return jax.jit(lambda w, p, i: toy_step(w, p, i, padding_writes=padding_writes))


def _call(step, w, pool, rows, tokens):
    inputs = build_step_inputs(rows, batch=4, tokens=tokens, width=1, block_size=64, state_slots=True)
    inputs = tlaloc_jax.StepInputs(**{k: jnp.asarray(v) for k, v in inputs.items() if k in
                                      ("token_ids", "positions", "seq_lens", "state_slots")})
    logits, pools = step(w, {"state": pool}, inputs)
    return np.asarray(logits), np.asarray(pools["state"])


def test_batched_prefill_gives_the_solo_logits_and_states(weights):
    step = _jit_step()
    nan_pool = jnp.full((6, E), jnp.nan)
    # The recurrence's path: two E-term dots, tanh and three products a token, over at most 20 tokens.
    bound = tol.bound(20 * (2 * E + tol.TRANSCENDENTAL_ULPS + 4))
    slots = [4, 0, 2]
    logits, pool = _call(step, weights, nan_pool, [RowCall(p, 0, None, state_slot=s)
                                                   for p, s in zip(PROMPTS, slots)], 32)
    for b, (p, s) in enumerate(zip(PROMPTS, slots)):
        solo_logits, solo_pool = _call(step, weights, nan_pool, [RowCall(p, 0, None, state_slot=1)], 32)
        assert_within(relative_error(logits[b], solo_logits[0]), bound, f"toy batched row {b}: logits")
        assert_within(relative_error(pool[s], solo_pool[1]), bound, f"toy batched row {b}: state")
    # The unused slots and the empty row's nothing: untouched (NaN).
    assert np.isnan(pool[[1, 3, 5]]).all()


def test_chunked_prefill_gives_the_whole_prompt_state(weights):
    step = _jit_step()
    prompt = PROMPTS[0]
    pool = jnp.full((4, E), jnp.nan)
    whole_logits, whole = _call(step, weights, pool, [RowCall(prompt, 0, None, state_slot=2)], 32)
    for chunk in (1, 3, 8):
        pool = jnp.full((4, E), jnp.nan)
        for start in range(0, len(prompt), chunk):
            logits, pool = _call(step, weights, jnp.asarray(pool),
                                 [RowCall(prompt[start:start + chunk], start, None, state_slot=2)], chunk)
        bound = tol.bound(len(prompt) * (2 * E + tol.TRANSCENDENTAL_ULPS + 4))
        assert_within(relative_error(pool[2], whole[2]), bound, f"toy chunks of {chunk}: state")
        assert_within(relative_error(logits[0], whole_logits[0]), bound, f"toy chunks of {chunk}: logits")


@pytest.mark.parametrize("padding_writes", [False, True], ids=["step", "control-padding-writes"])
def test_padding_rows_leave_every_slot_unchanged(weights, padding_writes):
    """One live row in a batch of four: the three empty rows (slot -1) must leave every slot as it was. The
    control, which clips the write's -1 to slot 0 instead of dropping it, changes a slot and fails."""
    rng = np.random.default_rng(3)
    pool = jnp.asarray(rng.standard_normal((5, E)).astype(np.float32))
    _, after = _call(_jit_step(padding_writes), weights, pool, [RowCall(PROMPTS[2], 0, None, state_slot=1)], 16)
    untouched = [0, 2, 3, 4]
    same = np.array_equal(after[untouched], np.asarray(pool)[untouched])
    assert same != padding_writes


def test_more_choices_than_state_slots_wait_and_the_start_up_log_names_the_state_pool(artifact, tmp_path):
    """A model with state slots only: one choice more than there are slots is not refused (the last waits for a
    slot: what could run later is scheduled), each equal to its solo run; a refusal of the state pool names it,
    not KV pages or max_tokens; the server's start-up line counts slots."""
    from http_util import InProcess
    from tlaloc_jax.serve.openai.errors import refusal
    with Engine.load(artifact[1], cache_dir=tmp_path, progress=False) as eng:
        slots = eng.manifest.capacity(af.PoolKind.STATE_SLOTS)
        with InProcess(eng, max_batch=slots + 1) as srv:     # the slots, not the running limit, hold it back
            solo = srv.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 4}).json()["choices"][0]["text"]
            r = srv.post("/v1/completions", {"prompt": [1, 2], "n": slots + 1, "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert [c["text"] for c in r.json()["choices"]] == [solo] * (slots + 1)
        from tlaloc_jax.serve.__main__ import describe_pools
        assert describe_pools(eng) == f"state pool {slots} slots"
    err = refusal(RequestRefused("exceeds_pool", "a sequence needs 1 state slots", pool="state_slots"), "prompt")
    assert (err.status, err.code) == (400, "exceeds_state_pool") and "max_tokens" not in err.message


def test_a_step_that_drops_a_pool_is_refused_by_name(weights, tmp_path):
    def forgets(w, pools, inputs):
        return toy_step(w, pools, inputs)[0], {}
    with pytest.raises(tlaloc_jax.export.ExportError, match=r"returned pools \[\]; it was given \['state'\]"):
        tlaloc_jax.stage(forgets, weights, {"state": tlaloc_jax.StateSlots((E,))}, tmp_path / "a", progress=False,
                         **LADDER)


def test_unknown_pool_kind_or_role_is_refused_by_name(artifact, tmp_path):
    import json
    import shutil
    _, art = artifact
    for path, value, message in ((("pools", 0, "kind"), "magic_kv", r"pools\[0\]\.kind is 'magic_kv', not a known "
                                                                    r"PoolKind"),
                                 (("entries", 0, "inputs", 0, "role"), "MAGIC", r"inputs\[0\]\.role is 'MAGIC', not "
                                                                                 r"a known Role")):
        bad = tmp_path / value
        shutil.copytree(art, bad)
        raw = json.loads((bad / af.MANIFEST_NAME).read_text())
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        (bad / af.MANIFEST_NAME).write_text(json.dumps(raw))
        with pytest.raises(af.ManifestError, match=message):
            Engine.load(bad, cache_dir=tmp_path / "c", progress=False)


def toy_hidden(w, pools, inputs):
    """toy_step up to its head: every token's state [B, T, E] (the scan's outputs)."""
    state = pools["state"]
    index = jnp.where(inputs.state_slots < 0, state.shape[0], inputs.state_slots)
    h = state.at[index].get(mode="fill", fill_value=0.0)
    h = jnp.where(jnp.any(inputs.positions == 0, axis=1)[:, None], 0.0, h)

    def token(h, xs):
        x_t, live_t = xs
        h = jnp.where(live_t[:, None], recurrence(w, h, x_t), h)
        return h, h

    x, live = w["embed"][inputs.token_ids], inputs.positions >= 0
    h, every = lax.scan(token, h, (x.swapaxes(0, 1), live.swapaxes(0, 1)))
    return every.swapaxes(0, 1), {"state": state.at[index].set(h, mode="drop")}


def toy_head(w, x):
    return x @ w["head"]


def test_a_split_step_is_its_head_on_the_last_hidden_state(weights):
    """Called, SplitStep(hidden, head) is the step: the logits of each row's last token and the pools, the same
    operations in the same order (so the same bits, eagerly); a control whose hidden states run backwards in
    time gives other logits."""
    pool = jnp.asarray(np.random.default_rng(4).standard_normal((3, E)).astype(np.float32))
    rows = [RowCall(PROMPTS[0][:6], 0, None, state_slot=2), RowCall(PROMPTS[2][:4], 5, None, state_slot=0)]
    want = _call(toy_step, weights, pool, rows, 8)
    for split in (SplitStep(toy_hidden, toy_head), SplitStep(toy_hidden, toy_head, last=toy_step)):
        got = _call(split, weights, pool, rows, 8)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    backwards = SplitStep(lambda w, p, i: (lambda h, q: (h[:, ::-1], q))(*toy_hidden(w, p, i)), toy_head)
    assert not np.allclose(_call(backwards, weights, pool, rows, 8)[0], want[0])


def test_stage_refuses_the_old_flat_keywords():
    """The keywords stage took before the option groups (batch_ladder=, num_blocks=, sampler=, name=, ...) are gone:
    Python refuses each as an unexpected keyword, and the deprecated PromptScorer is no longer exported."""
    for key, value in (("batch_ladder", (1,)), ("num_blocks", 9), ("sampler", Sampler()), ("name", "toy"),
                       ("prompt_logprobs", 2), ("describe", {})):
        with pytest.raises(TypeError, match=rf"unexpected keyword argument '{key}'"):
            tlaloc_jax.stage(toy_step, {}, {}, "unused", **{key: value})
    assert not hasattr(tlaloc_jax, "PromptScorer") and not hasattr(tlaloc_jax.export, "PromptScorer")


def test_prompt_scoring_needs_a_split_step(weights, tmp_path):
    pools = {"state": tlaloc_jax.StateSlots((E,))}
    with pytest.raises(tlaloc_jax.export.ExportError, match=r"give the step as SplitStep\(hidden, head\)"):
        tlaloc_jax.stage(toy_step, weights, pools, tmp_path / "a", features=Features(prompt_logprobs=2), **LADDER)
    with pytest.raises(tlaloc_jax.export.ExportError, match=r"prompt_logprobs must be None or an integer >= 0"):
        tlaloc_jax.stage(SplitStep(toy_hidden, toy_head), weights, pools, tmp_path / "b",
                         features=Features(prompt_logprobs=-1), **LADDER)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
