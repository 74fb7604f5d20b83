"""Speculative decoding (issue 60, first slice): verify entries (export --speculative-tokens), the n-gram proposer
and greedy acceptance (serve/speculative.py, export/_verify.py).

Greedy ids with speculation equal those without, for Llama, Qwen3, Gemma 3 (sliding window, a ring of pages), Qwen3.5
(gated delta state pools: the verify call keeps the state after the last accepted draft) and DeepSeek-V3 (latent
attention): prompts alone, batched, sharing a prefix (prefix caching) and crowding a small pool (preempted); drafts are
accepted on the way (the models loop, as tiny random models do), and a copy-heavy prompt accepts drafts. Also:
stop ids and max_tokens are never passed, the logprobs are those of the emitted tokens, no unit is left past a
sequence's length, the body's acceptance against a reference, the proposer, vLLM's config and its refusals, and the
metrics. Controls: a body that accepts one mismatching draft changes the ids; so does a hybrid's body that keeps the
state after the last drafted token rather than the last accepted one."""

from __future__ import annotations

import json
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
from prometheus_client import generate_latest

from hf_models import build_checkpoint
from tlaloc_jax import artifact as af
from tlaloc_jax.export import _verify, export_checkpoint
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.serve import Engine, speculative
from tlaloc_jax.serve.core.paging import pages_for
from tlaloc_jax.serve.host_sampling import Sampling
from tlaloc_jax.serve.metrics import Metrics
from tlaloc_jax.serve.speculative import (BACKOFF_GROWTH, BACKOFF_TOKENS, MIN_ACCEPTANCE, MIN_DRAFTS, SpecState,
                                          SpeculativeConfig, SpeculativeConfigError, parse_speculative_config,
                                          propose_ngram)

pytestmark = [pytest.mark.numeric, pytest.mark.every_draft]

BLOCK, CONTEXT, K = 8, 64, 3
FAMILIES = ("llama", "qwen3", "gemma3_text", "qwen3_5_text", "deepseek_v3")
LADDER = dict(batch_ladder=(1, 2, 4, 8), context_ladder=(CONTEXT,), block_size=BLOCK, prefill_chunk=8,
              prefill_long_chunk=16, progress=False)
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# A prompt that repeats itself: its continuation copies it, so the proposer's drafts are accepted.
COPY = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7]


def _prompts(n: int, shared: list[int] | None = None) -> list[list[int]]:
    return [(shared or []) + [(7 * i + j * 5) % 250 + 3 for j in range(3 + (5 * i) % 19)] for i in range(n)]


def accepted_reference(greedy, token_ids, positions) -> list[int]:
    """Per row, the drafts (tokens after the row's first) the greedy tokens confirm, one position at a time."""
    out = []
    for g, t, p in zip(np.asarray(greedy), np.asarray(token_ids), np.asarray(positions)):
        first = int(np.argmax(p >= 0)) if (p >= 0).any() else len(p)
        n = 0
        while first + n + 1 < len(t) and g[first + n] == t[first + n + 1]:
            n += 1
        out.append(n)
    return out


def test_the_bodys_acceptance_is_the_longest_matching_prefix():
    """accepted_drafts against the reference: hand-worked rows (all, none, a prefix, a match after a mismatch that
    does not count, a short right-aligned row, an empty row) and random rows of a 3-token vocabulary."""
    greedy = np.array([[5, 6, 7, 9], [1, 6, 7, 9], [5, 6, 0, 9], [5, 0, 7, 9], [0, 5, 6, 1], [0, 0, 0, 0]])
    tokens = np.array([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [0, 3, 5, 2], [0, 0, 0, 0]])
    positions = np.array([[10, 11, 12, 13]] * 4 + [[-1, 20, 21, 22], [-1, -1, -1, -1]])
    want = [3, 0, 2, 1, 1, 0]
    assert accepted_reference(greedy, tokens, positions) == want
    got = _verify.accepted_drafts(jnp.asarray(greedy), jnp.asarray(tokens), jnp.asarray(positions))
    assert np.asarray(got).tolist() == want
    rng = np.random.default_rng(3)
    for _ in range(20):
        g, t = rng.integers(0, 3, (6, 5)), rng.integers(0, 3, (6, 5))
        n = rng.integers(0, 6, 6)
        p = np.where(np.arange(5)[None] >= 5 - n[:, None], 7, -1)
        assert np.asarray(_verify.accepted_drafts(jnp.asarray(g), jnp.asarray(t), jnp.asarray(p))).tolist() == \
            accepted_reference(g, t, p)


