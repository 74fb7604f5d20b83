"""Flat entries (`--entries flat`): only packed prefills, one per context and token bucket, each token attending as
a row of its own over its sequence's pages (packed_attention "tokens"); every step's decode rows and prompt chunks
run side by side in them, as vLLM lays a step's tokens out flat.

The decoder's token rows give the row layout's logits and pools (plain ops and the C decode kernel; a ring of
pages for a sliding window); an engine on flat entries gives the default entries' greedy ids alone, batched, with
prefix caching and under preemption, for Llama and a sliding-window family (Gemma 2), and runs nothing but packed
calls. Control: tokens given another row's pages."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import tlaloc_jax
from hf_models import build_checkpoint
from tlaloc_jax import artifact as af
from tlaloc_jax import packing
from tlaloc_jax.decoder import forward
from tlaloc_jax.export import ExportError, export_checkpoint
from tlaloc_jax.export._entries import flat_token_buckets
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs, pack_step_inputs

pytestmark = pytest.mark.numeric

BLOCK, CONTEXT = 8, 64
# llama's flat artifact is a slow check (make test-slow): gemma2's, with its window's rings, runs the same flat path
# in make test.
FAMILIES = (pytest.param("llama", marks=pytest.mark.slow), "gemma2")
LADDER = dict(batch_ladder=(1, 2, 4, 8), context_ladder=(CONTEXT,), block_size=BLOCK, prefill_chunk=8,
              prefill_long_chunk=16, progress=False)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp(f"flat-{request.param}") / "ck", request.param, seed=47)


def _row_calls(cfg, model):
    """Pools holding three sequences' history, and a packed call's rows after it: a chunk, a decode row, a chunk."""
    width = CONTEXT // BLOCK
    pages = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    history = [[(i * 31 + j * 11) % 250 + 3 for j in range(n)] for i, n in enumerate((12, 20, 7))]
    _, pools = jax.jit(lambda p, i: forward(cfg, model.weights, p, i))(model.new_pools(32), StepInputs(
        **build_step_inputs([RowCall(h, 0, pg) for h, pg in zip(history, pages)], batch=3, tokens=20, width=width,
                            block_size=BLOCK)))
    rows = [RowCall([(k * 7 + i) % 250 + 3 for k in range(n)], len(h), pg)
            for i, (h, pg, n) in enumerate(zip(history, pages, (8, 1, 5)))]
    return pools, build_step_inputs(rows, batch=4, tokens=8, width=width, block_size=BLOCK)


@pytest.mark.parametrize("decode_attention", ["xla", "native"])
def test_token_rows_give_the_row_layouts_logits_and_pools(checkpoint, decode_attention, monkeypatch):
    """A packed call of a decode row and two chunks (N = 16), each token attending alone, against the unpacked
    call of the same rows: logits and written pages within the decoder's rounding bound. Control: every token given
    the first row's pages is caught."""
    model = tlaloc_jax.load_hf(checkpoint, block_size=BLOCK, weight_layout="per-layer")
    cfg = model.config
    pools, plain = _row_calls(cfg, model)
    want, want_pools = jax.jit(lambda p, i: forward(cfg, model.weights, p, i))(pools, StepInputs(**plain))
    flat = jax.jit(lambda p, i: forward(cfg, model.weights, p, i, decode_attention=decode_attention,
                                        packed_attention="tokens"))
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=CONTEXT)) * float(np.abs(want).max())
    got, got_pools = flat(pools, StepInputs(**pack_step_inputs(plain, 16)))
    np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(want)[:3], rtol=0, atol=bound)
    for name in want_pools:
        np.testing.assert_allclose(np.asarray(got_pools[name]), np.asarray(want_pools[name]), rtol=0, atol=bound)
    real = packing.token_rows

    def first_rows_pages(inputs):
        rows = real(inputs)
        return rows._replace(block_tables=rows.block_tables[:1].repeat(rows.block_tables.shape[0], 0))
    monkeypatch.setattr(packing, "token_rows", first_rows_pages)
    monkeypatch.setattr(tlaloc_jax.decoder, "token_rows", first_rows_pages)
    flat = jax.jit(lambda p, i: forward(cfg, model.weights, p, i, decode_attention=decode_attention,
                                        packed_attention="tokens"))
    bad = np.asarray(flat(pools, StepInputs(**pack_step_inputs(plain, 16)))[0])
    assert np.abs(bad[1:3] - np.asarray(want)[1:3]).max() > 100 * bound


