"""The JAX-free runtime on the CPU PJRT plugin: parity, batching, in-place pools, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_models import build_checkpoint, load_hf_torch, torch_greedy
from import_guard import guarded
from oracle import GreedyMismatch, check_greedy_batch, engine_next_token, kv_one_slot_off
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.serve import Engine, RequestRefused, Sampling

LADDER = dict(batch_ladder=(1, 4), context_ladder=(32, 64), block_size=8, prefill_chunk=16, prefill_long_chunk=0,
              progress=False)
PROMPTS = [[5, 17, 99, 3, 250, 8, 61], [42], [7, 7, 7, 1, 2, 3, 200, 100, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]]
PLACEHOLDER = 251


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("executables")


def _export(root: Path, name: str, model_type: str, *, seed: int, tied=False, weight_dtype="float32", config=None,
            **ladder):
    ck = build_checkpoint(root / f"{name}-ck", model_type, seed=seed, tied=tied)
    if config:
        cfg = json.loads((ck / "config.json").read_text())
        cfg.update(config)
        (ck / "config.json").write_text(json.dumps(cfg))
    export_checkpoint(ck, root / name, weight_dtype_name=weight_dtype, **{**LADDER, **ladder})
    return ck, root / name


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("llama"), "llama", "llama", seed=21,
                   config={"image_token_id": PLACEHOLDER})


@pytest.fixture(scope="module")
def llama_engine(llama, cache_dir):
    with Engine.load(llama[1], cache_dir=cache_dir, progress=False) as eng:
        yield eng


CASES = {
    "qwen3-tied-f32": dict(model_type="qwen3", seed=22, tied=True),
    "qwen3-untied-bf16": dict(model_type="qwen3", seed=23, weight_dtype="bfloat16"),
    "llama-tied-bf16": dict(model_type="llama", seed=24, tied=True, weight_dtype="bfloat16"),
}


def logit_bound(ck: Path, bf16: bool) -> float:
    """The tolerance model's bound for a served logit against transformers: f32 paths, or (bf16 weights
    against transformers run in bf16) bf16 rounding at every activation on transformers' side."""
    import tlaloc_jax
    cfg = tlaloc_jax.load_hf(ck).config
    roundings = {"float32": tol.decoder_roundings_of(cfg, context=max(map(len, PROMPTS)) + 16)}
    if bf16:
        roundings["bfloat16"] = tol.bf16_rounding_points(cfg.num_layers, every_activation=True)
    return tol.bound(roundings)


def check_served_ids(eng: Engine, want, bound: float) -> None:
    """The engine's ids for the prompts alone and decoded together, against the oracle's (near-tie rule)."""
    next_token = engine_next_token(eng)
    check_greedy_batch(PROMPTS, [eng.generate([p], 16)[0] for p in PROMPTS], want, logit_bound=bound,
                       next_token=next_token)
    check_greedy_batch(PROMPTS, eng.generate(PROMPTS, 16), want, logit_bound=bound, next_token=next_token)


@pytest.mark.numeric
def test_llama_f32_gives_transformers_ids_alone_and_together(llama, llama_engine, monkeypatch):
    ref = load_hf_torch(llama[0])
    want = [torch_greedy(ref, p, 16) for p in PROMPTS]
    bound = logit_bound(llama[0], bf16=False)
    written = llama_engine.runner.stats["inputs_overwritten"]
    check_served_ids(llama_engine, want, bound)
    # The steps' new positions and slots were written over the entries' kept input buffers (Device.overwrite).
    assert llama_engine.runner.stats["inputs_overwritten"] > written
    # Control: the same engine writing each token's KV one slot off fails the same check.
    kv_one_slot_off(monkeypatch)
    with pytest.raises(GreedyMismatch):
        check_served_ids(llama_engine, want, bound)


@pytest.mark.numeric
# llama-tied-bf16 runs in `make test-slow`: qwen3-untied-bf16 covers bf16 weights, the llama test above llama.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "llama-tied-bf16" else c
                                  for c in CASES])
