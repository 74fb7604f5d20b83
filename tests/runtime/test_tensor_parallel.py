"""Tensor-parallel artifacts served by the JAX-free runtime on 2 and 4 CPU devices (one PJRT client, the CPU
plugin's `cpu_device_count`): transformers' greedy ids (near-tie rule), each prompt alone and all batched, with
every pool updated in place on every device; over HTTP (`python -m tlaloc_jax.serve` under the import guard);
a refusal on too few devices before anything is allocated; and a control that must fail (row-parallel
projections without their all-reduce). Llama at 2 devices runs in `make test`; the other families (Qwen3 GQA,
Gemma 3's ring pool, Qwen3.5's state pools, Qwen3-MoE) and 4 devices in `make test-slow`."""

from __future__ import annotations

import numpy as np
import pytest

from hf_models import build_checkpoint, load_hf_torch, torch_greedy
from oracle import GreedyMismatch, check_greedy_batch, engine_next_token
from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import load_checkpoint
from tlaloc_jax.export import export_checkpoint
from test_tp_staging import check_collectives
from tlaloc_jax.export._mesh import collective_counts
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.serve import Engine

pytestmark = pytest.mark.numeric

PROMPTS = [[5, 17, 99, 3, 249, 8, 61, 200, 14, 33, 71, 2, 90], [42], [7, 7, 1, 2, 3, 20, 10, 11, 128]]
NEW = 8
LADDER = dict(batch_ladder=(1, 4), context_ladder=(32,), block_size=8, prefill_chunk=8, prefill_long_chunk=0,
              prefill_max_batch=1,
              progress=False)
# Head counts that divide over 2 and 4 devices (the tiny defaults have 2 KV heads and 2 linear key heads).
FAMILIES = {
    "llama": dict(model_type="llama", num_key_value_heads=4),
    "qwen3": dict(model_type="qwen3", num_attention_heads=8, num_key_value_heads=4),        # GQA, 2 heads a group
    "gemma3_text": dict(model_type="gemma3_text", num_key_value_heads=4),                   # ring pool, window 8
    "qwen3_5": dict(model_type="qwen3_5", num_key_value_heads=4, linear_num_key_heads=4,
                    linear_num_value_heads=8),                                               # conv, recurrent states
    "qwen3_moe": dict(model_type="qwen3_moe", num_key_value_heads=4),                       # 8 experts
}
DEFAULT = {("llama", 2)}
CASES = [pytest.param(name, n, id=f"{name}-{n}", marks=() if (name, n) in DEFAULT else pytest.mark.slow)
         for name in FAMILIES for n in (2, 4)]


@pytest.fixture(scope="module")
def store():
    return {}


def checkpoint(store, tmp_path_factory, name):
    if ("ck", name) not in store:
        store[("ck", name)] = build_checkpoint(tmp_path_factory.mktemp(name), **FAMILIES[name])
    return store[("ck", name)]


def artifact(store, tmp_path_factory, name, n):
    if ("art", name, n) not in store:
        out = tmp_path_factory.mktemp(f"{name}-tp{n}") / "art"
        export_checkpoint(checkpoint(store, tmp_path_factory, name), out, tensor_parallel=n, mlir=True, **LADDER)
        store[("art", name, n)] = out
    return store[("art", name, n)]


def oracle(store, tmp_path_factory, name):
    if ("oracle", name) not in store:
        model = load_hf_torch(checkpoint(store, tmp_path_factory, name))
        store[("oracle", name)] = [torch_greedy(model, p, NEW) for p in PROMPTS]
    return store[("oracle", name)]


def logit_bound(store, tmp_path_factory, name) -> float:
    cfg = load_checkpoint(checkpoint(store, tmp_path_factory, name))[0]
    return tol.bound(tol.decoder_roundings_of(cfg, context=max(map(len, PROMPTS)) + NEW))


