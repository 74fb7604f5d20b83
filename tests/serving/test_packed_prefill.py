"""Packed prefills (Role.PACK_INDEX): a prefill call that computes its rows' tokens side by side ([1, N]) and not
the padding of B rows of T, each row attending over its own pages as an unpacked call would.

The decoder's packed call gives the unpacked call's logits and writes the same keys and values (within the
decoder's rounding bound); the default export's prefill entries of several rows are packed, the scheduler reads a
burst of short prompts in the packed entry of the fewest tokens, and the ids are each prompt's solo run's.
Controls: a row's pack index off by one, and one that gives a row another row's last token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tlaloc_jax
from bodies import entry_args, run_body
from hf_models import build_checkpoint
from margins import assert_within
from step_spy import decode_then_arrive, record_calls
from tlaloc_jax import artifact as af
from tlaloc_jax.decoder import forward
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs, pack_step_inputs
from tlaloc_jax.serve import Engine

pytestmark = pytest.mark.numeric

BLOCK, CONTEXT = 8, 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("packed") / "ck", "llama", seed=43)


def test_a_packed_call_gives_the_unpacked_calls_logits_and_pools(checkpoint):
    """Four rows of 8 tokens a row at most: three chunks after earlier context (8, 3 and 5 tokens) and an empty
    row, packed into N = 16 and N = 24 (8 padding slots); logits and the written pages equal the unpacked call's."""
    model = tlaloc_jax.load_hf(checkpoint, block_size=BLOCK, weight_layout="per-layer")
    cfg = model.config
    fwd = jax.jit(lambda p, i: forward(cfg, model.weights, p, i))
    pages = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    history = [[(i * 31 + j * 11) % 250 + 3 for j in range(n)] for i, n in enumerate((12, 20, 7))]
    width = CONTEXT // BLOCK
    _, pools = fwd(model.new_pools(32), StepInputs(**build_step_inputs(
        [RowCall(h, 0, pg) for h, pg in zip(history, pages)], batch=3, tokens=20, width=width, block_size=BLOCK)))
    rows = [RowCall([(k * 7 + i) % 250 + 3 for k in range(n)], len(h), pg)
            for i, (h, pg, n) in enumerate(zip(history, pages, (8, 3, 5)))]
    plain = build_step_inputs(rows, batch=4, tokens=8, width=width, block_size=BLOCK)
    want, want_pools = fwd(pools, StepInputs(**plain))
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=CONTEXT)) * float(np.abs(want).max())
    for n in (16, 24):
        packed = pack_step_inputs(plain, n)
        assert packed["token_ids"].shape == (1, n) and packed["pack_index"].shape == (4, 8)
        got, got_pools = fwd(pools, StepInputs(**packed))
        np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(want)[:3], rtol=0, atol=bound)
        for name in want_pools:
            np.testing.assert_allclose(np.asarray(got_pools[name]), np.asarray(want_pools[name]), rtol=0, atol=bound)
    # Controls: row 0's index off by one, and row 1 reading row 2's last token, are caught.
    packed = pack_step_inputs(plain, 16)
    shifted = packed["pack_index"].copy()
    shifted[0] = np.minimum(shifted[0] + 1, 16)
    bad = np.asarray(fwd(pools, StepInputs(**dict(packed, pack_index=shifted)))[0])
    assert np.abs(bad[0] - np.asarray(want)[0]).max() > 100 * bound
    crossed = packed["pack_index"].copy()
    crossed[1, -1] = crossed[2, -1]
    bad = np.asarray(fwd(pools, StepInputs(**dict(packed, pack_index=crossed)))[0])
    assert np.abs(bad[1] - np.asarray(want)[1]).max() > 100 * bound