def test_the_ngram_proposer_takes_the_longest_latest_match():
    toks = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    assert propose_ngram(toks, 2, 2, 3) == [4, 9]          # [1, 2, 3] at 0, not [2, 3] at 5
    assert propose_ngram(toks, 3, 2, 2) == [5, 1, 2]       # [2, 3]: its latest earlier occurrence, at 5
    assert propose_ngram(toks, 5, 1, 3) == [4, 9, 2, 3, 5]
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []
    assert propose_ngram([4, 4], 3, 1, 1) == [4]            # the drafts stop at the sequence's end
    assert propose_ngram([1, 2, 3, 1, 2], 2, 3, 4) == []     # no 3-gram occurs twice


def test_speculative_config_is_vllms_json_and_refuses_by_name():
    assert parse_speculative_config(json.dumps(NGRAM)) == SpeculativeConfig(K, 2, 4)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}) == SpeculativeConfig(2, 5, 5)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}) == \
        SpeculativeConfig(2, 3, 3)
    assert parse_speculative_config(None) is None
    assert parse_speculative_config({**NGRAM, "disable_by_batch_size": 4}) == \
        SpeculativeConfig(K, 2, 4, disable_by_batch_size=4)
    for name in ("deepseek_mtp", "qwen3_next_mtp", "mtp"):      # vLLM's names for MTP heads (serve/mtp_proposer.py)
        assert parse_speculative_config({"method": name, "num_speculative_tokens": 2}) == \
            SpeculativeConfig(2, method="mtp")
    for bad, word in (({**NGRAM, "speculative_disable_by_batch_size": 4}, "speculative_disable_by_batch_size"),
                      ({**NGRAM, "method": "magic"}, "'magic' is not known"),
                      ({**NGRAM, "method": "eagle"}, "EAGLE heads are not built yet"),
                      ({**NGRAM, "method": "medusa"}, "Medusa heads are not built yet"),
                      ({**NGRAM, "method": "deepseek_mtp"}, "not n-grams; leave them out"),
                      ({**NGRAM, "method": "draft_model"}, "'draft_model' needs the draft artifact's directory"),
                      ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
                      ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size must be a positive"),
                      ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min 5 is larger"),
                      ("{not json", "not JSON"), ([1], "JSON object")):
        with pytest.raises(SpeculativeConfigError, match=word):
            parse_speculative_config(bad if isinstance(bad, (str, list)) else dict(bad))


# qwen3 differs from llama only in its q/k norms, and Qwen3.5 and DeepSeek-V3 cost minutes each: their runs are slow
# checks (make test-slow); llama and gemma3's window (ring pages under rejected drafts) stay in make test, and
# tests/serving/test_speculative_state.py keeps a recurrent state pool there.
SLOW = ("qwen3", "qwen3_5_text", "deepseek_v3")


def _families(*names: str) -> list:
    return [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in names]


@pytest.fixture(scope="module", params=_families(*FAMILIES))
def artifact(request, tmp_path_factory):
    """A tiny checkpoint's artifact with verify entries of K drafts, its pool small enough to preempt a crowd."""
    out = tmp_path_factory.mktemp(f"spec-{request.param}")
    ck = build_checkpoint(out / "ck", request.param, seed=47)
    return export_checkpoint(ck, out / "art", num_blocks=24, speculative_tokens=K, **LADDER), out / "art"


