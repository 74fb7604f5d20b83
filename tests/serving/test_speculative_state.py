"""Speculative decoding over state pools (issue 60): a verify call keeps each row's state after its last accepted
token (export/_verify.py keep_accepted_states), so a recurrent model speculates exactly.

The body's choice against hand-made per-position states (a layered pool and one without layers, an empty row that
writes nothing); an authored recurrent step (a state pool without layers, as a Mamba-style model's) whose greedy ids
with n-gram speculation equal those without and the recurrence run by hand, with drafts accepted and rejected; a
state-pool step that does not write its per-position states refused by name. Control: a body keeping the state
after the last drafted token changes the ids. The built-in hybrid (Qwen3.5) is in
tests/serving/test_speculative.py with the other families."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tlaloc_jax
from tlaloc_jax import Capacity, Features, Ladders, ModelInfo, SplitStep
from tlaloc_jax import artifact as af
from tlaloc_jax.export import ExportError, _verify
from tlaloc_jax.pools import per_position
from tlaloc_jax.serve import Engine

pytestmark = [pytest.mark.numeric, pytest.mark.every_draft]

V, E, K = 32, 8, 3
LADDER = dict(ladders=Ladders(batch=(1, 4), context=(64,), prefill_chunk=8, prefill_long_chunk=0),
              capacity=Capacity(block_size=8))
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 9, 5, 9, 5], [7, 3, 11, 2, 8, 30, 7, 3], [4]]


def test_keep_accepted_states_keeps_the_state_after_the_last_accepted_token():
    """Rows right-aligned in T = 4 columns: column pad + accepted is kept in the row's slot, for a pool of 2 layers
    (slot axis 1) and one without layers (slot axis 0); an empty row (slot -1) writes nothing; the other slots keep
    what they held."""
    B, T, slots = 3, 4, 5
    positions = jnp.array([[10, 11, 12, 13], [-1, -1, 20, 21], [-1, -1, -1, -1]])
    accepted = jnp.array([2, 1, 0])
    index = _verify.accepted_index(positions, accepted)
    assert index.tolist() == [2, 3, 3]
    layered = af.Pool(name="s", kind=af.PoolKind.STATE_SLOTS, dtype="float32", capacity=slots, slot_axis=1,
                      shape=(2, slots, 3))
    flat = af.Pool(name="f", kind=af.PoolKind.STATE_SLOTS, dtype="float32", capacity=slots, slot_axis=0,
                   shape=(slots, 3))
    pools = {"s": -jnp.ones((2, slots, 3)), "f": -jnp.ones((slots, 3))}
    buffers = _verify.per_position_buffers(pools, (layered, flat), B, T)
    assert buffers[per_position("s")].shape == (2, B, T, 3) and buffers[per_position("f")].shape == (B, T, 3)
    # Each state names its layer, row and column: 100 * layer + 10 * row + column.
    steps = (100 * jnp.arange(2)[:, None, None, None] + 10 * jnp.arange(B)[None, :, None, None]
             + jnp.arange(T)[None, None, :, None]) * jnp.ones(3)
    out = _verify.keep_accepted_states({**pools, per_position("s"): steps, per_position("f"): steps[0]},
                                       (layered, flat), jnp.array([4, 0, -1]), index)
    assert set(out) == {"s", "f"}
    s, f = np.asarray(out["s"])[..., 0], np.asarray(out["f"])[..., 0]
    assert s.tolist() == [[10 + 3, -1, -1, -1, 2], [110 + 3, -1, -1, -1, 102]]
    assert f.tolist() == [13, -1, -1, -1, 2]
    with pytest.raises(ExportError, match="dropped pool 's@positions'"):
        _verify.keep_accepted_states(pools, (layered,), jnp.array([4, 0, -1]), index)


def _weights():
    rng = np.random.default_rng(11)
    return {"embed": jnp.asarray(rng.standard_normal((V, E)), jnp.float32),
            "mix": jnp.asarray(rng.standard_normal((E, E)) / np.sqrt(E), jnp.float32),
            "head": jnp.asarray(rng.standard_normal((E, V)) * 3, jnp.float32)}


def _recur(w, h, x):
    """One token of the toy's recurrence: h' = 0.5 h + tanh(x @ mix)."""
    return 0.5 * h + jnp.tanh(x @ w["mix"])


def _hidden(w, pools, inputs):
    """Every token's state [B, T, E] (also the hidden state the head reads), each row from its slot (zeros at
    position 0 and for an empty row); the state after each token also into the verify call's per-position buffer
    when it gives one."""
    state = pools["state"]
    index = jnp.where(inputs.state_slots < 0, state.shape[0], inputs.state_slots)
    h = jnp.where(jnp.any(inputs.positions == 0, axis=1)[:, None], 0.0,
                  state.at[index].get(mode="fill", fill_value=0.0))

    def token(h, xs):
        x_t, live_t = xs
        h = jnp.where(live_t[:, None], _recur(w, h, x_t), h)
        return h, h

    h, every = lax.scan(token, h, (w["embed"][inputs.token_ids].swapaxes(0, 1), (inputs.positions >= 0).T))
    out = {"state": state.at[index].set(h, mode="drop")}
    if per_position("state") in pools:
        out[per_position("state")] = every.swapaxes(0, 1)
    return every.swapaxes(0, 1), out


def _head(w, x):
    return x @ w["head"]


def _by_hand(w, prompt, n):
    """The recurrence over the prompt and then its own greedy ids, one token at a time, no pools."""
    ids, h = list(prompt), jnp.zeros(E)
    for i in range(len(prompt) + n - 1):
        h = _recur(w, h, w["embed"][ids[i]])
        if i >= len(prompt) - 1:
            ids.append(int(jnp.argmax(_head(w, h))))
    return ids[len(prompt):]


def _speculated(tmp_path, w) -> tuple[list[list[int]], dict]:
    """The toy staged with verify entries and served with n-gram speculation: PROMPTS alone, then batched."""
    m = tlaloc_jax.stage(SplitStep(_hidden, _head, state_positions=True), w, {"state": tlaloc_jax.StateSlots((E,))},
                         tmp_path / "art", progress=False, model=ModelInfo(name="toy", embedding_slot="embed"),
                         features=Features(speculative_tokens=K), **LADDER)
    assert sum(e.kind == af.EntryKind.VERIFY for e in m.entries) == 2
    with Engine.load(tmp_path / "art", cache_dir=tmp_path / "cache", progress=False, speculative_config=NGRAM) as eng:
        got = [eng.generate([p], 16)[0] for p in PROMPTS] + eng.generate(PROMPTS, 16)
        return got, eng.stats()


def test_an_authored_recurrent_step_speculates_exactly(tmp_path):
    """A state pool without layers (a Mamba-style recurrence): the ids with n-gram speculation, alone and batched,
    equal the recurrence run by hand (and the artifact's without speculation); drafts are accepted and others
    rejected on the way, so a state after a rejected draft would show."""
    w = _weights()
    want = [_by_hand(w, p, 16) for p in PROMPTS]
    got, st = _speculated(tmp_path, w)
    assert got == want + want
    with Engine.load(tmp_path / "art", cache_dir=tmp_path / "cache", progress=False) as eng:
        assert eng.generate(PROMPTS, 16) == want
    assert st["verify_calls"] > 0
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]


def test_control_keeping_the_state_after_the_last_draft_changes_the_ids(tmp_path, monkeypatch):
    """The toy staged with a verify body that keeps the state after each row's last drafted token, accepted or not:
    its ids are no longer the recurrence's, so the equality above can fail."""
    monkeypatch.setattr(_verify, "accepted_index",
                        lambda positions, accepted: jnp.full_like(accepted, positions.shape[1] - 1))
    w = _weights()
    got, st = _speculated(tmp_path, w)
    assert st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    assert got != [_by_hand(w, p, 16) for p in PROMPTS] * 2


def test_a_state_step_without_per_position_states_is_refused_by_name(tmp_path):
    w = _weights()
    with pytest.raises(ExportError, match=r"state pools \(Mamba, gated delta\).*SplitStep\(\.\.\., state_positions"):
        tlaloc_jax.stage(SplitStep(_hidden, _head), w, {"state": tlaloc_jax.StateSlots((E,))}, tmp_path / "art",
                         progress=False, features=Features(speculative_tokens=K), **LADDER)
    assert not (tmp_path / "art").exists()
