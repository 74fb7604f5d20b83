"""Speculative decoding with a draft model (issue 60: vLLM's method "draft_model", serve/draft_model.py): a second
artifact of the same vocabulary, run by the same engine, drafts k greedy tokens per sequence, the step's sequences
in one batch, and the target's verify entries accept as for n-gram drafts.

Greedy ids with a draft model equal those without (a tiny llama target; a one-layer llama draft, and the target as
its own draft), alone, batched, sharing a prefix (prefix caching) and crowding a small pool (preempted). A draft that
is the target has every draft accepted, which holds only if the draft's KV pages and positions are right; the
control, a draft that skips the first token it has not read, has fewer accepted. Refused at start by name: a missing
draft artifact, another vocabulary or tokenizer, a draft with state pools."""

from __future__ import annotations

import dataclasses

import pytest
from hf_models import build_checkpoint
from test_speculative import BLOCK, CONTEXT, K, LADDER, _cases, _runs, artifact_runs
from test_speculative_sampled import GREEDY, ROWS, SAMPLED, _batch
from test_speculative_sampled import artifact, without  # noqa: F401  (the fixtures: an artifact with a sampler)
from test_speculative_state import LADDER as TOY_LADDER
from test_speculative_state import E, _head, _hidden, _weights

import tlaloc_jax
from tlaloc_jax import Features, ModelInfo, SplitStep
from tlaloc_jax import artifact as af
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.serve import Engine, draft_model
from tlaloc_jax.serve.speculative import SpeculativeConfigError, parse_speculative_config

pytestmark = [pytest.mark.numeric, pytest.mark.every_draft]