def check_engine(eng, want, bound):
    """Each prompt alone, then all three in one batch, against transformers (near-tie rule)."""
    next_token = engine_next_token(eng)
    check_greedy_batch(PROMPTS, [eng.generate([p], NEW)[0] for p in PROMPTS], want, logit_bound=bound,
                       next_token=next_token)
    check_greedy_batch(PROMPTS, eng.generate(PROMPTS, NEW), want, logit_bound=bound, next_token=next_token)


@pytest.mark.parametrize("name,n", CASES)
def test_served_on_n_devices_gives_transformers_ids(name, n, store, tmp_path_factory, serve_cache_dir):
    art = artifact(store, tmp_path_factory, name, n)
    m = af.load_manifest(art)
    assert m.devices == n and all(e.inputs for e in m.entries)
    split = [w for w in m.weights if w.shards]
    assert split and all(len(w.shards) == n for w in split)
    for e in m.entries:       # one all-reduce per attention and MLP, nothing else (tests/export/test_tp_staging.py)
        text = (art / e.body).read_text()
        if e.kind == af.EntryKind.COPY_SLOTS:
            assert not any(collective_counts(text).values()), e.name
        else:
            check_collectives(text, layers=m.model.layers)
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as eng:
        check_engine(eng, oracle(store, tmp_path_factory, name), logit_bound(store, tmp_path_factory, name))
        st = eng.stats()
        assert st["devices"] == n
        # Every pool is n buffers, one a device, and each run left each of them at its address.
        assert all(len(eng.runner.pools[p.name]) == n for p in m.pools)
        assert st["pool_address_checks"] > 0 and st["pool_in_place"] == st["pool_address_checks"]
        assert st["bytes_per_device"] < st["weight_bytes"] + st["pool_bytes"]
        if any(e.kind == af.EntryKind.COPY_SLOTS for e in m.entries):
            # State snapshots were taken and restored (prefix caching) by the copy_slots entry on every device.
            assert st["slot_copies"] > 0


def test_too_few_devices_is_refused_before_anything_is_allocated(store, tmp_path_factory, monkeypatch):
    """A plugin whose client has one device (the CPU plugin asked for one, whatever the artifact says) is refused
    by name, and so is a Runner handed a one-device client: nothing is uploaded or compiled."""
    import tlaloc_jax.serve.runtime.pjrt as pjrt
    from tlaloc_jax.serve.runtime import Runner
    art = artifact(store, tmp_path_factory, "llama", 2)
    one_device = pjrt.Device(cache_dir=None)
    real = pjrt.create_client
    monkeypatch.setattr(pjrt, "create_client", lambda plugin, req: real(plugin, {**req, "cpu_device_count": 1}))
    touched = []
    monkeypatch.setattr(pjrt.Device, "upload", lambda *a, **k: touched.append("upload"))
    monkeypatch.setattr(pjrt.Device, "compile", lambda *a, **k: touched.append("compile"))
    refusal = r"the artifact runs on 2 device\(s\) \(mesh tp=2\); the client has 1: nothing was compiled"
    with pytest.raises(af.ManifestError, match=refusal):
        Engine.load(art, cache_dir=None, progress=False)
    with pytest.raises(af.ManifestError, match=refusal):
        Runner(art, af.load_manifest(art), one_device, progress=False)
    assert touched == []


def test_control_row_parallel_projections_without_their_all_reduce_fail(store, tmp_path_factory, tmp_path,
                                                                        monkeypatch, serve_cache_dir):
    """The same export with each attention's and MLP's all-reduce left out serves ids the check refuses."""
    import tlaloc_jax.decoder as decoder
    monkeypatch.setattr(decoder, "reduce_shards", lambda cfg, x: x)
    export_checkpoint(checkpoint(store, tmp_path_factory, "llama"), tmp_path / "art", tensor_parallel=2, **LADDER)
    with Engine.load(tmp_path / "art", cache_dir=serve_cache_dir, progress=False) as eng:
        with pytest.raises(GreedyMismatch):
            check_engine(eng, oracle(store, tmp_path_factory, "llama"), logit_bound(store, tmp_path_factory, "llama"))


