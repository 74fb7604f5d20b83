"""Prompt logprobs scored in the body (issue 17: `echo` and `prompt_logprobs` from prefill entries that return
per-token logprobs): tlaloc_jax/kernels/scoring.py against its naive form, the scoring prefill entries (manifest
EntryKind.PREFILL_SCORED) against transformers' log_softmax for a prompt longer than one chunk and for prompts
batched together and alone, the openai client's echo + logprobs and vLLM's prompt_logprobs through the server,
the call counts against the token-a-call fallback, and the manifest's checks of the new roles.

Every comparison goes through `check_scores`: a position's logprob within the tolerance model's bound of the
oracle's, its rank and top-N ids equal up to near-ties (an id may differ from the oracle's only where the two
logprobs are within twice the bound). Its control, scores read one position off, must fail."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from http_util import InProcess
from margins import assert_within
from tlaloc_jax import artifact as af
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.serve import Engine, Sampling

MODEL = "scored"
TOP = 4                    # the artifact's scorer: top logprobs per prompt position
CHUNK = 16
# Longer than two chunks; and two prompts of different lengths that share a call.
LONG = [(7 * k + 3) % 250 + 1 for k in range(40)]
PAIR = ([5, 17, 99, 3, 250, 8, 61, 12, 40, 41, 42, 9, 77, 100, 101, 5, 17, 99, 3], [60, 61, 62, 63, 2, 9, 11])


def _lsm(logits):
    x = np.asarray(logits, np.float64)
    top = x.max(-1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))


def check_scores(got, oracle_lsm, targets, allowed, what: str) -> None:
    """got: per scored position (logprob, rank, ((id, logprob), ...)); oracle_lsm [n, V] the oracle's log_softmax
    at those positions, targets [n] the tokens scored, allowed [n] the bound on a logprob's error. Raises
    AssertionError unless each logprob is within its bound, and the rank and the top ids are the oracle's up to
    near-ties (values within 2 x allowed of each other may trade places)."""
    assert len(got) == len(targets), f"{what}: {len(got)} scores for {len(targets)} positions"
    for k, ((lp, rank, top), lsm, t, a) in enumerate(zip(got, oracle_lsm, targets, allowed)):
        assert_within(abs(lp - lsm[t]), a, f"{what} position {k} logprob")
        lo, hi = int(np.sum(lsm > lsm[t] + 2 * a)), int(np.sum(lsm > lsm[t] - 2 * a))
        assert lo <= rank - 1 <= hi, f"{what} position {k}: rank {rank}, the oracle's is within [{lo + 1}, {hi + 1}]"
        order = np.sort(lsm)[::-1]
        ids = [i for i, _ in top]
        assert len(set(ids)) == len(ids), f"{what} position {k}: top ids {ids} repeat"
        for i, (tid, v) in enumerate(top):
            assert_within(abs(v - lsm[tid]), a, f"{what} position {k} top {i} logprob")
            assert lsm[tid] >= order[i] - 2 * a, \
                f"{what} position {k}: top {i} is id {tid} ({lsm[tid]:.4g}); the oracle's {i}-th is {order[i]:.4g}"


# -- the kernel against its naive form ---------------------------------------------------------------------


@pytest.mark.numeric
def test_score_positions_equals_the_naive_form_and_a_shifted_read_fails():
    """Random hidden states and head, blocks of 3 positions (max_elements), targets -1 on padding and on a whole
    block (skipped by the lax.cond): logprobs, ranks and top ids equal the float64 reference's. The bound: the
    head's E-term dot on each logit (relative to the largest |logit|; log_softmax moves by twice that), plus
    log_softmax's own roundings. Control: the same scores read one position off fail the check."""
    import jax
    import jax.numpy as jnp

    from tlaloc_jax.kernels import scoring
    B, T, E, V, N = 2, 9, 24, 50, 5
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(B, T, E)).astype(np.float32)
    head_w = (rng.normal(size=(E, V)) * 0.5).astype(np.float32)
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    targets[:, :3] = -1           # the first block of 3 positions has no target in any row: skipped
    targets[0, 3] = -1            # one position without a target in a scored block
    head = jax.jit(lambda x: jnp.dot(x, head_w, precision=jax.lax.Precision.HIGHEST))
    got = jax.jit(lambda h, t: scoring.score_positions(h, t, head, top_n=N, max_elements=B * 3 * V))(hidden, targets)
    assert scoring.block_positions(B, T, V, B * 3 * V) == 3
    lp, rank, vals, ids = (np.asarray(x) for x in got)
    logits = np.einsum("bte,ev->btv", hidden.astype(np.float64), head_w.astype(np.float64))
    ref = scoring.score_reference(logits, targets, top_n=N)
    lsm = _lsm(logits)
    bound = 2 * tol.bound(E) * np.abs(logits).max() + tol.bound(V + 2 * tol.TRANSCENDENTAL_ULPS + 2) * np.abs(lsm).max()
    for b in range(B):
        live = np.flatnonzero(targets[b] >= 0)
        scores = [(lp[b, t], rank[b, t], tuple(zip(ids[b, t], vals[b, t]))) for t in live]
        check_scores(scores, lsm[b, live], targets[b, live], [bound] * len(live), f"row {b}")
        dead = targets[b] < 0
        assert np.all(lp[b, dead] == 0) and np.all(rank[b, dead] == 0) and np.all(vals[b, dead] == 0)
        assert_within(float(np.abs(lp[b, live] - ref[0][b, live]).max()), bound, f"row {b} against score_reference")
        with pytest.raises(AssertionError):
            check_scores(scores[1:], lsm[b, live[:-1]], targets[b, live[:-1]], [bound] * (len(live) - 1),
                         "control: one position off")


