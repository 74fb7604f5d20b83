"""MTP speculation (serve/mtp_proposer.py): DeepSeek-V3's and Qwen3-Next's MTP heads draft, the verify entries check,
and the greedy ids are those of decoding without speculation, alone and batched; the head's entries run, batched, and
its state goes with the sequence. vLLM's MTP methods on an artifact without the head are refused by name at start."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import build_checkpoint
from mtp_checkpoint import add_mtp_head, add_qwen3_next_mtp
from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import load_checkpoint, read_config
from tlaloc_jax.decoder import final_hidden, init_pools
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.config import LINEAR
from tlaloc_jax.mtp_head import POOL, load_mtp_weights, mtp_hidden, mtp_logits, mtp_pool
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve import speculative as spec
from tlaloc_jax.serve.speculative import SpeculativeConfigError

pytestmark = [pytest.mark.numeric, pytest.mark.every_draft]

K = 2
# Each family's seed and how its head is added: DeepSeek-V3's MoE and latent attention, Qwen3-Next's gated attention
# over its hybrid decoder (dense: its MoE head is checked against vLLM's definition in tests/models/test_mtp.py).
HEADS = {"deepseek_v3": (69, add_mtp_head), "qwen3_next": (71, add_qwen3_next_mtp)}
# One batch size (a sequence alone pads to 2 rows): DeepSeek's MoE layers make every entry slow to compile.
LADDER = dict(batch_ladder=(2,), context_ladder=(32,), block_size=4, prefill_chunk=8, prefill_long_chunk=0,
              num_blocks=24, progress=False, speculative_tokens=K)
MTP = {"method": "deepseek_mtp", "num_speculative_tokens": K}
PROMPTS = [[5, 9, 14, 3, 77, 120, 8, 41, 9, 14, 3], [200, 17, 63], [31, 31, 2, 90, 45, 12, 250, 7, 66, 18, 5, 4, 3]]
NEW = 10


@pytest.fixture(scope="module", params=sorted(HEADS))
def artifacts(request, tmp_path_factory):
    seed, add_head = HEADS[request.param]
    root = tmp_path_factory.mktemp(f"mtp-serve-{request.param}")
    plain = build_checkpoint(root / "plain", request.param, seed=seed)
    head = add_head(plain, root / "head", seed=seed + 1)
    export_checkpoint(plain, root / "art-plain", **{**LADDER, "batch_ladder": (1,)})     # refused at start only
    export_checkpoint(head, root / "art-head", **LADDER)
    return root / "art-plain", root / "art-head"


def _row(tokens, start: int, width: int) -> StepInputs:
    """One row of `tokens` at positions [start, start + n), right-aligned in `width` columns (one shape, one compile),
    on pages 0, 1, ... of PAGE positions and state slot 0."""
    n = len(tokens)
    ids, pos = np.zeros((1, width), np.int32), np.full((1, width), -1, np.int32)
    ids[0, width - n:], pos[0, width - n:] = tokens, np.arange(start, start + n)
    return StepInputs(token_ids=jnp.asarray(ids), positions=jnp.asarray(pos),
                      block_tables=jnp.arange(PAGES, dtype=jnp.int32)[None],
                      seq_lens=jnp.asarray([start + n], jnp.int32), slot_mapping=jnp.asarray(pos),
                      state_slots=jnp.zeros((1,), jnp.int32))


PAGE, PAGES = 4, 8


@functools.lru_cache(maxsize=1)
def _in_process(ck):
    """The checkpoint's config, decoder and head weights, and the decoder's (its hidden states after the final norm,
    which the head reads) and the head's steps, jitted."""
    fam, cfg = config_from_hf(read_config(ck))
    head, kind = load_mtp_weights(ck, fam, cfg)
    weights = {k: jnp.asarray(v) for k, v in {**load_checkpoint(ck)[1], **head}.items()}
    hidden = jax.jit(lambda w, pools, x: final_hidden(cfg, w, pools, x, all_positions=True, key_block=PAGE * PAGES)[0])
    mtp = jax.jit(lambda w, pool, x, h: mtp_hidden(cfg, kind, w, pool, x, h, key_block=PAGE * PAGES))
    return cfg, weights, hidden, mtp, jax.jit(lambda w, h: jnp.argmax(mtp_logits(cfg, w, h[0, -1])))