@pytest.mark.parametrize("name,n", CASES)
def test_http_serves_the_engines_ids_on_n_devices(name, n, store, tmp_path_factory, serve_cache_dir):
    """`python -m tlaloc_jax.serve` (no JAX in it) on the n-device artifact: completions of token-id prompts, alone
    and batched in one request, give the in-process engine's ids (which the test above holds to transformers')."""
    import openai
    from test_http import Server
    art = artifact(store, tmp_path_factory, name, n)
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as eng:
        want = [eng.generate([p], NEW)[0] for p in PROMPTS]
    srv = Server(art, serve_cache_dir, tmp_path_factory.mktemp("log") / "tp.log")
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = c.models.list().data[0].id
        alone = [c.completions.create(model=model, prompt=p, max_tokens=NEW, temperature=0).choices[0]
                 for p in PROMPTS]
        assert [(ch.model_extra or {})["token_ids"] for ch in alone] == want
        batched = c.completions.create(model=model, prompt=PROMPTS, max_tokens=NEW, temperature=0).choices
        assert {ch.index: (ch.model_extra or {})["token_ids"] for ch in batched} == dict(enumerate(want))
    finally:
        srv.stop()


def test_an_authored_step_on_two_devices(tmp_path, serve_cache_dir):
    """tests/export/test_stage.py's authored recurrence split over its channels: `mix`'s output columns, `decay` and the
    state pool per device, the head's rows too, and the one thing the author adds, the all-reduce of the head's
    partial logits. Served, it gives the in-process reference's ids, alone and batched."""
    import jax

    import tlaloc_jax
    from test_stage import E, LADDER as TOY_LADDER, PROMPTS as TOY_PROMPTS, reference_greedy, toy_step, toy_weights
    from tlaloc_jax.export import ModelInfo
    from tlaloc_jax.sharding import TP_AXIS

    def step(w, pools, inputs):
        logits, pools = toy_step(w, pools, inputs)          # on this device's channels
        return jax.lax.psum(logits, TP_AXIS), pools

    weights = toy_weights()
    m = tlaloc_jax.stage(step, weights, {"state": tlaloc_jax.StateSlots((E,), shard_axis=0)}, tmp_path / "art",
                         mesh=2, weight_split_axes={"mix": 1, "decay": 0, "head": 0},
                         model=ModelInfo(embedding_slot="embed"), progress=False, **TOY_LADDER)
    assert m.pools[0].partition == (None, "tp") and m.devices == 2
    want = [reference_greedy({k: jax.numpy.asarray(v) for k, v in weights.items()}, p, 12) for p in TOY_PROMPTS]
    with Engine.load(tmp_path / "art", cache_dir=serve_cache_dir, progress=False) as eng:
        assert [eng.generate([p], 12)[0] for p in TOY_PROMPTS] == want
        assert eng.generate(TOY_PROMPTS, 12) == want