def test_score_reference_on_hand_worked_cases():
    """Probabilities 1/4, 1/4, 1/2: token 0 has logprob ln 1/4 and rank 2; the top two are id 2 (ln 1/2) and, of
    the tied ids 0 and 1, id 0. A target -1 scores nothing."""
    from tlaloc_jax.kernels import scoring
    logits = np.array([[[0.0, 0.0, np.log(2.0)], [5.0, 5.0, 5.0]]])
    lp, rank, vals, ids = scoring.score_reference(logits, np.array([[0, -1]]), top_n=2)
    assert lp[0, 0] == pytest.approx(np.log(0.25)) and rank[0, 0] == 2
    assert ids[0, 0].tolist() == [2, 0] and vals[0, 0] == pytest.approx([np.log(0.5), np.log(0.25)])
    assert lp[0, 1] == 0 and rank[0, 1] == 0 and ids[0, 1].tolist() == [0, 1]


# -- the served scoring entries against transformers -------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(http_artifacts):
    return http_artifacts[0].parent / "ck"          # seeded llama with a tokenizer (tests/support/http_util.py)


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    """Batches 1 and 2, one context of 64, prefill chunks of 16, the sampler and the scorer (top 4)."""
    from tlaloc_jax.export import Sampler, export_checkpoint
    out = tmp_path_factory.mktemp("scored") / "artifact"
    export_checkpoint(checkpoint, out, batch_ladder=(1, 2), context_ladder=(64,), block_size=8, prefill_chunk=CHUNK,
                      prefill_long_chunk=0,
                      num_blocks=32, progress=False, sampler=Sampler(top_logprobs=TOP, logit_bias=1),
                      prompt_logprobs=TOP)
    return out


@pytest.fixture(scope="module")
def engine(artifact, serve_cache_dir):
    with Engine.load(artifact, cache_dir=serve_cache_dir, progress=False) as eng:
        # The scoring entries compile on first use: a server that never scores a prompt never compiles them.
        assert sorted(eng.executables) == sorted(e.name for e in eng.manifest.entries if e.kind != "prefill_scored")
        yield eng


@pytest.fixture(scope="module")
def oracle(checkpoint):
    """prompt -> (transformers' log_softmax at every prompt position [L, V], the bound on each one's error)."""
    import torch

    import tlaloc_jax
    from hf_models import load_hf_torch
    model = load_hf_torch(checkpoint)
    cfg = tlaloc_jax.load_hf(checkpoint).config

    def run(prompt):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float().numpy().astype(np.float64)
        lsm = _lsm(logits)
        logit_bound = tol.bound(tol.decoder_roundings_of(cfg, context=len(prompt)))
        lsm_bound = tol.bound(cfg.vocab_size + 2 * tol.TRANSCENDENTAL_ULPS + 2)
        allowed = 2 * logit_bound * np.abs(logits).max(-1) + lsm_bound * np.abs(lsm).max(-1)
        return lsm, allowed
    return run


def _prompt_logprobs(engine, prompts, k=TOP):
    rids = [engine.add_request(p, 1, sampling=Sampling(logprobs=1, prompt_logprobs=k)) for p in prompts]
    got = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.prompt_logprobs is not None:
                got[ev.request_id] = ev.prompt_logprobs
    for r in rids:
        engine.release(r)
    return [got[r] for r in rids]