def reference_drafts(ck, tokens: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after `tokens`, in process: the decoder's hidden states of positions [0, c)
    (c = len(tokens) - 1), the head over them with tokens [1, c], then chained on its own hidden state."""
    cfg, weights, hidden, mtp, draft = _in_process(ck)
    c = len(tokens) - 1
    width = PAGE * PAGES
    states = int(LINEAR in cfg.layer_types)
    h = hidden(weights, init_pools(cfg, PAGES, PAGE, state_slots=states), _row(tokens[:c], 0, width))
    pool = jnp.zeros(mtp_pool(cfg).to_pool(POOL, PAGES, PAGE).shape, jnp.float32)
    h, pool = mtp(weights, pool, _row(tokens[1:], 0, width), h)
    drafts = [int(draft(weights, h))]
    for j in range(1, k):
        h, pool = mtp(weights, pool, _row(drafts[-1:], c + j - 1, 1), h[:, -1:])
        drafts.append(int(draft(weights, h)))
    return drafts


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
        assert not proposer.pending                                   # nothing kept of finished sequences
        assert st["pages_in_use"] == 0


def test_the_drafts_are_the_heads_over_the_decoders_hidden_states(artifacts, serve_cache_dir, monkeypatch):
    """The proposer's plumbing (which hidden state goes with which token and position, the chain): the drafts it
    gives a sequence after its prompt and after a verify call are the head's, run in process over the decoder's
    hidden states of the tokens so far (on pages enough that the chain is never cut). The random head's
    drafts are all rejected: drafting must not back off for the test to see more than one."""
    monkeypatch.setattr(spec, "BACKOFF_TOKENS", 0)
    seen = []
    with Engine.load(artifacts[1], cache_dir=serve_cache_dir, progress=False, speculative_config=MTP) as eng:
        proposer = eng.scheduler.proposer
        propose = proposer.propose

        def spy(rows):
            drafts = propose(rows)
            seen.extend((list(s.tokens), d) for (s, _), d in zip(rows, drafts))
            return drafts
        proposer.propose = spy
        _generate(eng, [PROMPTS[0]])
    drafted = [(tokens, d) for tokens, d in seen if len(d) == K]
    assert len(drafted) >= 2
    for tokens, d in drafted[:2]:
        assert list(d) == reference_drafts(artifacts[1].parent / "head", tokens, K), len(tokens)


def test_the_head_is_staged_with_its_pool_and_the_decoders_hidden_states(artifacts):
    """An mtp entry beside each decode, prefill and verify point, the head's one-layer pool as its attention keeps it
    (DeepSeek's latents, Qwen3-Next's keys and values) on the decoder's pages, HIDDEN_STATES from the decoder's
    entries."""
    m = af.load_manifest(artifacts[1])
    cfg = config_from_hf(read_config(artifacts[1].parent / "head"))[1]
    pool = next(p for p in m.pools if p.name == POOL)
    assert pool.kind == af.PoolKind.PAGED_KV
    assert tuple(pool.shape) == mtp_pool(cfg).to_pool(POOL, LADDER["num_blocks"], LADDER["block_size"]).shape
    hidden = [e for e in m.entries if e.kind in (af.EntryKind.DECODE, af.EntryKind.PREFILL, af.EntryKind.VERIFY)
              and not e.packed_tokens]
    assert {(e.batch, e.tokens_per_seq) for e in m.entries if e.kind == af.EntryKind.MTP} == \
        {(e.batch, e.tokens_per_seq) for e in hidden}
    for e in hidden:
        assert tuple(e.outputs[e.output_index(af.Role.HIDDEN_STATES)].shape) == \
            (e.batch, e.tokens_per_seq, cfg.hidden_size)


def test_mtp_without_the_head_is_refused_at_start(artifacts, serve_cache_dir):
    m = af.load_manifest(artifacts[0])
    assert not any(e.kind == af.EntryKind.MTP for e in m.entries)
    for method in spec.MTP_METHODS:
        with pytest.raises(SpeculativeConfigError, match="re-export it .* from a checkpoint that has its MTP weights"):
            Engine.load(artifacts[0], cache_dir=serve_cache_dir, progress=False,
                        speculative_config={**MTP, "method": method})
