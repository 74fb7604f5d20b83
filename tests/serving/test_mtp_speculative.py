"""MTP speculation (serve/mtp_proposer.py): DeepSeek-V3's MTP head drafts, the verify entries check, and the greedy
ids are those of decoding without speculation, alone and batched; the head's entries run, batched, and its state goes
with the sequence. vLLM's method "deepseek_mtp" on an artifact without the head is refused by name at start."""

from __future__ import annotations

import pytest

from hf_models import build_checkpoint
from mtp_checkpoint import add_mtp_head
from tlaloc_jax import artifact as af
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.speculative import SpeculativeConfigError

pytestmark = pytest.mark.numeric

SEED, K = 69, 2
LADDER = dict(batch_ladder=(1, 2), context_ladder=(32,), block_size=4, prefill_chunk=8, prefill_long_chunk=0,
              num_blocks=24, progress=False, speculative_tokens=K)
MTP = {"method": "deepseek_mtp", "num_speculative_tokens": K}
PROMPTS = [[5, 9, 14, 3, 77, 120, 8, 41, 9, 14, 3], [200, 17, 63], [31, 31, 2, 90, 45, 12, 250, 7, 66, 18, 5, 4, 3]]
NEW = 10


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-serve")
    plain = build_checkpoint(root / "plain", "deepseek_v3", seed=SEED)
    head = add_mtp_head(plain, root / "head", seed=SEED + 1)
    export_checkpoint(plain, root / "art-plain", **LADDER)
    export_checkpoint(head, root / "art-head", **LADDER)
    return root / "art-plain", root / "art-head"


def _generate(eng: Engine, prompts) -> list[list[int]]:
    rids = [eng.add_request(p, NEW) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    out = [eng.output(r) for r in rids]
    for r in rids:
        assert eng.request_info(r).finish_reason != "error", eng.request_info(r).error
        eng.release(r)
    return out


def test_greedy_ids_with_mtp_drafts_equal_those_without(artifacts, serve_cache_dir):
    art = artifacts[1]
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as eng:
        want_alone = [_generate(eng, [p])[0] for p in PROMPTS]
        want_batched = _generate(eng, PROMPTS[:2])
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False, speculative_config=MTP) as eng:
        proposer = eng.scheduler.proposer
        assert proposer is eng.model_runner.proposer and proposer is not None
        assert [_generate(eng, [p])[0] for p in PROMPTS] == want_alone
        assert _generate(eng, PROMPTS[:2]) == want_batched
        st = eng.stats()
        ran = eng.runner.stats["executions_by_entry"]
        # The head drafted (chained K drafts a step where pages allowed) and the verify entries checked them; the
        # batched run called the head's entries of two rows.
        assert st["verify_calls"] > 0 and st["spec_decode_num_draft_tokens"] > st["spec_decode_num_drafts"]
        assert proposer.calls > 0 and any(n.startswith("mtp_b2_") and ran[n] for n in ran)
        assert not proposer.pending and not proposer.drafts          # nothing kept of finished sequences
        assert st["pages_in_use"] == 0


def test_deepseek_mtp_without_the_head_is_refused_at_start(artifacts, serve_cache_dir):
    m = af.load_manifest(artifacts[0])
    assert not any(e.kind == af.EntryKind.MTP for e in m.entries)
    for method in ("deepseek_mtp", "mtp"):
        with pytest.raises(SpeculativeConfigError, match="re-export it .* from a checkpoint that has its MTP weights"):
            Engine.load(artifacts[0], cache_dir=serve_cache_dir, progress=False,
                        speculative_config={**MTP, "method": method})