def test_other_models_give_transformers_ids(case, tmp_path, cache_dir, monkeypatch):
    """f32 weights against transformers in f32; bf16 weights against transformers run in bf16. The two
    bf16 paths round differently (transformers rounds every activation, the artifact only each projection's
    input), so bf16 ids may part at a near-tie within the tolerance model's bf16 bound."""
    import torch
    kw = CASES[case]
    bf16 = kw.get("weight_dtype") == "bfloat16"
    ck, art = _export(tmp_path, case, prefill_max_batch=1, **kw)
    ref = load_hf_torch(ck, dtype=torch.bfloat16 if bf16 else torch.float32)
    want = [torch_greedy(ref, p, 16) for p in PROMPTS]
    bound = logit_bound(ck, bf16)
    with Engine.load(art, cache_dir=cache_dir, progress=False) as eng:
        check_served_ids(eng, want, bound)
        kv_one_slot_off(monkeypatch)
        with pytest.raises(GreedyMismatch):
            check_served_ids(eng, want, bound)


def _drive(eng: Engine, schedule: dict[int, list[int]], max_new: int = 16) -> dict[int, list[int]]:
    """Start prompt i at step schedule-key; step until all finish; -> {i: ids}."""
    rids, step = {}, 0
    while True:
        for i, prompt in schedule.get(step, []):
            rids[i] = eng.add_request(prompt, max_new)
        if not eng.has_unfinished() and step > max(schedule):
            break
        eng.step()
        step += 1
    out = {i: eng.output(r) for i, r in rids.items()}
    for r in rids.values():
        eng.release(r)
    return out


def test_four_sequences_started_at_different_times_equal_their_solo_runs(llama_engine):
    prompts = PROMPTS + [[9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2]]
    solo = [llama_engine.generate([p], 16)[0] for p in prompts]
    before = llama_engine.stats()["batch_sizes"].get(4, 0)
    got = _drive(llama_engine, {0: [(0, prompts[0])], 2: [(1, prompts[1])], 3: [(2, prompts[2])],
                                7: [(3, prompts[3])]})
    assert [got[i] for i in range(4)] == solo
    assert llama_engine.stats()["batch_sizes"].get(4, 0) > before, "the four never shared a decode call"


def test_pool_stays_in_place_over_100_decode_steps_and_moves_without_donation(llama, cache_dir):
    for donate in (True, False):
        with Engine.load(llama[1], cache_dir=cache_dir, progress=False, donate=donate) as eng:
            ids = eng.generate([[1, 2, 3]], max_new_tokens=50)[0] + eng.generate([[4, 5]], max_new_tokens=55)[0]
            st = eng.stats()
            assert st["executions"] >= 100 and st["pool_address_checks"] >= 100
            if donate:
                assert st["pool_in_place"] == st["pool_address_checks"]
                ids_donated = ids
            else:   # control: the same ids, but every run wrote its pool somewhere new
                assert st["pool_in_place"] == 0
                assert ids == ids_donated


def _pages(eng):
    return eng.stats()["pages_in_use"]


@pytest.mark.parametrize("bad, kind, message", [
    ([1, 2, PLACEHOLDER, 3], "placeholder_token", rf"refused token {PLACEHOLDER} .*config key image_token_id"),
    ([1, 2, 256], "out_of_vocabulary", r"token id 256 is outside the vocabulary \(size 256\)"),
    (list(range(1, 66)), "too_long", r"prompt of 65 tokens is longer than the largest context 64"),
    (list(range(1, 60)), "too_long", r"prompt of 59 tokens plus max_new_tokens 16 exceeds the largest context 64"),
    ([], "empty_prompt", r"prompt is empty"),
])
def test_refusals_name_the_cause_and_change_nothing(llama_engine, bad, kind, message):
    solo = llama_engine.generate([PROMPTS[0]], 16)[0]
    rid = llama_engine.add_request(PROMPTS[0], 16)
    for _ in range(3):
        llama_engine.step()
    pages = _pages(llama_engine)
    with pytest.raises(RequestRefused, match=message) as err:
        llama_engine.add_request(bad, 16)
    assert err.value.kind == kind
    assert _pages(llama_engine) == pages
    while llama_engine.has_unfinished():
        llama_engine.step()
    assert llama_engine.output(rid) == solo
    llama_engine.release(rid)
    # Once the cause is gone the same sequence runs to its solo ids.
    fixed = [t for t in bad if t not in (PLACEHOLDER, 256)][:40] or [3]
    assert llama_engine.generate([fixed], 16) == [llama_engine.generate([fixed], 16)[0]]