@pytest.fixture(scope="module")
def packed_artifact(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed-art") / "art"
    m = export_checkpoint(checkpoint, out, batch_ladder=(1, 2, 4, 8), context_ladder=(CONTEXT,), block_size=BLOCK,
                          prefill_chunk=8, prefill_long_chunk=0, progress=False, mixed=False, exported=True)
    return m, out


def test_packed_bodies_give_the_in_process_unpacked_calls_logits_and_pools(checkpoint, packed_artifact):
    """Each staged packed body, called through jax.export on rows of random lengths after random history, against
    the in-process decoder's unpacked call of the same rows."""
    m, art = packed_artifact
    model = tlaloc_jax.load_hf(checkpoint, block_size=m.block_size)
    kv = m.pool("kv")
    rng = np.random.default_rng(3)
    width = CONTEXT // BLOCK
    packed = [e for e in m.entries if e.packed_tokens]
    assert packed
    for entry in packed:
        rows, left = [], entry.packed_tokens
        for b in range(entry.batch):
            n = int(rng.integers(0, min(entry.tokens_per_seq, left) + 1))
            start = int(rng.integers(0, CONTEXT - entry.tokens_per_seq))
            left -= n
            rows.append(RowCall(rng.integers(0, m.model.vocab, n).tolist(), start,
                                list(range(b * width, (b + 1) * width))) if n else None)
        live = [r for r in rows if r is not None]
        plain = build_step_inputs([r or RowCall([], 0, []) for r in rows], batch=entry.batch,
                                  tokens=entry.tokens_per_seq, width=width, block_size=BLOCK)
        pool = rng.standard_normal(kv.shape).astype(np.float32)
        want_logits, want_pools = model.step({"kv": jnp.asarray(pool)}, plain)
        out = run_body(art, entry, entry_args(entry, pack_step_inputs(plain, entry.packed_tokens), {"kv": pool},
                                              model.weights))
        has = np.array([r is not None for r in rows])
        bound = tol.bound(tol.decoder_roundings_of(model.config, context=CONTEXT))
        assert live, entry.name
        assert_within(relative_error(np.asarray(out["logits"])[has], np.asarray(want_logits)[has]), bound,
                      f"{entry.name}: logits")
        assert_within(relative_error(out["kv"], want_pools["kv"]), bound, f"{entry.name}: KV pool")


def test_a_burst_of_short_prompts_is_one_packed_call_with_each_prompts_solo_ids(checkpoint, packed_artifact, tmp_path,
                                                                                 serve_cache_dir):
    """Prefill entries of several rows are packed prefills of N = 2, 4, ... chunks (export's default for a model
    of attention layers); seven prompts of 5 tokens arriving together are one call of the N = 48 entry (35 tokens),
    not of 8 rows of 8, and each gets its solo run's ids. --no-packed (packed=False) writes the plain entries."""
    m, out = packed_artifact
    prefill = sorted((e.batch, e.packed_tokens) for e in m.entries if e.kind == af.EntryKind.PREFILL)
    assert prefill == [(1, 0), (8, 16), (8, 32), (8, 48), (8, 64)]
    prompts = [[(i * 17 + j * 5) % 250 + 3 for j in range(5)] for i in range(7)]
    with Engine.load(out, cache_dir=serve_cache_dir, progress=False) as eng:
        solo = [eng.generate([p], 6)[0] for p in prompts]
        before = dict(eng.stats()["executions_by_entry"])
        assert eng.generate(prompts, 6) == solo
        runs = {k: v - before.get(k, 0) for k, v in eng.stats()["executions_by_entry"].items()}
    assert runs.get(f"prefill_b8_n48_c{CONTEXT}") == 1
    assert not any(k.startswith("prefill_b1") for k, v in runs.items() if v)
    plain = export_checkpoint(checkpoint, tmp_path / "plain", batch_ladder=(1, 2, 4, 8), context_ladder=(CONTEXT,),
                              block_size=BLOCK, prefill_chunk=8, prefill_long_chunk=0, progress=False, mixed=False,
                              packed=False)
    assert sorted((e.batch, e.packed_tokens) for e in plain.entries if e.kind == af.EntryKind.PREFILL) == \
        [(1, 0), (2, 0), (4, 0), (8, 0)]


def test_decode_rows_ride_in_a_packed_prefill_call(checkpoint, packed_artifact, monkeypatch, serve_cache_dir):
    """Three sequences decoding when two 5-token prompts arrive: one packed call (13 tokens, N = 16) holds the two
    prompts and the three decode rows, where a packed call and a decode call would compute more positions
    (scheduler.call_cost); every id is its solo run's. With more decode rows than the entry's rows leave room for,
    none rides (the packed call reads the prompts, decode calls the rest). Control: the decode rows placed a
    position early in that call change their ids."""
    from dataclasses import replace

    from tlaloc_jax.serve.core import call_plan
    _, out = packed_artifact
    prompts = [[(i * 23 + j * 3) % 250 + 3 for j in range(5 + i)] for i in range(5)]
    with Engine.load(out, cache_dir=serve_cache_dir, progress=False) as eng:
        solo = [eng.generate([p], 6)[0] for p in prompts]
        steps = record_calls(eng, monkeypatch, lambda c: (c.entry.name, len(c.seqs)))
        got, calls = decode_then_arrive(eng, prompts[:3], prompts[3:], steps)
        assert calls == [(f"prefill_b8_n32_c{CONTEXT}", 5)] or calls == [(f"prefill_b8_n16_c{CONTEXT}", 5)], calls
        assert got == solo
        # Nine decoding and two arriving (up to 12 running): the packed entry's 8 rows cannot hold all eleven, so
        # none rides.
        crowd = [[(i * 19 + j * 5) % 250 + 3 for j in range(4 + i % 3)] for i in range(11)]
        crowd_solo = [eng.generate([p], 6)[0] for p in crowd]
        eng.scheduler.configure(max_num_seqs=12)
        got, calls = decode_then_arrive(eng, crowd[:9], crowd[9:], steps)
        eng.scheduler.configure(max_num_seqs=8)
        assert calls[0][0].startswith("prefill_b8_n") and calls[0][1] == 2, calls
        assert all(name.startswith("decode_") for name, _ in calls[1:]) and sum(n for _, n in calls[1:]) == 9, calls
        assert got == crowd_solo
        joined = call_plan.CallPlanner._joined

        def early(self, single, chunks):
            calls = joined(self, single, chunks)
            return calls and [replace(c, rows=tuple(replace(r, start=r.start - 1) if len(r.token_ids) == 1 else r
                                                    for r in c.rows)) for c in calls]
        monkeypatch.setattr(call_plan.CallPlanner, "_joined", early)
        bad, calls = decode_then_arrive(eng, prompts[:3], prompts[3:], steps)
        assert calls[0][1] == 5 and bad[:3] != solo[:3]