def _generate(eng: Engine, prompts, n: int, stop=()) -> list[list[int]]:
    """eng.generate, checking after every step that no decoding sequence holds a page past its length."""
    rids = [eng.add_request(p, n, stop) for p in prompts]
    while eng.has_unfinished():
        eng.step()
        for s in eng.scheduler.running:
            if s.decoding and af.PoolKind.PAGED_KV in s.held:
                assert len(s.held[af.PoolKind.PAGED_KV]) <= pages_for(s.length, BLOCK), s.rid
    out = [eng.output(r) for r in rids]
    for r in rids:
        assert eng.request_info(r).finish_reason != "error", eng.request_info(r).error
        eng.release(r)
    return out


def _cases() -> dict[str, tuple[list[list[int]], int]]:
    """Each case's prompts and max_tokens: alone (one at a time), batched, sharing a 24-token prefix, a crowd."""
    alone, shared = _prompts(4) + [COPY], _prompts(8, [(i * 13 + 7) % 250 + 3 for i in range(24)])
    return dict(alone=(alone, 12), batched=(alone, 20), shared=(shared, 12), crowd=(_prompts(8), 30))


def _runs(eng: Engine) -> dict:
    out = {}
    for case, (prompts, n) in _cases().items():
        before = eng.stats()["prefix_hits"]
        out[case] = [_generate(eng, [p], n)[0] for p in prompts] if case == "alone" else _generate(eng, prompts, n)
        out[f"{case}_hits"] = eng.stats()["prefix_hits"] - before
    return out


def _check_runs(artifact, serve_cache_dir) -> dict:
    """_runs without and with speculation (NGRAM, through whatever proposer serve.speculative has): the same ids
    in every case, preemptions, prefix hits where caching is on, verify calls run, every page back. -> stats."""
    m, path = artifact
    assert sum(e.kind == af.EntryKind.VERIFY for e in m.entries) == 4
    assert all(e.tokens_per_seq == K + 1 for e in m.entries if e.kind == af.EntryKind.VERIFY)
    with Engine.load(path, cache_dir=serve_cache_dir, progress=False, speculative_config=NGRAM) as eng:
        got = _runs(eng)
        st = eng.stats()
    for case in _cases():
        assert got[case] == artifact_runs(artifact, serve_cache_dir)[case], case
    assert st["preemptions"] > 0
    # A ring of pages (Gemma 3's window) is not reused exactly: prefix caching is off there.
    assert st["prefix_caching"] == (m.ring is None)
    assert got["shared_hits"] >= 7 * 24 * st["prefix_caching"]
    assert st["verify_calls"] > 0 and st["spec_decode_num_accepted_tokens"] > 0
    assert st["pages_in_use"] == 0 and all(p["pages_in_use"] == 0 for p in st["pools"].values())
    per = st["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per) == K and sum(per) == st["spec_decode_num_accepted_tokens"] and per == sorted(per, reverse=True)
    return st


_PLAIN_RUNS: dict = {}


def artifact_runs(artifact, serve_cache_dir) -> dict:
    """_runs of the artifact without speculation, once per artifact."""
    if artifact[1] not in _PLAIN_RUNS:
        with Engine.load(artifact[1], cache_dir=serve_cache_dir, progress=False) as eng:
            _PLAIN_RUNS[artifact[1]] = _runs(eng)
    return _PLAIN_RUNS[artifact[1]]


# Here llama's run is slow too (its control below and test_paying_drafts serve llama with drafts in make test).
@pytest.mark.parametrize("artifact", [pytest.param("llama", marks=pytest.mark.slow),
                                      *_families("qwen3", "gemma3_text")], indirect=True)
def test_greedy_ids_with_speculation_equal_those_without(artifact, serve_cache_dir):
    """Alone, batched, sharing a 24-token prefix (prefix caching, where no ring turns it off) and a crowd of eight
    on 24 pages (preempted): the same ids with n-gram speculation as without, with drafts accepted and verify calls
    run; no sequence holds a page past its length after a verify call, and every page comes back. (Tiny random
    Qwen3.5 and DeepSeek-V3 models seldom repeat an n-gram: the next test drafts for them.)"""
    _check_runs(artifact, serve_cache_dir)


def oracle(want: dict, vocab: int):
    """A proposer that knows each _cases prompt's greedy continuation (want) and drafts it with draft j wrong,
    j = the sequence's length mod k + 1 (none wrong when j = k): every count of accepted drafts, 0 to k, occurs."""
    full = [p + w for case, (prompts, _) in _cases().items() for p, w in zip(prompts, want[case])]

    def propose(tokens, k, lookup_min, lookup_max):
        tokens = list(tokens)
        for f in full:
            if len(f) > len(tokens) and f[:len(tokens)] == tokens:
                drafts, wrong = f[len(tokens):len(tokens) + k], len(tokens) % (k + 1)
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % vocab
                return drafts
        return []
    return propose


def test_greedy_ids_with_drafts_right_and_wrong_equal_those_without(artifact, serve_cache_dir, monkeypatch):
    """The cases above with drafts from a proposer that knows the continuation and gets one draft wrong in turn, for
    every family: 0 to K drafts accepted, so a state pool (Qwen3.5) must keep the state after each count of them, and
    latent attention's pages (DeepSeek-V3) hold rejected drafts; the same ids as without speculation."""
    monkeypatch.setattr(speculative, "propose_ngram", oracle(artifact_runs(artifact, serve_cache_dir),
                                                             artifact[0].model.vocab))
    st = _check_runs(artifact, serve_cache_dir)
    assert st["spec_decode_num_accepted_tokens_per_pos"][K - 1] > 0
    assert st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]