def test_a_full_pool_queues_and_preempts_and_every_sequence_gets_its_solo_ids(tmp_path, cache_dir):
    """8 pages of 8 (one sequence of the largest context, the smallest pool the exporter writes): a sequence of
    18 + 15 positions needs 5 pages, so two never fit at once. All three are queued (nothing refused); the later
    ones start while the first holds 3 pages, and as pages run out the youngest is preempted, computed again later,
    and each gets its solo ids."""
    ck, art = _export(tmp_path, "small-pool", "llama", seed=25, num_blocks=8)
    with Engine.load(art, cache_dir=cache_dir, progress=False, enable_prefix_caching=False) as eng:
        solo = eng.generate([PROMPTS[2]], 16)[0]
        other = eng.generate([PROMPTS[0]], 16)[0]
        assert eng.generate([PROMPTS[2], PROMPTS[0], PROMPTS[2]], 16) == [solo, other, solo]
        assert eng.stats()["preemptions"] > 0 and eng.stats()["pages_in_use"] == 0


def test_an_engine_error_fails_its_requests_and_the_others_go_on(llama_engine, monkeypatch):
    solo = [llama_engine.generate([p], 16)[0] for p in (PROMPTS[0], PROMPTS[2])]
    a = llama_engine.add_request(PROMPTS[0], 16)
    llama_engine.step()
    llama_engine.step()
    real = llama_engine.runner.run

    def failing(entry, inputs, want):
        # A mixed call (the running sequence's decode row and b's chunk) fails too, and is run again as the decode
        # call and the prefill call it stands for: only b's fails.
        if entry.kind in ("prefill", "mixed"):
            raise RuntimeError("injected device fault")
        return real(entry, inputs, want)

    monkeypatch.setattr(llama_engine.runner, "run", failing)
    b = llama_engine.add_request(PROMPTS[2], 16)       # 18 tokens: read by a prefill call of its own
    events = llama_engine.step()
    failed = [e for e in events if e.request_id == b]
    assert failed and failed[0].finish_reason == "error" and "injected device fault" in failed[0].error
    monkeypatch.setattr(llama_engine.runner, "run", real)
    while llama_engine.has_unfinished():
        llama_engine.step()
    assert llama_engine.output(a) == solo[0]
    llama_engine.release(a)
    llama_engine.release(b)
    assert llama_engine.stats()["pages_in_use"] == 0
    assert llama_engine.generate([PROMPTS[2]], 16) == [solo[1]]


def test_sampling_is_seeded_and_greedy_pulls_no_logits(llama_engine):
    before = llama_engine.stats()["logits_pulled"]
    llama_engine.generate([PROMPTS[0]], 8)
    assert llama_engine.stats()["logits_pulled"] == before
    s = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=123)
    a = llama_engine.generate([PROMPTS[0]], 8, sampling=s)
    b = llama_engine.generate([PROMPTS[0]], 8, sampling=s)
    c = llama_engine.generate([PROMPTS[0]], 8, sampling=Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=124))
    assert a == b and a != c
    assert llama_engine.stats()["logits_pulled"] > before


