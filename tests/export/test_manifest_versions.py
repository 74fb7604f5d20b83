"""Manifest v4 beside the v2 and v3 artifacts an older exporter wrote (tests/fixtures, see make_v2_v3.py):
the old artifacts still load and serve, and the built-in families staged through `stage` give the old
bodies' logits and pools on the same inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tlaloc_jax
from bodies import entry_args, run_body
from fixtures.make_v2_v3 import LADDER
from hf_models import load_hf_torch, torch_greedy
from margins import assert_within
from oracle import check_greedy_batch, engine_next_token
from tlaloc_jax import artifact as af
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.serve.core.kv_cache import UnitPool
from tlaloc_jax.serve.core.paging import build_step_inputs, pool_rule, row_call
from tlaloc_jax.serve import Engine

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CASES = {"v2": ("artifact_v2", "ck_llama", af.SCHEMA_V2), "v3": ("artifact_v3", "ck_gemma3", af.SCHEMA_V3)}
PROMPTS = [[5, 17, 33, 3, 25, 8, 61, 2, 9, 11, 40], [42], [7, 7, 7, 1, 2, 3, 20, 10]]

pytestmark = pytest.mark.numeric


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    art, ck, schema = CASES[request.param]
    staged = tmp_path_factory.mktemp(request.param) / "v4"
    # The fixtures predate mixed entries, packed prefills and the long prefill chunk.
    export_checkpoint(FIXTURES / ck, staged, mixed=False, packed=False, prefill_long_chunk=0, exported=True, **LADDER)
    return af.load_manifest(FIXTURES / art), FIXTURES / art, af.load_manifest(staged), staged, FIXTURES / ck, schema


def test_old_manifests_load_as_the_v4_model(case):
    old, _, new, _, _, schema = case
    assert old.schema == schema and new.schema == af.SCHEMA_V5
    assert {(p.name, p.kind, p.capacity, p.shape, p.window, p.ring_pages) for p in old.pools} == \
           {(p.name, p.kind, p.capacity, p.shape, p.window, p.ring_pages) for p in new.pools}
    assert sorted(e.name for e in old.entries) == sorted(e.name for e in new.entries)
    assert all(not w.sha256 for w in old.weights) and all(w.sha256 for w in new.weights)


def _random_call(m: af.Manifest, entry: af.Entry, rng):
    """Rows of random tokens at random positions, with what each sequence holds of each kind of pool."""
    allocs = {k: UnitPool(m.capacity(k)) for k in m.pool_kinds}
    rules = {k: pool_rule(m.pools_of(k)[0], m.block_size) for k in m.pool_kinds}
    rows = []
    for _ in range(entry.batch):
        n = 1 if entry.kind == af.EntryKind.DECODE else int(rng.integers(1, entry.tokens_per_seq + 1))
        start = int(rng.integers(0, entry.context - n + 1))
        if m.ring:
            n = min(n, rules[af.PoolKind.RING_KV].call_limit(start))
        held = {k: allocs[k].take(rules[k].units(start + n)) for k in m.pool_kinds}
        rows.append(row_call(rng.integers(0, m.model.vocab, n).tolist(), start, held))
    return build_step_inputs(rows, batch=entry.batch, tokens=entry.tokens_per_seq,
                             width=entry.context // m.block_size, block_size=m.block_size,
                             ring_pages=m.ring.ring_pages if m.ring else 0)


def test_staged_bodies_give_the_old_bodies_logits_and_pools(case):
    old, old_art, new, new_art, ck, _ = case
    weights = tlaloc_jax.load_hf(ck).weights
    cfg = tlaloc_jax.load_hf(ck).config
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=max(LADDER["context_ladder"])))
    rng = np.random.default_rng(5)
    for old_entry in old.entries:
        new_entry = new.entry(old_entry.name)
        inputs = _random_call(old, old_entry, rng)
        pools = {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in old.pools}
        want = run_body(old_art, old_entry, entry_args(old_entry, inputs, pools, weights))
        got = run_body(new_art, new_entry, entry_args(new_entry, inputs, pools, weights))
        for key in ["logits"] + [p.name for p in old.pools]:
            # The new bodies read the projections [out, in] (tlaloc_jax.layout) and may sum in another order: the
            # decoder's rounding model bounds the difference.
            assert_within(relative_error(got[key], want[key]), bound, f"{old_entry.name}: {key}")
        # Control: the same call with another weight set (a transposed projection) is told apart.
        broken = dict(weights, **{"attn.o_proj": np.swapaxes(weights["attn.o_proj"], -1, -2)})
        other = run_body(new_art, new_entry, entry_args(new_entry, inputs, pools, broken))
        assert relative_error(other["logits"], want["logits"]) > 1e-3


def test_old_artifacts_serve_transformers_ids(case, tmp_path):
    _, old_art, _, _, ck, _ = case
    want = [torch_greedy(load_hf_torch(ck), p, 12) for p in PROMPTS]
    bound = tol.bound(tol.decoder_roundings_of(tlaloc_jax.load_hf(ck).config, context=32))
    with Engine.load(old_art, cache_dir=tmp_path, progress=False) as eng:
        next_token = engine_next_token(eng)
        check_greedy_batch(PROMPTS, [eng.generate([p], 12)[0] for p in PROMPTS], want, logit_bound=bound,
                           next_token=next_token)
        # Two together: the fixtures' pools hold two sequences of the largest context.
        check_greedy_batch(PROMPTS[:2], eng.generate(PROMPTS[:2], 12), want[:2], logit_bound=bound,
                           next_token=next_token)


def test_a_new_manifest_without_hashes_or_with_a_v3_pool_role_is_refused(case, tmp_path):
    _, _, _, new_art, _, _ = case
    for name, edit, message in (
            ("nohash", lambda r: r["weights"][0].update(sha256=""), r"has no sha256 \(tlaloc-serving-v5"),
            ("oldrole", lambda r: r["entries"][0]["inputs"][-1].update(role="KV_POOL_IN"),
             r"role is 'KV_POOL_IN', not a known Role")):
        bad = tmp_path / name
        shutil.copytree(new_art, bad)
        raw = json.loads((bad / af.MANIFEST_NAME).read_text())
        edit(raw)
        (bad / af.MANIFEST_NAME).write_text(json.dumps(raw))
        with pytest.raises(af.ManifestError, match=message):
            af.load_manifest(bad)