def test_flat_token_buckets_are_powers_of_two_up_to_the_largest_call():
    assert flat_token_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert flat_token_buckets(96) == [1, 2, 4, 8, 16, 32, 64, 96]
    assert flat_token_buckets(1) == [1]


@pytest.fixture(scope="module")
def artifacts(checkpoint, tmp_path_factory):
    """(default, flat) artifacts of the checkpoint; the flat one's pool is small enough to preempt a crowd."""
    out = tmp_path_factory.mktemp("flat-art")
    default = export_checkpoint(checkpoint, out / "default", num_blocks=64, **LADDER)
    flat = export_checkpoint(checkpoint, out / "flat", num_blocks=20, entries="flat", **LADDER)
    return (default, out / "default"), (flat, out / "flat")


def test_a_flat_export_holds_only_packed_prefills_by_token_bucket(artifacts):
    """One packed prefill per bucket of 1 ... 64 tokens (the prefill ladder's largest call, 8 rows of 8), of up to 8
    rows of up to 16 tokens (the long chunk); the default export has its decode, prefill and mixed entries."""
    (default, _), (flat, _) = artifacts
    assert {e.kind for e in default.entries} >= {af.EntryKind.DECODE, af.EntryKind.PREFILL}
    assert [(e.kind, e.batch, e.tokens_per_seq, e.packed_tokens) for e in flat.entries] == [
        (af.EntryKind.PREFILL, min(n, 8), min(n, 16), n) for n in (1, 2, 4, 8, 16, 32, 64)]
    assert flat.flat and flat.max_batch == 8 and not default.flat and default.max_batch == 8


def test_flat_entries_refuse_what_they_cannot_hold(checkpoint, tmp_path):
    """Mixed and decode_steps entries, and plain prefills, are not flat: each is refused by name, before export."""
    for bad, word in ((dict(mixed=True), "mixed"), (dict(decode_steps=4), "decode_steps"),
                      (dict(packed=False), "packed"), (dict(entries="ragged"), "entries")):
        with pytest.raises(ExportError, match=word):
            export_checkpoint(checkpoint, tmp_path / "bad", **{**LADDER, "entries": "flat", **bad})


def _prompts(n: int, shared: list[int] | None = None) -> list[list[int]]:
    return [(shared or []) + [(7 * i + j * 5) % 250 + 3 for j in range(3 + (5 * i) % 19)] for i in range(n)]


def test_flat_entries_give_the_default_entries_greedy_ids(artifacts, serve_cache_dir):
    """Greedy ids on flat entries equal those on the default entries: each prompt alone, eight together, eight
    sharing a 24-token prefix (prefix caching hits, where no ring pool turns it off), and a crowd of eight on 20 pages (preempted and computed
    again); the flat engine runs packed prefill calls only."""
    (_, default_dir), (_, flat_dir) = artifacts
    alone, crowd = _prompts(4), _prompts(8)
    shared = _prompts(8, [(i * 13 + 7) % 250 + 3 for i in range(24)])
    with Engine.load(default_dir, cache_dir=serve_cache_dir, progress=False) as eng:
        want_alone = [eng.generate([p], 12)[0] for p in alone]
        want_crowd = eng.generate(crowd, 30)
        want_shared = eng.generate(shared, 12)
        assert eng.stats()["preemptions"] == 0
    with Engine.load(flat_dir, cache_dir=serve_cache_dir, progress=False, max_num_seqs=8) as eng:
        assert [eng.generate([p], 12)[0] for p in alone] == want_alone
        before = eng.stats()["prefix_hits"]
        assert eng.generate(shared, 12) == want_shared
        # A ring of pages (Gemma 2's window) is not reused exactly: prefix caching is off there.
        caching = eng.stats()["prefix_caching"]
        assert caching == (eng.manifest.ring is None)
        assert eng.stats()["prefix_hits"] - before >= 7 * 24 * caching
        assert eng.generate(crowd, 30) == want_crowd
        st = eng.stats()
        assert st["preemptions"] > 0
        assert all(k.startswith("prefill_b") and "_n" in k for k, v in st["executions_by_entry"].items() if v)