def test_second_load_uses_the_compile_cache(llama, tmp_path):
    with Engine.load(llama[1], cache_dir=tmp_path / "c", progress=False) as eng:
        # A cold load compiles one entry of each kind; the others compile on first use (here: all, on access).
        kinds = {e.kind for e in eng.manifest.entries}
        assert eng.compile_report() == {"miss": len(kinds), "pending": len(eng.manifest.entries) - len(kinds)}
        want = eng.generate([PROMPTS[0]], 4)
        assert len(eng.executables) == len(eng.manifest.entries)
        assert eng.compile_report() == {"miss": len(eng.manifest.entries)}
    with Engine.load(llama[1], cache_dir=tmp_path / "c", progress=False) as eng:
        # Cached executables load on first use: a warm start loads none until a call needs it.
        n = len(eng.manifest.entries)
        assert eng.compile_report() == {"cached": n}
        st = eng.stats()
        assert st["weight_bytes"] > 0 and st["pool_bytes"] == 2 * 3 * 2 * 32 * 8 * 2 * 16 * 4 // 2
        assert eng.generate([PROMPTS[0]], 4) == want
        used = set(eng.stats()["executions_by_entry"])
        assert used and eng.compile_report() == {"cached": n - len(used), "hit": len(used)}


GUARD = guarded(textwrap.dedent("""
    import json
    from tlaloc_jax.serve import Engine
    with Engine.load(sys.argv[1], cache_dir=sys.argv[2], progress=False) as eng:
        ids = eng.generate(json.loads(sys.argv[3]), 16)
    assert not BANNED & {m.split(".")[0] for m in sys.modules}
    print(json.dumps(ids))
"""))


def test_serving_path_imports_no_jax_torch_or_transformers(llama, llama_engine, cache_dir):
    r = subprocess.run([sys.executable, "-c", GUARD, str(llama[1]), str(cache_dir), json.dumps(PROMPTS)],
                       capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == llama_engine.generate(PROMPTS, 16)
    # Control: the guard does bite.
    r = subprocess.run([sys.executable, "-c", GUARD.replace("from tlaloc_jax.serve import Engine",
                                                            "import tlaloc_jax.model"), "x", "y", "[]"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "the serving path imported jax" in r.stderr


def test_no_entry_copies_the_pool_inside_its_body(tmp_path, cache_dir):
    """Donation can put the output at the pool's address while the body still copies the pool into
    scratch memory (XLA does when a step reads a slice of a buffer it also updates). Temporary memory
    far below the pool's size shows the scatter and gathers work on the donated buffer itself."""
    _, art = _export(tmp_path, "big-pool", "llama", seed=26, batch_ladder=(1, 4), context_ladder=(64,),
                     num_blocks=4096)
    with Engine.load(art, cache_dir=cache_dir, progress=False) as eng:
        assert eng.pool_bytes > 20 * 2**20
        for name, exe in eng.executables.items():
            stats = exe.memory_stats()
            assert stats["alias_size_in_bytes"] == eng.pool_bytes, name
            assert stats["temp_size_in_bytes"] < eng.pool_bytes / 10, (name, stats["temp_size_in_bytes"])


def test_an_artifact_for_another_platform_is_refused_at_load(tmp_path, cache_dir):
    """The export lowers for CUDA without a GPU (no custom_call in the bodies but the Pallas decode kernel's
    Triton call); the CPU plugin refuses that artifact by name before compiling anything."""
    from tlaloc_jax import artifact as af
    _, art = _export(tmp_path, "cuda", "llama", seed=27, batch_ladder=(1,), context_ladder=(32,), platform="cuda",
                     mlir=True)
    m = af.load_manifest(art)
    assert m.versions.platform == "cuda"
    from tlaloc_jax.export import custom_call_targets
    from tlaloc_jax.kernels.paged_attention_gpu import TRITON_CUSTOM_CALL
    assert all(custom_call_targets((art / e.body).read_text()) <= {TRITON_CUSTOM_CALL} for e in m.entries)
    with pytest.raises(af.ManifestError, match=r"exported for cuda, the plugin .* is cpu"):
        Engine.load(art, cache_dir=cache_dir, progress=False)
