"""The drafts that pay (CallPlanner.drafts_that_pay) on an engine: at batch 4, drafts that are never accepted stop
after the first verify call, where every-draft drafting keeps verifying them after each back-off; the ids stay
those of plain decoding. A lone sequence keeps drafting what it accepts (tests/unit/test_drafts_that_pay.py: the
cost model)."""

from __future__ import annotations

import pytest

from hf_models import build_checkpoint
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.serve import Engine, speculative
from tlaloc_jax.serve.core.call_plan import CallPlanner

pytestmark = pytest.mark.numeric

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROMPTS = [[(7 * i + j * 5) % 250 + 3 for j in range(6 + 3 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("drafts-that-pay")
    ck = build_checkpoint(out / "ck", "llama", seed=47)
    export_checkpoint(ck, out / "art", batch_ladder=(1, 2, 4), context_ladder=(64,), block_size=8, prefill_chunk=8,
                      speculative_tokens=K, progress=False)
    return out / "art"


def _wrong(vocab: int):
    """propose_ngram's stand-in: K drafts that are never the model's tokens (each one past the last token: a tiny
    random model seldom continues with it; what is accepted is counted, not assumed)."""
    return lambda tokens, k, lo, hi: [(tokens[-1] + 1 + i) % vocab for i in range(k)]


def _run(artifact, cache, every: bool, monkeypatch) -> tuple[list[list[int]], dict]:
    with monkeypatch.context() as mp:
        if every:
            mp.setattr(CallPlanner, "drafts_that_pay", lambda self, d, drafted, ride=None: [w for w, _ in drafted])
        with Engine.load(artifact, cache_dir=cache, progress=False, use_decode_steps=False,
                         speculative_config=NGRAM) as eng:
            mp.setattr(speculative, "propose_ngram", _wrong(eng.manifest.model.vocab))
            return eng.generate(PROMPTS, 40), eng.stats()


def test_batch_four_stops_verifying_drafts_that_are_not_accepted(artifact, serve_cache_dir, monkeypatch):
    with Engine.load(artifact, cache_dir=serve_cache_dir, progress=False, use_decode_steps=False) as eng:
        want = eng.generate(PROMPTS, 40)
    gated, st = _run(artifact, serve_cache_dir, False, monkeypatch)
    every, st_every = _run(artifact, serve_cache_dir, True, monkeypatch)
    assert gated == want and every == want
    # Both accepted almost nothing; every-draft drafting verified after each back-off (1st, 9th, 41st token), the gate
    # only until the sequences' acceptance fell below what a verify call of four costs.
    assert st_every["spec_decode_num_accepted_tokens"] <= st_every["spec_decode_num_draft_tokens"] // 4
    assert 0 < st["spec_decode_num_drafts"] < st_every["spec_decode_num_drafts"]


def test_a_lone_sequence_keeps_drafting_what_it_accepts(artifact, serve_cache_dir, monkeypatch):
    """Alone, with drafts that are the model's own continuation: every verify call accepts all K, so the gate lets
    each step draft; the 16 tokens take 4 verify calls of K + 1 tokens."""
    prompt = PROMPTS[3]
    with Engine.load(artifact, cache_dir=serve_cache_dir, progress=False, use_decode_steps=False) as eng:
        want = eng.generate([prompt], 16)[0]
    right = lambda tokens, k, lo, hi: want[len(tokens) - len(prompt):][:k]    # noqa: E731
    monkeypatch.setattr(speculative, "propose_ngram", right)
    with Engine.load(artifact, cache_dir=serve_cache_dir, progress=False, use_decode_steps=False,
                     speculative_config=NGRAM) as eng:
        assert eng.generate([prompt], 16) == [want]
        st = eng.stats()
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"] > 0
    assert st["spec_decode_num_drafts"] == 16 // (K + 1)
