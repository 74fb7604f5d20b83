"""Sliding-window models end to end: the windowed KV pool (rings, a ring_kv pool) against full-history pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tlaloc_jax
from bodies import entry_args, run_body
from hf_models import build_checkpoint, load_hf_torch, torch_greedy
from margins import assert_within
from oracle import GreedyMismatch, check_greedy_batch, engine_next_token, kv_one_slot_off
from tlaloc_jax import artifact as af
from tlaloc_jax.decoder import StepInputs, forward, init_pools
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.serve.core.kv_cache import UnitPool
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs, pages_for, ring_call_limit
from tlaloc_jax.serve import Engine

pytestmark = pytest.mark.numeric

WINDOW, S, CHUNK = 8, 8, 16
LADDER = dict(batch_ladder=(1, 4), context_ladder=(32, 96), block_size=S, prefill_chunk=CHUNK, prefill_long_chunk=0,
              progress=False, exported=True)
PROMPTS = [[5, 17, 99, 3, 250, 8, 61], [(i * 37 + 11) % 256 for i in range(41)],
           [7, 7, 7, 1, 2, 3, 200, 100, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43], [9] * 25]
FAMILIES = {"mistral": dict(seed=41), "gemma2": dict(seed=42, tied=True), "gemma3_text": dict(seed=43, tied=True)}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("executables")


# mistral (every layer sliding) runs in `make test-slow`: the fast run keeps the two families that mix sliding and
# global layers, and test_decoder_parity checks mistral's window against transformers.
@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n == "mistral" else n
                                        for n in FAMILIES])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    ck = build_checkpoint(root / "ck", request.param, **FAMILIES[request.param])
    windowed = export_checkpoint(ck, root / "windowed", **LADDER)
    full = export_checkpoint(ck, root / "full", windowed_kv=False, **LADDER)
    return request.param, ck, (windowed, root / "windowed"), (full, root / "full")


def test_manifests(family):
    _, _, (w, _), (f, _) = family
    assert w.schema == f.schema == af.SCHEMA_V5
    win = w.pool("window_kv")
    assert win.kind == af.PoolKind.RING_KV and w.ring is win
    assert win.window == WINDOW and win.ring_pages == pages_for(WINDOW - 1 + CHUNK, S) == 3
    assert set(win.layers) == {i for i, t in enumerate(tlaloc_jax.load_hf(family[1]).config.layer_types)
                               if t == "sliding_attention"}
    assert f.pool("window_kv") is None and f.ring is None and f.pool("kv").kind == af.PoolKind.PAGED_KV


def logit_bound(ck, context: int) -> float:
    return tol.bound(tol.decoder_roundings_of(tlaloc_jax.load_hf(ck).config, context=context))


def test_runtime_gives_transformers_ids_alone_and_four_together(family, cache_dir, monkeypatch):
    _, ck, (_, art), _ = family
    ref = load_hf_torch(ck)
    want = [torch_greedy(ref, p, 16) for p in PROMPTS]
    bound = logit_bound(ck, max(map(len, PROMPTS)) + 16)

    def check(eng):
        next_token = engine_next_token(eng)
        check_greedy_batch(PROMPTS, [eng.generate([p], 16)[0] for p in PROMPTS], want, logit_bound=bound,
                           next_token=next_token)
        check_greedy_batch(PROMPTS, eng.generate(PROMPTS, 16), want, logit_bound=bound, next_token=next_token)

    with Engine.load(art, cache_dir=cache_dir, progress=False) as eng:
        check(eng)
        assert eng.stats()["pool_in_place"] == eng.stats()["pool_address_checks"]
        # Control: keys and values written one slot off (the rings included) fail the same check.
        kv_one_slot_off(monkeypatch)
        with pytest.raises(GreedyMismatch):
            check(eng)


def test_windowed_and_full_artifacts_agree_over_several_windows(family):
    """The same calls (chunks of 5, then decode steps, 70 positions) through both artifacts' bodies.
    Free pages and ring slots outside the window hold NaN: the outputs stay finite."""
    _, ck, (wm, wart), (fm, fart) = family
    model = tlaloc_jax.load_hf(ck, block_size=S)
    weights = {k: jnp.asarray(v) for k, v in model.weights.items()}
    pools = {name: {p.name: jnp.full(p.shape, jnp.nan, jnp.float32) for p in m.pools} for name, m in
             (("w", wm), ("f", fm))}
    full_alloc, ring_alloc = UnitPool(fm.pool("kv").capacity), UnitPool(wm.pool("window_kv").capacity)
    pages, ring = full_alloc.take(96 // S), ring_alloc.take(wm.ring.ring_pages)
    tokens = [(i * 13 + 5) % 256 for i in range(70)]
    p0, worst, calls = 0, 0.0, 0
    while p0 < len(tokens):
        n = 5 if p0 < 40 else 1
        kind = "prefill" if n > 1 else "decode"
        ctx = 32 if p0 + n <= 32 else 96
        results = {}
        for key, m, art in (("w", wm, wart), ("f", fm, fart)):
            entry = m.entry(f"{kind}_b1_c{ctx}")
            inputs = build_step_inputs([RowCall(tokens[p0:p0 + n], p0, pages, ring)], batch=1,
                                       tokens=entry.tokens_per_seq, width=ctx // S, block_size=S,
                                       ring_pages=m.ring.ring_pages if m.ring else 0)
            outs = run_body(art, entry, entry_args(entry, inputs, pools[key], weights))
            for p in m.pools:
                pools[key][p.name] = outs[p.name]
            results[key] = np.asarray(outs["logits"])
        assert np.isfinite(results["w"]).all() and np.isfinite(results["f"]).all()
        worst = max(worst, relative_error(results["w"], results["f"]))
        p0 += n
        calls += 1
    assert calls > 30
    # The same math over rings and over full-history pages: attention sums in other orders.
    assert_within(worst, logit_bound(family[1], len(tokens)), f"{family[0]}: windowed vs full-history bodies")


def _in_process(cfg, weights, tokens, call, ring_pages, override_first=None):
    """Logits after feeding `tokens` in calls of `call` through the decoder; ring_pages 0: full-history."""
    full_pages = list(range(pages_for(len(tokens), S)))
    ring = [20 + i for i in range(max(ring_pages, 1))]
    pools = init_pools(cfg, 64, S, window_blocks=64 if ring_pages else 0)
    pools = {k: jnp.full_like(v, jnp.nan) for k, v in pools.items()}
    step = jax.jit(lambda p, i: forward(cfg, weights, p, i, ring_pages=ring_pages))
    p0 = 0
    while p0 < len(tokens):
        n = min(override_first if (override_first and p0 > 0) else call, len(tokens) - p0)
        width = 96 // S
        inputs = build_step_inputs([RowCall(tokens[p0:p0 + n], p0, full_pages, ring[:ring_pages] if ring_pages else ())],
                                   batch=1, tokens=n, width=width, block_size=S, ring_pages=ring_pages)
        logits, pools = step(pools, StepInputs(**{k: jnp.asarray(v) for k, v in inputs.items()}))
        p0 += n
    return np.asarray(logits)


def test_controls_ring_one_page_short_and_call_one_token_too_long(tmp_path):
    ck = build_checkpoint(tmp_path / "ck", "mistral", seed=41)
    model = tlaloc_jax.load_hf(ck, block_size=S)
    cfg, weights = model.config, model.weights
    tokens = [(i * 13 + 5) % 256 for i in range(60)]
    R = pages_for(WINDOW - 1 + 6, S)
    full = _in_process(cfg, weights, tokens, 6, 0)
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=len(tokens)))
    assert_within(relative_error(_in_process(cfg, weights, tokens, 6, R), full), bound, "ring vs full, in process")
    assert relative_error(_in_process(cfg, weights, tokens, 6, R - 1), full) > 1e-3
    limit = ring_call_limit(WINDOW, WINDOW, R, S)     # past the first window
    assert_within(relative_error(_in_process(cfg, weights, tokens, 6, R, override_first=limit), full), bound,
                  "ring vs full, longest call")
    assert relative_error(_in_process(cfg, weights, tokens, 6, R, override_first=limit + 1), full) > 1e-3


def test_a_sequence_ten_windows_long_holds_only_its_ring(family, cache_dir):
    name, ck, (wm, art), _ = family
    R = wm.ring.ring_pages
    with Engine.load(art, cache_dir=cache_dir, progress=False) as eng:
        rid = eng.add_request([3, 1, 4, 1, 5], max_new_tokens=76)      # 80 positions: 10 windows
        held_full, held_ring = [], []
        while eng.has_unfinished():
            eng.step()
            st = eng.stats()["pools"]
            held_full.append(st["kv"]["pages_in_use"] if "kv" in st else None)
            held_ring.append(st["window_kv"]["pages_in_use"])
        assert max(held_ring) == R and held_ring[-1] == 0   # the ring stops growing at R pages; freed at the end
        if wm.pool("kv") is not None:                            # the full-attention layers' pages follow the sequence
            growing = held_full[:-1]
            assert growing == sorted(growing) and growing[0] == 1 and growing[-1] == pages_for(80, S) == 10
            assert held_full[-1] == 0
        else:                                                 # Mistral: every layer slides, no full-history pool
            assert name == "mistral" and set(held_full) == {None}
        assert len(eng.output(rid)) == 76