def _check_prompt(plp, prompt, oracle, what):
    lsm, allowed = oracle(prompt)
    assert plp[0] is None and len(plp) == len(prompt)
    # Entry k scores prompt[k] by the distribution after prompt[:k].
    check_scores(plp[1:], lsm[:-1], prompt[1:], allowed[:-1], what)


def _scored_calls(engine):
    return sum(n for name, n in engine.stats()["executions_by_entry"].items() if name.startswith("prefill_scored"))


@pytest.mark.numeric
def test_scored_prompt_longer_than_a_chunk_equals_transformers(engine, oracle):
    """A 40-token prompt, three chunks of 16 on the scoring entries: every position's logprob, rank and top 4
    as transformers' log_softmax says. Control: the same scores one position off fail."""
    before = _scored_calls(engine)
    (plp,) = _prompt_logprobs(engine, [LONG])
    assert _scored_calls(engine) - before == -(-len(LONG) // CHUNK), "the prompt was not read in chunks"
    _check_prompt(plp, LONG, oracle, "long prompt")
    lsm, allowed = oracle(LONG)
    with pytest.raises(AssertionError):
        check_scores(plp[2:], lsm[:-2], LONG[1:-1], allowed[:-2], "control: one position off")


@pytest.mark.numeric
def test_prompts_scored_together_equal_alone_and_transformers(engine, oracle):
    """Two prompts of different lengths share scoring calls (batch 2), then each runs alone: both as transformers
    says, and the batched and solo scores within the bound of each other."""
    before = dict(engine.stats()["batch_sizes"])
    together = _prompt_logprobs(engine, list(PAIR))
    assert engine.stats()["batch_sizes"].get(2, 0) > before.get(2, 0), "the prompts never shared a call"
    alone = [_prompt_logprobs(engine, [p])[0] for p in PAIR]
    for k, (prompt, a, b) in enumerate(zip(PAIR, together, alone)):
        _check_prompt(a, prompt, oracle, f"prompt {k} batched")
        _check_prompt(b, prompt, oracle, f"prompt {k} alone")
        _, allowed = oracle(prompt)
        for j in range(1, len(prompt)):
            assert_within(abs(a[j][0] - b[j][0]), 2 * allowed[j - 1], f"prompt {k} position {j} batched vs alone")


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.parametrize("model_type", ["gemma2", "qwen3_next"])
def test_scored_prompts_of_windowed_and_recurrent_models_equal_transformers(model_type, tmp_path, serve_cache_dir):
    """Gemma 2 (sliding layers in a ring pool, soft-capped logits) and Qwen3-Next (linear-attention state slots): a
    prompt of three chunks scored in the body as transformers' log_softmax says. Control: one position off fails."""
    import torch

    import tlaloc_jax
    from hf_models import build_checkpoint, load_hf_torch
    from tlaloc_jax.export import Sampler, export_checkpoint
    ck = build_checkpoint(tmp_path / "ck", model_type, seed=3)
    export_checkpoint(ck, tmp_path / "art", batch_ladder=(1,), context_ladder=(64,), block_size=8,
                      prefill_chunk=CHUNK, prefill_long_chunk=0, progress=False,
                      sampler=Sampler(top_logprobs=TOP, logit_bias=1),
                      prompt_logprobs=TOP)
    cfg = tlaloc_jax.load_hf(ck).config
    with torch.no_grad():
        logits = load_hf_torch(ck)(torch.tensor([LONG])).logits[0].float().numpy().astype(np.float64)
    lsm = _lsm(logits)
    allowed = (2 * tol.bound(tol.decoder_roundings_of(cfg, context=len(LONG))) * np.abs(logits).max(-1)
               + tol.bound(cfg.vocab_size + 2 * tol.TRANSCENDENTAL_ULPS + 2) * np.abs(lsm).max(-1))
    with Engine.load(tmp_path / "art", cache_dir=serve_cache_dir, progress=False) as eng:
        (plp,) = _prompt_logprobs(eng, [LONG])
        assert _scored_calls(eng) >= -(-len(LONG) // CHUNK)
    check_scores(plp[1:], lsm[:-1], LONG[1:], allowed[:-1], model_type)
    with pytest.raises(AssertionError):
        check_scores(plp[2:], lsm[:-2], LONG[1:-1], allowed[:-2], "control: one position off")


def test_requests_without_prompt_logprobs_never_run_the_scoring_entries(engine):
    """The plain prefill entries serve requests that ask for no prompt logprobs; one asking for more top logprobs
    than the scorer returns falls back to the token-a-call path (its count of calls is the prompt's: one-token calls
    run on the decode entries)."""
    scored = _scored_calls(engine)
    engine.generate([LONG], 2)
    assert _scored_calls(engine) == scored
    st = engine.stats()
    calls = st["prefill_calls"] + st["decode_calls"]
    (plp,) = _prompt_logprobs(engine, [LONG[:10]], k=TOP + 1)
    st = engine.stats()
    assert st["prefill_calls"] + st["decode_calls"] - calls == 10 and _scored_calls(engine) == scored
    assert len(plp[1][2]) == TOP + 1


# -- through the server -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(engine):
    with InProcess(engine, model_name=MODEL) as srv:
        yield srv


def test_openai_echo_logprobs_and_vllm_prompt_logprobs_come_from_the_scoring_entries(server, engine, oracle):
    """The openai client's completions with echo=True and logprobs=2, and vLLM's prompt_logprobs field: the echoed
    prompt's logprobs and top logprobs, and vLLM's per-token {id: {logprob, rank}}, are the scoring entries' and
    transformers' (the prompt is longer than a chunk, read in chunks)."""
    client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=server.client, max_retries=0)
    text = " ".join(["the cat sat on the mat"] * 2)
    ids = server.server.tokenizer.encode(text)
    assert len(ids) > CHUNK
    before = _scored_calls(engine)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0, echo=True, logprobs=2)
    assert _scored_calls(engine) - before == -(-len(ids) // CHUNK)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    lsm, allowed = oracle(ids)
    for k in range(1, len(ids)):
        assert_within(abs(lp.token_logprobs[k] - lsm[k - 1][ids[k]]), allowed[k - 1], f"echoed token {k}")
        # Keyed by text: two ids that decode alike (byte-fallback pieces) share one key, the later pair's value.
        top = sorted(lp.top_logprobs[k].values(), reverse=True)
        best = np.sort(lsm[k - 1])[::-1][:2]
        assert 1 <= len(top) <= 2 and all(v >= best[1] - 2 * allowed[k - 1] for v in top), f"echoed token {k}: {top}"
        if len(top) == 2:
            assert top == pytest.approx(best.tolist(), abs=2 * allowed[k - 1])
    body = server.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                           "prompt_logprobs": 3}).json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    got = []
    for k, entry in enumerate(plp[1:], 1):
        mine = entry[str(ids[k])]
        tops = sorted(((int(i), v["logprob"]) for i, v in entry.items() if v["rank"] <= 3), key=lambda p: -p[1])
        got.append((mine["logprob"], mine["rank"], tuple(tops)))
        assert lp.token_logprobs[k] == pytest.approx(mine["logprob"], abs=1e-6)
    check_scores(got, lsm[:-1], ids[1:], allowed[:-1], "vLLM prompt_logprobs")