assert (BLOCK, CONTEXT) == (8, 64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny llama target with verify entries of K drafts and a one-layer llama draft of its vocabulary; each pool
    small enough to preempt a crowd."""
    out = tmp_path_factory.mktemp("draft-model")
    target = export_checkpoint(build_checkpoint(out / "ck", "llama", seed=47), out / "target", num_blocks=24,
                               speculative_tokens=K, **LADDER)
    export_checkpoint(build_checkpoint(out / "small-ck", "llama", seed=5, num_hidden_layers=1), out / "small",
                      num_blocks=24, **LADDER)
    return target, out


def _draft(pair, which: str) -> dict:
    return {"method": "draft_model", "model": str(pair[1] / which), "num_speculative_tokens": K}


def _served(pair, cache, which: str) -> tuple[dict, dict, dict]:
    """_runs of the target with the draft `which` (the target itself or the small one) -> (ids, stats, the draft's
    stats); every page of both models back at the end."""
    with Engine.load(pair[1] / "target", cache_dir=cache, progress=False, speculative_config=_draft(pair, which)) as eng:
        got = _runs(eng)
        st = eng.stats()
        proposer = eng.scheduler.proposer
        assert isinstance(proposer, draft_model.DraftModelProposer)
        assert not proposer.seqs and all(p.in_use == 0 for p in proposer.kv.pools.values())
        assert st["pages_in_use"] == 0
        return got, st, dict(proposer.stats)


@pytest.mark.parametrize("which", ["small", "target"])
def test_greedy_ids_with_a_draft_model_equal_those_without(pair, serve_cache_dir, which):
    """Alone, batched, sharing a 24-token prefix and a crowd of eight on 24 pages: the same ids with the draft model's
    drafts as without, verify calls run, sequences preempted and prefixes reused; the draft ran several sequences a
    call. The small random draft seldom agrees with the target (its rows mostly reject); the target as its own draft
    always does."""
    got, st, drafted = _served(pair, serve_cache_dir, which)
    want = artifact_runs((pair[0], pair[1] / "target"), serve_cache_dir)
    for case in _cases():
        assert got[case] == want[case], case
    assert st["preemptions"] > 0 and got["shared_hits"] >= 7 * 24
    assert st["verify_calls"] > 0 and st["spec_decode_num_draft_tokens"] > 0
    assert drafted["failures"] == 0 and drafted["rows"] > drafted["calls"] > 0
    if which == "target":
        assert st["spec_decode_num_accepted_tokens"] > 0


def _acceptance(pair, cache) -> tuple[int, int, int, list[int]]:
    """The batched case with the target as its own draft -> (verify rows, drafted, accepted, accepted per
    position)."""
    prompts, n = _cases()["batched"]
    with Engine.load(pair[1] / "target", cache_dir=cache, progress=False,
                     speculative_config=_draft(pair, "target")) as eng:
        assert eng.generate(prompts, n) == artifact_runs((pair[0], pair[1] / "target"), cache)["batched"]
        st = eng.stats()
    return (st["spec_decode_num_drafts"], st["spec_decode_num_draft_tokens"], st["spec_decode_num_accepted_tokens"],
            st["spec_decode_num_accepted_tokens_per_pos"])


def test_the_target_as_its_own_draft_has_every_draft_accepted(pair, serve_cache_dir, monkeypatch):
    """Acceptance 1.0: the draft reads each sequence's unseen tokens at their positions over its own pages and drafts
    what the target computes. Control: a draft that takes the first token it has not read as read (its page keeps
    what a rejected or unwritten position held) drafts other tokens, and fewer are accepted."""
    rows, drafted, accepted, per = _acceptance(pair, serve_cache_dir)
    assert drafted > rows > 0 and accepted == drafted and per[0] == rows
    real = draft_model.seen_prefix
    monkeypatch.setattr(draft_model, "seen_prefix", lambda read, tokens: real(read, tokens) + 1)
    rows, drafted, accepted, per = _acceptance(pair, serve_cache_dir)
    assert drafted > 0 and accepted < drafted


def test_speculative_config_names_the_draft_model_as_vllm_does():
    cfg = parse_speculative_config({"method": "draft_model", "model": "d", "num_speculative_tokens": 2})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "d", 2)
    assert parse_speculative_config({"model": "d", "num_speculative_tokens": 2}) == cfg     # the method inferred
    for bad, word in (({"method": "draft_model", "num_speculative_tokens": 2}, "needs the draft artifact"),
                      ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
                      ({"model": "d"}, "num_speculative_tokens must be")):
        with pytest.raises(SpeculativeConfigError, match=word):
            parse_speculative_config(bad)


def test_a_draft_is_refused_by_name_at_start(pair, serve_cache_dir, tmp_path):
    """A missing artifact, another vocabulary, another tokenizer and a draft with a state pool: each refused by name
    before the target compiles."""
    load = dict(cache_dir=serve_cache_dir, progress=False)
    with pytest.raises(SpeculativeConfigError, match="'.*nowhere' is not a tlaloc artifact"):
        Engine.load(pair[1] / "target", speculative_config={"model": str(tmp_path / "nowhere"),
                                                            "num_speculative_tokens": K}, **load)
    export_checkpoint(build_checkpoint(tmp_path / "ck", "llama", seed=5, num_hidden_layers=1, vocab_size=128),
                      tmp_path / "vocab", **LADDER)
    with pytest.raises(SpeculativeConfigError, match="vocabulary has 128 tokens, the target's 256"):
        Engine.load(pair[1] / "target", speculative_config={"model": str(tmp_path / "vocab"),
                                                            "num_speculative_tokens": K}, **load)
    # The tiny draft lists no tokenizer files; a target listing one differs.
    listing = dataclasses.replace(pair[0], tokenizer_files=(af.TokenizerFile("tokenizer.json", "0" * 64),))
    with pytest.raises(SpeculativeConfigError, match=r"tokenizer differs from the target's \(files \['tokenizer.json'"):
        draft_model.read_draft(parse_speculative_config(_draft(pair, "small")), listing, None, False)
    tlaloc_jax.stage(SplitStep(_hidden, _head, state_positions=True), _weights(), {"state": tlaloc_jax.StateSlots((E,))},
                     tmp_path / "toy", progress=False, model=ModelInfo(name="toy", embedding_slot="embed"),
                     features=Features(speculative_tokens=K), **TOY_LADDER)
    with pytest.raises(SpeculativeConfigError, match=r"pools \['state'\] \(recurrent state"):
        Engine.load(pair[1] / "target", speculative_config={"model": str(tmp_path / "toy"),
                                                            "num_speculative_tokens": K}, **load)


def test_a_failing_draft_model_leaves_the_target_decoding(pair, serve_cache_dir):
    """A draft call that fails drafts nothing for the step and gives back the draft's pages; the target's ids are
    those without speculation and no request fails."""
    prompts, n = _cases()["batched"]
    with Engine.load(pair[1] / "target", cache_dir=serve_cache_dir, progress=False,
                     speculative_config=_draft(pair, "target")) as eng:
        proposer = eng.scheduler.proposer

        def broken(*args, **kwargs):
            raise RuntimeError("the draft's device is gone")
        proposer.runner.run = broken
        assert eng.generate(prompts, n) == artifact_runs((pair[0], pair[1] / "target"), serve_cache_dir)["batched"]
        st = eng.stats()
    assert proposer.stats["failures"] > 0 and st["spec_decode_num_draft_tokens"] == 0 and st["requests_failed"] == 0
    assert not proposer.seqs and all(p.in_use == 0 for p in proposer.kv.pools.values())


def test_sampled_rows_draft_with_a_draft_model_and_stay_exact(artifact, serve_cache_dir, without):  # noqa: F811
    """test_speculative_sampled's batch on its artifact with a sampler, drafted by that artifact itself (the draft's
    calls pass the sampler's neutral inputs: greedy). Greedy, penalised, biased and min_tokens rows give the ids they
    give without speculation; seeded sampled rows draft and have drafts accepted. The draft is greedy, so its
    proposal is one-hot: the case whose distribution tests/ops/test_rejection_sampler.py checks."""
    cfg = {"method": "draft_model", "model": str(artifact), "num_speculative_tokens": K}
    got, calls, st = _batch(artifact, serve_cache_dir, cfg)
    for name in GREEDY:
        assert got[name] == without[name], name
    assert got["sampled_0"] != got["sampled_1"]
    assert st["accepted"]["greedy"] > 0 and all(st["accepted"][name] for name in SAMPLED)
    drafted = {name for name, (_, sp) in ROWS.items() if any(sp in c for c in calls)}
    assert set(SAMPLED) <= drafted