def _engine(artifact, cache, **kw) -> Engine:
    return Engine.load(artifact[1], cache_dir=cache, progress=False, **kw)


@pytest.fixture
def copying(artifact, serve_cache_dir) -> list[int]:
    """A copy-heavy prompt for this model: one of _prompts' followed by the first 12 tokens of its greedy
    continuation, the one whose next 12 tokens the proposer foresees most often (a tiny random model's continuation
    falls into a loop, which its own context then holds)."""
    with _engine(artifact, serve_cache_dir) as eng:
        runs = [(p, eng.generate([p], 24)[0]) for p in _prompts(8)]
    foreseen = [sum(propose_ngram(p + g[:12 + i], 1, 2, 4) == [g[12 + i]] for i in range(12)) for p, g in runs]
    best = int(np.argmax(foreseen))
    assert foreseen[best] >= 6, foreseen
    return runs[best][0] + runs[best][1][:12]


@pytest.mark.parametrize("artifact", ["llama"], indirect=True)
def test_a_copy_heavy_prompt_accepts_drafts_and_takes_fewer_calls(artifact, serve_cache_dir, copying):
    """A copy-heavy prompt alone: its continuation's drafts are accepted (a verify call emits the accepted drafts
    and one token more) and its 24 tokens take fewer calls than without speculation; a sequence whose drafts were
    not accepted stops drafting."""
    with _engine(artifact, serve_cache_dir, use_decode_steps=False) as eng:
        want = eng.generate([copying], 24)
        plain_calls = eng.stats()["executions"]
    with _engine(artifact, serve_cache_dir, use_decode_steps=False, speculative_config=NGRAM) as eng:
        assert eng.generate([copying], 24) == want
        st = eng.stats()
    assert st["spec_decode_num_accepted_tokens"] > 0 and st["verify_calls"] > 0
    assert st["executions"] < plain_calls
    # A sequence with none of its first MIN_DRAFTS drafts accepted drafts no more.
    with _engine(artifact, serve_cache_dir, use_decode_steps=False, speculative_config=NGRAM) as eng:
        rid = eng.add_request(copying, 24)
        eng.request_info(rid).spec.drafted = MIN_DRAFTS
        while eng.has_unfinished():
            eng.step()
        assert eng.output(rid) == want[0] and eng.stats()["spec_decode_num_drafts"] == 0