# -- the manifest -----------------------------------------------------------------------------------------------


def test_manifest_refuses_scorer_roles_where_they_do_not_belong(artifact):
    """A scoring role on a plain prefill entry, a scoring entry without its roles, or a scorer without scoring
    entries is refused by name; the artifact itself loads, and a manifest without a scorer still does."""
    raw = json.loads((artifact / af.MANIFEST_NAME).read_text())
    af.check_manifest(af.Manifest.from_json(json.dumps(raw)))

    def refused(edit, match):
        bad = json.loads(json.dumps(raw))
        edit(bad)
        with pytest.raises(af.ManifestError, match=match):
            af.check_manifest(af.Manifest.from_json(json.dumps(bad)))

    def entry(bad, kind):
        return next(e for e in bad["entries"] if e["kind"] == kind)

    def move_targets(bad):
        sig = next(s for s in entry(bad, "prefill_scored")["inputs"] if s["role"] == "SCORE_TARGETS")
        entry(bad, "prefill")["inputs"].append(sig)

    def drop_rank(bad):
        e = entry(bad, "prefill_scored")
        e["outputs"] = [s for s in e["outputs"] if s["role"] != "PROMPT_RANK"]

    def no_scoring_entries(bad):
        bad["entries"] = [e for e in bad["entries"] if e["kind"] != "prefill_scored"]

    refused(move_targets, "SCORE_TARGETS, which only a prefill_scored entry")
    refused(drop_rank, "lacks the scorer's roles")
    refused(no_scoring_entries, "has a scorer but no prefill_scored entry")
    plain = json.loads(json.dumps(raw))
    no_scoring_entries(plain)
    plain["scorer"] = None
    assert af.Manifest.from_json(json.dumps(plain)).scorer is None