def test_device_runs_an_spmd_body_with_one_argument_list_per_device():
    """The runtime's own layer: a column- then row-parallel product with its all-reduce, exported for an abstract
    mesh of 2, compiled and run by Device(devices=2): each device's result is the whole product (within the
    tolerance model's bound of float64), its pool shard written in place; a donation the body has no alias for
    is named per device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

    from margins import assert_within
    from tlaloc_jax.kernels.tolerances import relative_error
    from tlaloc_jax.serve.runtime import Device, DonationError

    mesh = AbstractMesh((2,), ("tp",), axis_types=(AxisType.Explicit,))

    def body(w1, w2, pool, x):
        y = jax.lax.psum((x @ w1) @ w2, "tp")
        return y, pool.at[0].set(y[0, :pool.shape[1]])

    specs = (P(None, "tp"), P("tp", None), P(None, "tp"), P())
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P(None, "tp")))
    avals = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p))
             for s, p in zip([(8, 16), (16, 8), (4, 8), (2, 8)], specs)]
    exp = jax.export.export(jax.jit(f, donate_argnums=(2,), out_shardings=(NamedSharding(mesh, P()),
                                                                            NamedSharding(mesh, P(None, "tp")))),
                            platforms=["cpu"])(*avals)
    rng = np.random.default_rng(0)
    w1, w2, pool, x = (rng.standard_normal(s).astype(np.float32) for s in [(8, 16), (16, 8), (4, 8), (2, 8)])
    want = x.astype(np.float64) @ w1 @ w2
    with Device(cache_dir=None, devices=2) as dev:
        exe = dev.compile(exp.mlir_module_serialized)

        def rows():
            return [[dev.upload(np.ascontiguousarray(a), d) for a in (w1[:, 8 * d:8 * d + 8], w2[8 * d:8 * d + 8],
                                                                        pool[:, 4 * d:4 * d + 4], x)] for d in (0, 1)]
        args = rows()
        before = [dev.device_address(r[2]) for r in args]
        outs = dev.execute_sharded(exe, args, donate={2})
        bound = tol.bound(8 + 16 + 1)
        for d in (0, 1):
            assert args[d][2].consumed and dev.device_address(outs[d][1]) == before[d]
            y = dev.to_host(outs[d][0])
            assert_within(relative_error(y, want), bound, f"SPMD product on device {d}")
            # The body writes y[0, :4] into row 0 of each device's block of the pool.
            np.testing.assert_array_equal(dev.to_host(outs[d][1])[0], y[0, :4])
        with pytest.raises(DonationError, match="3 on device 0, 3 on device 1"):
            dev.execute_sharded(exe, rows(), donate={3})
        with pytest.raises(ValueError, match="1 argument lists for 2 devices"):
            dev.execute_sharded(exe, rows()[:1])


def _whole_everywhere(raw, slot):
    """The manifest says weight `slot` is whole (its table row and every entry), though the bodies take it split."""
    for w in raw["weights"]:
        if w["slot"] == slot:
            w.pop("partition"), w.pop("shards")
            w["file"], w["sha256"] = "weights/x.bin", "0" * 64
    for e in raw["entries"]:
        for sig in e["inputs"]:
            if sig.get("slot") == slot:
                sig.pop("partition")


@pytest.mark.parametrize("change,refusal", [
    (lambda r: r["mesh"]["axes"][0].update(name="x"), r"split along 'tp', which is not a mesh axis \(x\)"),
    (lambda r: r.pop("mesh"), r"is split \[.*\], but the manifest has no mesh"),
    (lambda r: next(w for w in r["weights"] if w.get("shards"))["shards"].pop(), r"needs 2 shard files and no whole"),
    (lambda r: r["pools"][0].pop("partition"), r"POOL_IN kv is split .*; the manifest keeps it whole"),
    (lambda r: r["mesh"]["axes"][0].update(size=4), r"split into 4 blocks: it needs 4 shard files .* \(it has 2\)"),
    (lambda r: _whole_everywhere(r, "attn.o_proj.0.out_in"),
     r"argument \d+ \(WEIGHT attn.o_proj.0.out_in\) is split \[None, 'tp'\] in the body, the manifest says \[\]"),
], ids=["unknown-axis", "no-mesh", "missing-shard", "pool-whole", "mesh-size", "body-split"])
def test_a_mesh_manifest_that_misstates_its_split_is_refused_at_load(change, refusal, store, tmp_path_factory,
                                                                      tmp_path):
    import json
    import shutil
    art = tmp_path / "art"
    shutil.copytree(artifact(store, tmp_path_factory, "llama", 2), art)
    raw = json.loads((art / af.MANIFEST_NAME).read_text())
    change(raw)
    (art / af.MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(af.ManifestError, match=refusal):
        af.load_manifest(art, verify_weights=False)


def test_a_body_partitioned_for_other_devices_than_the_manifest_says_is_named(store, tmp_path_factory):
    art = artifact(store, tmp_path_factory, "llama", 2)
    m = af.load_manifest(art, verify_weights=False)
    e = m.entries[0]
    sig = af.main_signature((art / e.serialized).read_bytes())
    assert sig.partitions == 2 and af.signature_mismatch(e.inputs, e.outputs, e.donations, sig, 2) is None
    assert "partitioned for 2 devices, the manifest's mesh has 1" in \
        af.signature_mismatch(e.inputs, e.outputs, e.donations, sig, 1)