@pytest.mark.parametrize("artifact", ["llama"], indirect=True)
def test_disable_by_batch_size_turns_drafting_off_while_that_many_run(artifact, serve_cache_dir, copying):
    """vLLM's disable_by_batch_size 2: the copy-heavy prompt alone drafts; two of it running side by side draft
    nothing, and give the ids they give without speculation."""
    with _engine(artifact, serve_cache_dir, use_decode_steps=False) as eng:
        want = eng.generate([copying, copying], 24)
    config = {**NGRAM, "disable_by_batch_size": 2}
    with _engine(artifact, serve_cache_dir, use_decode_steps=False, speculative_config=config) as eng:
        assert eng.generate([copying], 24) == want[:1]
        alone = eng.stats()["spec_decode_num_drafts"]
        assert alone > 0
        assert eng.generate([copying, copying], 24) == want
        assert eng.stats()["spec_decode_num_drafts"] == alone


def test_a_verify_call_accepting_nothing_pauses_drafting_longer_each_time_in_a_row():
    """SpecState's back-off: a call accepting none of its drafts pauses drafting BACKOFF_TOKENS tokens, the next in a
    row BACKOFF_GROWTH times longer; a call accepting any ends the run of misses; a call with no drafts changes
    nothing; a sequence with few of MIN_DRAFTS drafts accepted stops for good."""
    st = SpecState()
    assert st.may_draft(1)
    st.verified(3, 0, 1)
    assert not st.may_draft(1 + BACKOFF_TOKENS - 1) and st.may_draft(1 + BACKOFF_TOKENS)
    st.verified(3, 0, 20)
    assert not st.may_draft(20 + BACKOFF_TOKENS * BACKOFF_GROWTH - 1)
    assert st.may_draft(20 + BACKOFF_TOKENS * BACKOFF_GROWTH)
    st.verified(3, 3, 60)
    st.verified(0, 0, 61)
    assert st.may_draft(61)
    st.verified(3, 0, 62)
    assert st.may_draft(62 + BACKOFF_TOKENS) and (st.drafted, st.accepted) == (12, 3)
    low = SpecState(drafted=MIN_DRAFTS, accepted=int(MIN_ACCEPTANCE * MIN_DRAFTS) - 1)
    assert not low.may_draft(10 ** 6)


@pytest.mark.parametrize("artifact", ["llama"], indirect=True)
def test_a_sequence_whose_drafts_are_never_accepted_backs_off(artifact, serve_cache_dir, monkeypatch):
    """A proposer whose first draft is always wrong: the sequence drafts after its 1st token and then only where the
    back-off lets it (after 1 + BACKOFF_TOKENS, then BACKOFF_GROWTH times that many more), so 48 tokens take three
    verify calls rather than one a token until MIN_DRAFTS drafts; the ids are plain decoding's."""
    prompt = _prompts(1)[0]
    with _engine(artifact, serve_cache_dir) as eng:
        want = eng.generate([prompt], 48)[0]
    full, asked = prompt + want, []

    def wrong(tokens, k, lookup_min, lookup_max):
        asked.append(len(tokens) - len(prompt))
        return [(full[len(tokens)] + 1) % artifact[0].model.vocab] * k
    monkeypatch.setattr(speculative, "propose_ngram", wrong)
    with _engine(artifact, serve_cache_dir, speculative_config=NGRAM) as eng:
        assert eng.generate([prompt], 48)[0] == want
        st = eng.stats()
    assert asked == [1, 1 + BACKOFF_TOKENS, 1 + BACKOFF_TOKENS * (1 + BACKOFF_GROWTH)]
    assert st["verify_calls"] == 3 and st["spec_decode_num_accepted_tokens"] == 0


