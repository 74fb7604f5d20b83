"""Mixed calls: the running sequences' decode rows and one prompt chunk in one call (EntryKind.MIXED).

The decoder runs a call of two row groups as the two calls would (logits within the decoder's rounding bound);
an artifact's mixed entries serve the ids that separate decode and prefill calls serve; controls: a chunk read
off the wrong output row, and a chunk attending through the decode rows' block tables, are caught."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import tlaloc_jax
from hf_models import build_checkpoint
from step_spy import decode_then_arrive, record_calls, run_out
from tlaloc_jax import artifact as af
from tlaloc_jax.decoder import forward, supports_mixed_calls
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.core import scheduler as scheduler_module

pytestmark = pytest.mark.numeric

BLOCK, CONTEXT = 8, 64
PROMPTS = [[5, 17, 99, 3, 250, 8, 61, 4, 4, 9, 10], [42, 7], [7, 7, 7, 1, 2, 3, 200, 100, 11, 13, 17, 19, 23, 29],
           [3, 1, 4, 1, 5, 9, 2, 6], [8] * 20, [100, 101]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("mixed") / "ck", "llama", seed=41)


def _inputs(rows, batch, tokens):
    return StepInputs(**build_step_inputs(rows, batch=batch, tokens=tokens, width=CONTEXT // BLOCK, block_size=BLOCK))


def test_two_row_groups_in_one_call_give_the_two_calls_logits(checkpoint):
    """Three decode rows (one padded) and a 16-token chunk: one call's logits equal a decode call's and a prefill
    call's on the same pools. Control: the chunk attending through the decode rows' tables is caught."""
    model = tlaloc_jax.load_hf(checkpoint, block_size=BLOCK, weight_layout="per-layer")
    cfg = model.config
    assert supports_mixed_calls(cfg)
    pages = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    prompts = [[(i * 13 + j * 7) % 250 + 3 for j in range(20)] for i in range(3)]
    pools = model.new_pools(32)
    fwd = jax.jit(lambda p, i: forward(cfg, model.weights, p, i))
    # The three decode rows' histories, written first.
    _, pools = fwd(pools, _inputs([RowCall(p, 0, pg) for p, pg in zip(prompts, pages)], 4, 20))
    dec = _inputs([RowCall([p[-1]], 20, pg) for p, pg in zip(prompts, pages)], 4, 1)
    chunk = _inputs([RowCall(list(range(30, 46)), 0, pages[3])], 1, 16)
    want = np.concatenate([np.asarray(fwd(pools, dec)[0]), np.asarray(fwd(pools, chunk)[0])])
    got = np.asarray(fwd(pools, (dec, chunk))[0])
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=CONTEXT)) * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)
    wrong = chunk._replace(block_tables=dec.block_tables[:1])
    bad = np.asarray(fwd(pools, (dec, wrong))[0])
    assert np.abs(bad[-1] - want[-1]).max() > bound


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory, serve_cache_dir):
    out = tmp_path_factory.mktemp("mixed-art") / "art"
    m = export_checkpoint(checkpoint, out, batch_ladder=(1, 4), context_ladder=(32, CONTEXT), block_size=BLOCK,
                          prefill_chunk=8, prefill_long_chunk=0, prefill_max_batch=1, progress=False)
    assert sorted(e.name for e in m.entries if e.kind == af.EntryKind.MIXED) == \
        ["mixed_b4_t8_c32", "mixed_b4_t8_c64"]
    with Engine.load(out, cache_dir=serve_cache_dir, progress=False) as eng:
        yield eng


def _run(eng, mixed: bool) -> list[list[int]]:
    """Two prompts decoding, then four more arriving one a step (each read in chunks of 8 while the others decode)."""
    eng.scheduler.planner.use_mixed = mixed
    rids = [eng.add_request(p, 12) for p in PROMPTS[:2]]
    eng.step()
    for p in PROMPTS[2:]:
        rids.append(eng.add_request(p, 12))
        eng.step()
    out = run_out(eng, rids)
    eng.scheduler.planner.use_mixed = True
    return out


def test_mixed_calls_serve_the_ids_of_separate_calls(engine):
    before = engine.stats()["mixed_calls"]
    separate = _run(engine, mixed=False)
    assert engine.stats()["mixed_calls"] == before
    assert _run(engine, mixed=True) == separate
    assert engine.stats()["mixed_calls"] > before
    assert separate == [engine.generate([p], 12)[0] for p in PROMPTS]


def test_control_a_chunk_read_off_the_wrong_row_is_caught(engine, monkeypatch):
    separate = _run(engine, mixed=False)
    real = scheduler_module.ScheduledCall.out_rows.fget

    def off_by_one(self):
        rows = real(self)
        return rows[:-1] + (rows[-1] - 1,) if self.entry.kind == af.EntryKind.MIXED else rows
    monkeypatch.setattr(scheduler_module.ScheduledCall, "out_rows", property(off_by_one))
    assert _run(engine, mixed=True) != separate


def test_a_step_reads_its_chunks_the_cheaper_way(checkpoint, tmp_path, monkeypatch, serve_cache_dir):
    """Two sequences decoding when prompts arrive. One new prompt rides with the decode rows in a mixed call; four
    new prompts are read in one prefill call of 4 rows beside a decode call, which computes fewer positions
    (scheduler.call_cost) than a mixed call with one of them plus a prefill call of the other three. The ids are
    the solo runs' either way. (Plain prefill entries: with packed ones the decode rows ride in the prefill call,
    tests/serving/test_packed_prefill.py.)"""
    out = tmp_path / "art"
    export_checkpoint(checkpoint, out, batch_ladder=(1, 2, 4), context_ladder=(CONTEXT,), block_size=BLOCK,
                      prefill_chunk=8, prefill_long_chunk=0, prefill_max_batch=4, progress=False, packed=False)
    with Engine.load(out, cache_dir=serve_cache_dir, progress=False) as eng:
        solo = [eng.generate([p], 6)[0] for p in PROMPTS]
        steps = record_calls(eng, monkeypatch, lambda c: c.entry.kind)
        # Both first prompts are read in one step and decode from the next.
        got, kinds = decode_then_arrive(eng, PROMPTS[:2], PROMPTS[2:3], steps)
        assert got == solo[:3]
        assert kinds == [af.EntryKind.MIXED]
        short = [p[:8] for p in PROMPTS[2:6]]
        got, kinds = decode_then_arrive(eng, PROMPTS[:2], short, steps)
        assert got == solo[:2] + [eng.generate([p], 6)[0] for p in short]
        assert kinds == [af.EntryKind.PREFILL, af.EntryKind.DECODE]
