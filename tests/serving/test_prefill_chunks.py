"""Prefill chunks sized for serving (export/_options.py, serve/core/scheduler.py): prompts read side by side take
the short chunk of the entries of several rows and share calls; a prompt read alone takes the one-row entry of the
long chunk. Either way every id equals that of reading in short chunks only, and a control that misplaces the
long rows' tokens must fail."""

from __future__ import annotations

import pytest

from hf_models import build_checkpoint
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.core import call_plan

LONG = "prefill_b1_t32_c64"
SHARED = ("prefill_b4_n16_c64", "prefill_b4_n32_c64")     # packed prefills of 4 rows of 8 tokens
PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(30 + 3 * i)] for i in range(4)]    # 30 to 39 tokens


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill-chunks")
    ck = build_checkpoint(root / "ck", "llama", seed=31)
    m = export_checkpoint(ck, root / "art", batch_ladder=(1, 4), context_ladder=(64,), block_size=8,
                          prefill_chunk=8, prefill_long_chunk=32, num_blocks=64, progress=False)
    prefill = {e.name: e.tokens_per_seq for e in m.entries if e.kind == "prefill"}
    assert prefill == {"prefill_b1_c64": 8, **{name: 8 for name in SHARED}, LONG: 32}
    return root / "art"


def _calls(eng: Engine) -> dict[str, int]:
    return dict(eng.runner.stats["executions_by_entry"])


def _new(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}


def _short_only(eng: Engine) -> list[list[int]]:
    """Each prompt alone, read in the short chunk only (the long entry never picked)."""
    long_cap = eng.scheduler.chunk_cap
    eng.scheduler.chunk_cap = eng.scheduler.shared_chunk_cap
    try:
        return [eng.generate([p], 12)[0] for p in PROMPTS]
    finally:
        eng.scheduler.chunk_cap = long_cap


def test_a_lone_prompt_takes_the_long_chunk_and_prompts_together_share_short_ones(artifact, serve_cache_dir):
    with Engine.load(artifact, cache_dir=serve_cache_dir, progress=False, enable_prefix_caching=False) as eng:
        want = _short_only(eng)
        before = _calls(eng)
        alone = [eng.generate([p], 12)[0] for p in PROMPTS]
        used = _new(before, _calls(eng))
        # 30 to 39 tokens: one long call each, then the rest in short ones (or none).
        assert used.get(LONG) == len(PROMPTS) and not set(SHARED) & set(used)
        assert alone == want
        before = _calls(eng)
        assert eng.generate(PROMPTS, 12) == want
        used = _new(before, _calls(eng))
        assert LONG not in used and sum(used.get(name, 0) for name in SHARED) >= 4


def test_control_long_rows_with_misplaced_tokens_are_caught(artifact, serve_cache_dir, monkeypatch):
    with Engine.load(artifact, cache_dir=serve_cache_dir, progress=False, enable_prefix_caching=False) as eng:
        want = _short_only(eng)
        real = call_plan.row_call

        def rotated(tokens, start, held):
            tokens = list(tokens)
            return real(tokens[1:] + tokens[:1] if len(tokens) > 8 else tokens, start, held)
        monkeypatch.setattr(call_plan, "row_call", rotated)
        assert [eng.generate([p], 12)[0] for p in PROMPTS] != want