@pytest.mark.parametrize("artifact", ["llama"], indirect=True)
def test_a_row_without_drafts_rides_in_the_verify_call_of_a_row_with_them(artifact, serve_cache_dir, monkeypatch):
    """Two sequences decoding together, drafts (right ones) for the first only: each step it drafts runs one verify
    call holding both rows, not a verify call and a decode call, and the ids are plain decoding's. Control: with
    riding refused (Scheduler._may_ride) the same steps run both calls."""
    from tlaloc_jax.serve.core.scheduler import Scheduler
    prompts = _prompts(2)
    with _engine(artifact, serve_cache_dir) as eng:
        want = eng.generate(prompts, 24)
    full = prompts[0] + want[0]

    def first_only(tokens, k, lookup_min, lookup_max):
        tokens = list(tokens)
        return full[len(tokens):len(tokens) + k] if full[:len(tokens)] == tokens else []
    monkeypatch.setattr(speculative, "propose_ngram", first_only)

    def both_calls() -> int:
        """Steps of the run that ran a verify call and a decode call (asserting the ids)."""
        with _engine(artifact, serve_cache_dir, speculative_config=NGRAM) as eng:
            rids, both = [eng.add_request(p, 24) for p in prompts], 0
            while eng.has_unfinished():
                before = eng.stats()
                eng.step()
                after = eng.stats()
                both += all(after[c] > before[c] for c in ("verify_calls", "decode_calls"))
            assert [eng.output(r) for r in rids] == want and after["spec_decode_num_accepted_tokens"] > 0
            return both
    assert both_calls() == 0
    monkeypatch.setattr(Scheduler, "_may_ride", lambda self, s: False)
    assert both_calls() > 0

@pytest.mark.parametrize("artifact", ["llama"], indirect=True)
def test_stop_ids_and_max_tokens_are_never_passed_and_logprobs_are_the_emitted_tokens(artifact, serve_cache_dir,
                                                                                      copying):
    """A stop id the copy prompt's continuation reaches ends it there, though a draft ran past it; max_tokens cuts a
    draft short. Each emitted token's logprob (and its top logprobs) is that token's under transformers' log_softmax
    of the served sequence, within the tolerance model (as tests/serving/test_openai_parity.py bounds it: a logit
    moves by at most D = logit_bound * max |logit|, a log_softmax entry by 2 D plus its own roundings)."""
    import tlaloc_jax
    import torch
    from hf_models import load_hf_torch
    with _engine(artifact, serve_cache_dir) as eng:
        full = eng.generate([copying], 24)[0]
    stop = full[10]
    with _engine(artifact, serve_cache_dir, speculative_config=NGRAM) as eng:
        assert eng.generate([copying], 24, stop_token_ids=[stop])[0] == full[:full.index(stop) + 1]
        for n in (1, 2, 5, 7):
            assert eng.generate([copying], n)[0] == full[:n]
        events = _logprob_events(eng, copying)
        assert eng.stats()["spec_decode_num_accepted_tokens"] > 0
    got = [e.token for e in events]
    assert got == full[:len(got)]
    ck = artifact[1].parent / "ck"
    cfg = tlaloc_jax.load_hf(ck).config
    with torch.no_grad():
        logits = load_hf_torch(ck)(torch.tensor([copying + got])).logits[0, len(copying) - 1:-1].double().numpy()
    lsm = logits - (logits.max(-1, keepdims=True)
                    + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    logit_bound = tol.bound(tol.decoder_roundings_of(cfg, context=CONTEXT))
    lsm_bound = tol.bound(cfg.vocab_size + 2 * tol.TRANSCENDENTAL_ULPS + 2)
    for k, e in enumerate(events):
        allowed = 2 * logit_bound * np.abs(logits[k]).max() + lsm_bound * np.abs(lsm[k]).max()
        assert abs(e.logprob - lsm[k][e.token]) <= allowed, (k, e.logprob, lsm[k][e.token], allowed)
        order = np.sort(lsm[k])[::-1]
        for i, (tid, v) in enumerate(e.top_logprobs):
            assert abs(v - lsm[k][tid]) <= allowed and lsm[k][tid] >= order[i] - 2 * allowed, (k, i, tid)
    wrong = max(abs(e.logprob - lsm[k + 1][e.token]) for k, e in enumerate(events[:-1]))
    assert wrong > 10 * 2 * logit_bound * np.abs(logits).max(), "control: logprobs one position off pass"


def _logprob_events(eng: Engine, prompt: list[int]) -> list:
    rid = eng.add_request(prompt, 16, sampling=Sampling(logprobs=2))
    events = []
    while eng.has_unfinished():
        events += [e for e in eng.step() if e.request_id == rid]
    eng.release(rid)
    return events


@pytest.mark.parametrize("artifact", ["llama"], indirect=True)
def test_control_a_body_accepting_one_mismatching_draft_changes_the_ids(artifact, serve_cache_dir, monkeypatch,
                                                                        tmp_path, copying):
    """The same checkpoint exported with a verify body whose acceptance skips over one mismatching draft: the ids
    with speculation are no longer those without, so the equality above can fail."""
    real = _verify.accepted_drafts

    def one_more(greedy, token_ids, positions):
        return jnp.minimum(real(greedy, token_ids, positions) + 1, jnp.sum(positions >= 0, axis=1) - 1)
    monkeypatch.setattr(_verify, "accepted_drafts", one_more)
    ck = artifact[1].parent / "ck"
    export_checkpoint(ck, tmp_path / "bad", num_blocks=24, speculative_tokens=K, **LADDER)
    prompts = _prompts(4) + [copying]
    with _engine(artifact, serve_cache_dir) as eng:
        want = eng.generate(prompts, 20)
    with Engine.load(tmp_path / "bad", cache_dir=serve_cache_dir, progress=False, speculative_config=NGRAM) as eng:
        assert eng.generate(prompts, 20) != want


@pytest.mark.parametrize("artifact", _families("qwen3_5_text"), indirect=True)
def test_control_a_hybrid_keeping_the_state_after_the_last_draft_changes_the_ids(artifact, serve_cache_dir,
                                                                               monkeypatch, tmp_path):
    """The hybrid exported with a verify body that keeps each row's state after its last drafted token (what a state
    pool holds when nothing is rolled back), accepted or not: the ids with speculation are no longer those without,
    so the hybrid's equality above can fail."""
    monkeypatch.setattr(_verify, "accepted_index", lambda positions, accepted: jnp.full_like(accepted,
                                                                                           positions.shape[1] - 1))
    export_checkpoint(artifact[1].parent / "ck", tmp_path / "bad", num_blocks=24, speculative_tokens=K, **LADDER)
    want = artifact_runs(artifact, serve_cache_dir)
    monkeypatch.setattr(speculative, "propose_ngram", oracle(want, artifact[0].model.vocab))
    prompts, n = _cases()["batched"]
    with Engine.load(tmp_path / "bad", cache_dir=serve_cache_dir, progress=False, speculative_config=NGRAM) as eng:
        got = eng.generate(prompts, n)
        st = eng.stats()
    assert st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    assert got != want["batched"]


@pytest.mark.parametrize("artifact", ["llama"], indirect=True)
def test_speculation_needs_verify_entries_that_hold_its_drafts(artifact, serve_cache_dir, tmp_path):
    with pytest.raises(SpeculativeConfigError, match="at most 3"):
        _engine(artifact, serve_cache_dir, speculative_config={**NGRAM, "num_speculative_tokens": 4})
    plain = export_checkpoint(artifact[1].parent / "ck", tmp_path / "plain", num_blocks=24, **LADDER)
    assert not any(e.kind == af.EntryKind.VERIFY for e in plain.entries)
    with pytest.raises(SpeculativeConfigError, match="--speculative-tokens 3"):
        Engine.load(tmp_path / "plain", cache_dir=serve_cache_dir, progress=False, speculative_config=NGRAM)


@pytest.mark.parametrize("artifact", ["llama"], indirect=True)
def test_metrics_carry_vllms_spec_decode_counters(artifact, serve_cache_dir, copying):
    with _engine(artifact, serve_cache_dir, speculative_config=NGRAM) as eng:
        eng.generate([copying], 20)
        st = eng.stats()
    metrics = Metrics("tiny")
    metrics.engine.snapshot = dict(st, executions=st["executions"], cold_entries=0)
    text = generate_latest(metrics.registry).decode()
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("vllm:spec_decode")}
    assert lines['vllm:spec_decode_num_draft_tokens_total{model_name="tiny"}'] == st["spec_decode_num_draft_tokens"]
    assert lines['vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"}'] == \
        st["spec_decode_num_accepted_tokens"] > 0
    assert lines['vllm:spec_decode_num_drafts_total{model_name="tiny"}'] == st["spec_decode_num_drafts"]
    per = [lines[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{i}"}}']
           for i in range(K)]
    assert per == st["spec_decode_num_accepted_tokens_per_pos"]


def _verify_and_decode_events(path, cache, prompt: list[int]) -> tuple[list, list]:
    """The events of `prompt`'s 16 greedy tokens (logprobs=2) from decode calls, and from verify calls: a proposer
    that knows the continuation drafts it, so every token after the first comes from a verify call."""
    with Engine.load(path, cache_dir=cache, progress=False, use_decode_steps=False) as eng:
        plain = _logprob_events(eng, prompt)
        assert eng.stats()["verify_calls"] == 0
    want = [e.token for e in plain]
    drafts = mock.patch.object(speculative, "propose_ngram",
                               lambda tokens, k, lo, hi: want[len(tokens) - len(prompt):][:k])
    with drafts, Engine.load(path, cache_dir=cache, progress=False, use_decode_steps=False,
                             speculative_config=NGRAM) as eng:
        spec = _logprob_events(eng, prompt)
        st = eng.stats()
    assert [e.token for e in spec] == want
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"] > 0
    assert st["verify_calls"] == -(-(len(want) - 1) // (K + 1))
    return plain, spec


def _worst_over_bound(ck, prompt: list[int], plain: list, spec: list, shift: int = 0) -> float:
    """The largest |verify logprob - decode logprob| (emitted and top tokens, every token a verify call emitted)
    over its bound: two computations of a logit differ by D = logit_bound * max |logit|, a log_softmax entry by 2 D
    plus its own roundings (the logits' scale from transformers' run of the sequence). shift: the decode events
    compared one position on (a control)."""
    import tlaloc_jax
    import torch
    from hf_models import load_hf_torch
    got = [e.token for e in plain]
    with torch.no_grad():
        logits = load_hf_torch(ck)(torch.tensor([prompt + got])).logits[0, len(prompt) - 1:-1].double().numpy()
    lsm = logits - (logits.max(-1, keepdims=True)
                    + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    cfg = tlaloc_jax.load_hf(ck).config
    logit_bound = tol.bound(tol.decoder_roundings_of(cfg, context=CONTEXT))
    lsm_bound = tol.bound(cfg.vocab_size + 2 * tol.TRANSCENDENTAL_ULPS + 2)
    worst = 0.0
    for k in range(1, len(spec) - shift):
        d, v = plain[k + shift], spec[k]
        allowed = 2 * logit_bound * np.abs(logits[k]).max() + lsm_bound * np.abs(lsm[k]).max()
        pairs = [(v.logprob, d.logprob)] + [(b, a) for (ia, a), (ib, b) in zip(d.top_logprobs, v.top_logprobs)]
        worst = max(worst, *(abs(x - y) / allowed for x, y in pairs))
    return worst


@pytest.mark.parametrize("artifact", ["llama"], indirect=True)
def test_a_verify_call_scores_each_position_as_a_decode_call_does(artifact, serve_cache_dir, copying):
    """Every token a verify call emits has the logprob and top logprobs the decode calls give its position, within the
    tolerance model; the greedy ids are the same. Control: compared one position off, they are far outside it."""
    plain, spec = _verify_and_decode_events(artifact[1], serve_cache_dir, copying)
    ck = artifact[1].parent / "ck"
    assert _worst_over_bound(ck, copying, plain, spec) <= 1.0
    assert _worst_over_bound(ck, copying, plain, spec, shift=1) > 10.0, "control: one position off passes"


@pytest.mark.parametrize("artifact", ["llama"], indirect=True)
def test_verify_entries_run_the_decode_entries_kernels(artifact):
    """A cpu export's verify bodies call the C kernels its decode bodies call (export/_verify.py, SplitStep.verify):
    the projections and the decode attention, each drafted token a row of its own."""
    m, path = artifact
    assert set(m.versions.custom_calls) == {"tlaloc_decode_attention_v1", "tlaloc_projection_v1"}
    for e in m.entries:
        if e.kind in (af.EntryKind.VERIFY, af.EntryKind.DECODE):
            body = (path / e.serialized).read_bytes()
            assert all(target.encode() in body for target in m.versions.custom_calls), e.name
