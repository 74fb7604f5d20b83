"""GPU decode bench: bodies exported on a CPU machine for cuda, timed on a GPU machine through the JAX-free
runtime and through in-process JAX, each step printed as a multiple of the HBM floor (docs/gpu.md).

Here (the project's .venv, no GPU needed; about 3 minutes, most of it the Qwen3-0.6B-shape export):

    .venv/bin/python -m bench.gpu kit                     # -> .gpu-bench/ (git-ignored, about 3 MiB)

On the GPU machine, from the project root with .gpu-bench/ carried along (python3 with jax[cuda] and ml_dtypes;
no pypjrt, no project install needed: the kit holds both), in under 5 minutes:

    python3 -m bench.gpu run

On this CPU machine, the same stages on a tiny model exported for cpu (checks the script, measures nothing
of the GPU):

    .venv/bin/python -m bench.gpu dry-run

Models: "qwen3-0.6b" (Qwen3-0.6B's shape: 28 layers, hidden 1024, 16/8 heads of 128, vocab 151936, tied, bf16
weights and KV; pool of 4,096 pages of 16; decode batches 1, 8, 32, 64 at context 1024, position 512; a
256-token prefill at batch 1) and "tiny" (3 layers, hidden 256, 8/4 heads of 64, vocab 4096, bf16; decode
batches 1 and 8, the same prefill: a step's cost per layer and kernel, not per byte). Each is
exported twice for cuda: decode attention through the Pallas kernel (tlaloc_jax/kernels/paged_attention_gpu.py) and
through plain ops ("xla"), so one run compares them. The kit holds no weight files: the run writes random
ones of the lengths the manifest names.

`kit --tensor-parallel 2,4` also exports each model for 2 and 4 GPUs ("tiny-tp2-xla", ...: docs/multi-device.md);
the run times those on the machine's first N GPUs through the JAX-free runtime (a machine with fewer GPUs reports
the artifact refused by name), its floor the bytes one GPU reads. In-process JAX is not run on them.

The run's stages are processes of their own: "runtime" (jax, jaxlib unimportable: the JAX-free path) loads the
variants of a model one after another (pypjrt holds one accelerator client a process) and times each entry; "jax"
runs the same bodies through jax.export.deserialize, variants alternated, and measures the HBM copy rate. Each
prints RESULT {json} lines; the run prints the table from them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
DEFAULT_KIT = ROOT / ".gpu-bench"

MODELS = {
    "qwen3-0.6b": dict(
        hf=dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                max_position_embeddings=40960, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        batches=(1, 8, 32, 64), context=1024, block_size=16, num_blocks=4096, prefill=256, dtype="bfloat16",
        serving=True),
    "tiny": dict(
        hf=dict(model_type="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6,
                max_position_embeddings=4096, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        batches=(1, 8), context=1024, block_size=16, num_blocks=512, prefill=256, dtype="bfloat16", serving=False),
}
# Seconds each stage process may take on the device (compiles included), per model.
STAGE_TIMEOUT = {"runtime": 150, "jax": 170, "serving": 90}
# The serving stage's load: clients (requests at once) per cell, prompt and output tokens of each request.
SERVING = dict(clients=(8, 32), prompt=64, output=64)
VARIANTS = ("pallas", "xla")
PACKAGES = {"tlaloc_jax": "tlaloc_jax", "tlaloc_jax/export": "export", "tlaloc_jax/serve": "serve"}


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


# --- here: the kit --------------------------------------------------------------------------------------


def export_model(name: str, out: Path, *, platform: str, decode_attention: str, tensor_parallel: int = 1) -> None:
    """Stage the built-in decoder at a model's shape with zero weights (their bytes are written on the device), for
    `tensor_parallel` devices."""
    import functools

    import ml_dtypes
    import numpy as np

    from tlaloc_jax.decoder import decoder_pools, forward
    from tlaloc_jax.export import Capacity, Ladders, ModelInfo, stage
    from tlaloc_jax.export._artifact import tensor_parallel_decoder
    from tlaloc_jax.families import config_from_hf

    spec = MODELS[name]
    fam, cfg = config_from_hf(spec["hf"])
    dtype = ml_dtypes.bfloat16 if spec["dtype"] == "bfloat16" else np.float32
    weights = {s.slot: np.zeros(s.slot_shape(cfg), dtype) for s in fam.slots(cfg)}
    pools = decoder_pools(cfg, windowed=False, kv_dtype=spec["dtype"], ring_pages=0)
    weights, shard_cfg, split_axes = tensor_parallel_decoder(cfg, weights, tensor_parallel)
    step = functools.partial(forward, shard_cfg, decode_attention=decode_attention)
    tmp = out.with_name(out.name + ".full")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    # exported: the "jax" stage runs the same bodies through jax.export.deserialize.
    stage(step, weights, pools, tmp, platform=platform, progress=False, mesh=tensor_parallel,
          weight_split_axes=split_axes, exported=True,
          ladders=Ladders(batch=spec["batches"], context=(spec["context"],), prefill_max_batch=1,
                          prefill_chunk=spec["prefill"]),
          capacity=Capacity(block_size=spec["block_size"], paged_kv=spec["num_blocks"]),
          model=ModelInfo(name=name, model_type=cfg.model_type, embedding_slot="embed", layers=cfg.num_layers,
                          heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                          hidden=cfg.hidden_size, weight_dtype=spec["dtype"], kv_dtype=spec["dtype"]))
    shutil.copytree(tmp, out, ignore=shutil.ignore_patterns("*.bin"))
    (out / "weights").mkdir(exist_ok=True)
    shutil.rmtree(tmp)


def stage_packages(kit: Path) -> None:
    """The project's packages as one importable tree (kit/pkg), and pypjrt beside them (kit/site)."""
    import pypjrt
    for dst in ("pkg", "site"):
        shutil.rmtree(kit / dst, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "demo_model")
    for dst, src in PACKAGES.items():
        shutil.copytree(ROOT / src, kit / "pkg" / dst, ignore=ignore, dirs_exist_ok=True)
    shutil.copytree(Path(pypjrt.__file__).parent, kit / "site" / "pypjrt", ignore=ignore)
    # its metadata too: the runtime checks pypjrt's version (serve/runtime/pypjrt_compat.check_version)
    for info in Path(pypjrt.__file__).parent.parent.glob("pypjrt-*.dist-info"):
        shutil.copytree(info, kit / "site" / info.name, ignore=ignore)


def make_kit(kit: Path, models, variants, platform: str, tensor_parallel=()) -> None:
    kit.mkdir(parents=True, exist_ok=True)
    stage_packages(kit)
    for name in models:
        for n in (1, *tensor_parallel):
            for variant in variants:
                t0 = time.perf_counter()
                model = name if n == 1 else f"{name}-tp{n}"
                export_model(name, kit / "art" / f"{model}-{variant}", platform=platform, decode_attention=variant,
                             tensor_parallel=n)
                print(f"exported {model} ({variant} decode attention) for {platform} in "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())
    print(f"kit {kit}: {size / 2**20:.1f} MiB", flush=True)


# --- on the device: the stages ----------------------------------------------------------------------------


def write_weights(art: Path) -> int:
    """Random weights (norms 1, the rest N(0, 0.02)) of the lengths the manifest names; -> bytes written."""
    import ml_dtypes
    import numpy as np
    man = json.loads((art / "tlaloc-serving.json").read_text())
    base = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32) * 0.02
    total = 0
    for w in man["weights"]:
        files = [(s["file"], s["nbytes"]) for s in w.get("shards", [])] or [(w["file"], w["nbytes"])]
        for file, nbytes in files:         # a tensor-parallel artifact's split weight: a file per device
            itemsize = 2 if w["dtype"] == "bfloat16" else 4
            a = np.ones(nbytes // itemsize, np.float32) if "norm" in w["slot"] else np.resize(base, nbytes // itemsize)
            data = a.astype(ml_dtypes.bfloat16 if w["dtype"] == "bfloat16" else np.float32).tobytes()
            assert len(data) == nbytes, (w["slot"], len(data), nbytes)
            (art / file).write_bytes(data)
            total += len(data)
    return total


def link_weights(src: Path, dst: Path) -> None:
    """The same weight files in another variant's artifact (hard links: an artifact refuses symlinks)."""
    for f in (src / "weights").glob("*.bin"):
        target = dst / "weights" / f.name
        if target.exists():
            target.unlink()
        os.link(f, target)


def step_inputs(m, batch: int, tokens: int, start: int):
    """Rows of `tokens` tokens from position `start`, row i on pages i * W .. (i + 1) * W - 1 (W: the context's)."""
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs
    ctx = m.buckets.context_ladder[-1]
    width = ctx // m.block_size
    rows = [RowCall([7 + i] * tokens, start, list(range(i * width, (i + 1) * width))) for i in range(batch)]
    return build_step_inputs(rows, batch=batch, tokens=tokens, width=width, block_size=m.block_size)


def entry_plan(m):
    """(entry, tokens a row, first position) of each timed entry: prefill from 0 first (so that row 0's first
    pages hold keys and values when the variants' decode logits are compared), then decode at half the context."""
    out = []
    for e in sorted(m.entries, key=lambda e: (e.kind == "decode", e.batch)):
        out.append((e, 1 if e.kind == "decode" else e.tokens_per_seq, e.context // 2 if e.kind == "decode" else 0))
    return out


def interleaved(fns: dict, steps: int, rounds: int = 3) -> dict:
    """Median ms of each fn, its calls alternated in rounds (after a warm-up call each)."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def stage_runtime(arts: list[Path], plugin: str | None, steps: int) -> None:
    """The JAX-free runtime: the variants of a model one after another (pypjrt keeps one accelerator client a
    process), each entry timed and its logits kept, then every variant's logits compared with plain ops'."""
    import numpy as np
    from tlaloc_jax.artifact import Role
    from tlaloc_jax.serve import Engine
    logits, ms, plan = {}, {}, None
    for art in arts:   # a variant the plugin refuses (say, Triton IR it cannot read) is reported, the rest timed
        t0 = time.perf_counter()
        try:
            eng = Engine.load(art, plugin, cache_dir=f"/tmp/tlaloc-gpu-bench-cache/{art.name}", progress=False,
                              trust_weights=True, memory_fraction=0.9)
        except Exception as e:
            result(stage="runtime", what="error", art=art.name, error=f"{type(e).__name__}: {e}"[:3000])
            continue
        result(stage="runtime", what="load", art=art.name, seconds=round(time.perf_counter() - t0, 1),
               platform=eng.device.platform_name)
        plan = plan or list(entry_plan(eng.manifest))
        for entry, tokens, start in plan:
            # A fresh copy of the inputs for each variant: the same step (same pools' state, same inputs).
            inp = step_inputs(eng.manifest, entry.batch, tokens, start)
            e = _entry(eng, entry.name)
            logits[art.name, entry.name] = np.asarray(eng.runner.run(e, inp, {Role.LOGITS})[Role.LOGITS], np.float32)
            ms[art.name, entry.name] = interleaved({0: lambda: eng.runner.run(e, inp, {Role.NEXT_TOKEN})},
                                                   steps if entry.kind == "decode" else max(3, steps // 3))[0]
        eng.close()
    names = [art.name for art in arts if any(k[0] == art.name for k in ms)]
    for entry, tokens, start in plan or []:
        ref_name = next((k for k in names if k.endswith("-xla")), names[0])
        ref = logits[ref_name, entry.name]
        scale = float(np.max(np.abs(ref))) or 1.0
        ref_ids = ref.argmax(-1)
        for k in names:
            ids = logits[k, entry.name].argmax(-1)
            # Where a row's greedy id differs from plain ops', plain ops' own gap between the two (a near-tie is
            # one within twice the tolerance model's bound: judged by `verdict`).
            gaps = [float(ref[r, ref_ids[r]] - ref[r, ids[r]]) / scale for r in range(len(ids)) if ids[r] != ref_ids[r]]
            result(stage="runtime", art=k, entry=entry.name, kind=str(entry.kind), batch=entry.batch, tokens=tokens,
                   position=start, ms=round(ms[k, entry.name], 3),
                   max_logit_diff=round(float(np.max(np.abs(logits[k, entry.name] - ref))) / scale, 6), id_gaps=gaps)


def stage_serving(arts: list[Path], plugin: str | None, clients: list[int], output: int, prompt: int) -> None:
    """A serving load through the scheduler (Engine.add_request / step, JAX-free): `n` requests at once of a
    `prompt`-token prompt (a shared half, then ids of their own) and `output` greedy tokens each, for each n in
    `clients`; the variants one after another. Per cell: output tokens/s, time to first token p50 and p99, and
    inter-token time p50 as the requests see them."""
    import numpy as np
    from tlaloc_jax.serve import Engine
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 1000, prompt // 2).tolist()
    cells = [(n, [shared + rng.integers(3, 1000, prompt - len(shared)).tolist() for _ in range(n)]) for n in clients]
    for art in arts:      # one at a time: pypjrt keeps one accelerator client a process
        try:
            eng = Engine.load(art, plugin, cache_dir=f"/tmp/tlaloc-gpu-bench-cache/{art.name}", progress=False,
                              trust_weights=True, memory_fraction=0.9)
        except Exception as e:
            result(stage="serving", what="error", art=art.name, error=f"{type(e).__name__}: {e}"[:3000])
            continue
        name = art.name
        for n, prompts in cells:
            t0 = time.perf_counter()
            rids = {eng.add_request(p, output): i for i, p in enumerate(prompts)}
            seen: dict[str, list[float]] = {r: [] for r in rids}
            while eng.has_unfinished():
                for ev in eng.step():
                    if ev.token is not None:
                        seen[ev.request_id].append(time.perf_counter())
            wall = time.perf_counter() - t0
            ttft = sorted(ts[0] - t0 for ts in seen.values() if ts)
            gaps = sorted(b - a for ts in seen.values() for a, b in zip(ts, ts[1:]))
            tokens = sum(len(ts) for ts in seen.values())
            for r in rids:
                eng.release(r)
            result(stage="serving", art=name, clients=n, prompt=prompt, output=output, tokens=tokens,
                   tok_s=round(tokens / wall, 1), ttft_p50_ms=round(1e3 * ttft[len(ttft) // 2], 1),
                   ttft_p99_ms=round(1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
                   itl_p50_ms=round(1e3 * gaps[len(gaps) // 2], 2) if gaps else None)
        eng.close()


def _entry(engine, name: str):
    return next(e for e in engine.manifest.entries if e.name == name)


def stage_jax(arts: list[Path], steps: int) -> None:
    """The same bodies through in-process JAX (jax.export.deserialize), variants alternated; the HBM copy rate."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from tlaloc_jax import artifact as af
    dev = jax.devices()[0]
    n = (1 << 30) if dev.platform == "gpu" else (1 << 24)        # 4 GiB of uint32 on a GPU
    x = jnp.zeros((n,), jnp.uint32)
    add_one = jax.jit(lambda x: x + 1)      # reads and writes n words
    ms = interleaved({"copy": lambda: jax.block_until_ready(add_one(x))}, 10, 1)["copy"]
    result(stage="jax", what="hbm", device=str(dev.device_kind), GBps=round(2 * 4 * n / ms / 1e6, 1), jax=jax.__version__)
    x = None     # frees the buffer before the artifacts load
    loaded = {}
    for art in arts:
        try:
            m = af.load_manifest(art, verify_weights=False)
        except Exception as e:
            result(stage="jax", what="error", art=art.name, error=f"{type(e).__name__}: {e}"[:3000])
            continue
        if m.mesh is not None:      # timed through the runtime only: in-process JAX would need its own sharding
            continue
        weights = {w.slot: jax.device_put(np.fromfile(art / w.file, dtype=ml_dtypes.bfloat16 if w.dtype == "bfloat16"
                                                      else np.float32).reshape(w.shape)) for w in m.weights}
        pools = {p.name: jnp.zeros(p.shape, jnp.bfloat16 if p.dtype == "bfloat16" else jnp.float32) for p in m.pools}
        loaded[art.name] = (m, weights, pools)
    if not loaded:
        return
    first = next(iter(loaded.values()))[0]
    for entry, tokens, start in entry_plan(first):
        inp = step_inputs(first, entry.batch, tokens, start)
        fns = {}
        for k, (m, weights, pools) in loaded.items():
            e = next(x for x in m.entries if x.name == entry.name)
            try:
                exp = jax.export.deserialize(bytearray((art_of(arts, k) / e.exported).read_bytes()))
                pool_idx = tuple(i for i, s in enumerate(e.inputs) if s.role == af.Role.POOL_IN)
                f = jax.jit(exp.call, donate_argnums=pool_idx)
                fns[k] = _jax_step(f, e, inp, weights, pools, e.output_index(af.Role.NEXT_TOKEN), af)
                fns[k]()                       # compiles: a body this jax cannot run is reported, the rest timed
            except Exception as ex:
                fns.pop(k, None)
                result(stage="jax", what="error", art=k, entry=entry.name, error=f"{type(ex).__name__}: {ex}"[:3000])
        ms = interleaved(fns, steps if entry.kind == "decode" else max(3, steps // 3))
        for k in fns:
            result(stage="jax", art=k, entry=entry.name, kind=str(entry.kind), batch=entry.batch, tokens=tokens,
                   position=start, ms=round(ms[k], 3))


def art_of(arts: list[Path], name: str) -> Path:
    return next(a for a in arts if a.name == name)


def _jax_step(f, e, inp, weights, pools, nt, af):
    import jax.numpy as jnp
    import numpy as np
    fields = {k: jnp.asarray(v) for k, v in inp.items()}

    def step():
        args = [fields[af.STEP_FIELDS[s.role]] if s.role in af.STEP_FIELDS else
                pools[s.slot] if s.role == af.Role.POOL_IN else weights[s.slot] for s in e.inputs]
        outs = f(*args)
        for o, i in e.donations:
            pools[e.inputs[i].slot] = outs[o]
        return np.asarray(outs[nt])
    return step


# --- on the device: the run and its table -------------------------------------------------------------------


def find_cuda_plugin() -> str:
    paths = [sysconfig.get_paths()["purelib"], *sys.path]
    for p in paths:
        hits = sorted(glob.glob(os.path.join(p, "jax_plugins", "*", "xla_cuda_plugin.so")))
        if hits:
            return hits[0]
    raise SystemExit("no jax_plugins/*/xla_cuda_plugin.so on this machine: pass --plugin")


def run(kit: Path, plugin: str | None, steps: int, guard: bool = True, models_wanted=None,
        stages=("runtime", "serving", "jax"), budget: float = 300.0) -> None:
    """Every model's stages in turn, the whole run held to `budget` seconds: a stage gets at most what is left
    (and its own STAGE_TIMEOUT), one with under 20 s left is skipped, and the table says so."""
    t_start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(kit / "pkg"), str(kit / "site"),
                                                         os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    models = {}
    for art in sorted((kit / "art").iterdir()):
        if (art / "tlaloc-serving.json").is_file():
            models.setdefault(art.name.rsplit("-", 1)[0], []).append(art)
    if models_wanted:
        models = {k: v for k, v in models.items() if k in models_wanted}
    lines = []
    for model, arts in models.items():
        t0 = time.perf_counter()
        nbytes = write_weights(arts[0])
        for art in arts[1:]:
            link_weights(arts[0], art)
        print(f"== {model}: {nbytes / 2**20:.0f} MiB of random weights in {time.perf_counter() - t0:.0f} s", flush=True)
        for stage in stages:
            if stage == "serving" and not MODELS.get(model, {}).get("serving"):
                continue
            cmd = [sys.executable, str(HERE), f"_{stage}", *map(str, arts), "--steps", str(steps)]
            if stage in ("runtime", "serving"):
                cmd += ["--plugin", plugin or ""] + (["--guard"] if guard else [])
            limit = min(STAGE_TIMEOUT[stage], budget - (time.perf_counter() - t_start))
            if limit < 20:
                print(f"== {model}: {stage} stage skipped ({budget:.0f} s budget spent)", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
                out, err, why = proc.stdout, proc.stderr, f"exit {proc.returncode}" if proc.returncode else ""
            except subprocess.TimeoutExpired as e:   # keep what it measured
                out, err = (x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
                why = f"stopped after {limit:.0f} s"
            got = [json.loads(l[7:]) for l in out.splitlines() if l.startswith("RESULT ")]
            lines += [dict(r, model=model) for r in got]
            print(f"== {model}: {stage} stage, {len(got)} results, {time.perf_counter() - t0:.0f} s", flush=True)
            if why:
                print(f"{stage} stage failed ({why}):\n{out[-3000:]}\n{err[-6000:]}", flush=True)
    (kit / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    # The table reads the manifests with the kit's packages: a process of its own, as the stages are.
    subprocess.run([sys.executable, str(HERE), "_table", str(kit)], env=env, check=False)
    print(f"total {time.perf_counter() - t_start:.0f} s; RESULT lines in {kit / 'results.jsonl'}", flush=True)


def floor_ms(m, entry, tokens: int, start: int, gbps: float) -> float:
    """The step's HBM floor: every weight byte read once, plus the keys and values its rows read (decode) or write
    (prefill), at the measured copy rate; on a mesh, what one GPU reads (its shards, and the whole arrays)."""
    def share(partition) -> int:
        return m.mesh.shards(partition) if m.mesh and any(partition) else 1
    weights = sum(w.nbytes // share(w.partition) for w in m.weights)
    kv = 0
    for p in m.pools:
        L, _, _, S, K, D = p.shape
        K //= share(p.partition)
        per_position = L * 2 * K * D * (2 if p.dtype == "bfloat16" else 4)
        kv += entry.batch * per_position * ((start + 1) if entry.kind == "decode" else tokens)
    return (weights + kv) / (gbps * 1e6)


def table(lines: list[dict], kit: Path) -> None:
    from tlaloc_jax import artifact as af
    hbm = [r for r in lines if r.get("what") == "hbm"]
    gbps = statistics.median(r["GBps"] for r in hbm) if hbm else None
    if hbm:
        print(f"\nHBM copy rate {gbps:,.0f} GB/s on {hbm[0]['device']} (jax {hbm[0]['jax']})")
    key = lambda r: (r["model"], r["art"], r["entry"])
    rt = {key(r): r for r in lines if r.get("stage") == "runtime" and "entry" in r}
    jx = {key(r): r for r in lines if r.get("stage") == "jax" and "entry" in r}
    manifests = {}
    print(f"\n{'model':11} {'attention':9} {'entry':20} {'runtime ms':>10} {'jax ms':>8} {'rt/jax':>6} "
          f"{'floor ms':>8} {'x floor':>7} {'tok/s':>9} {'pallas/xla':>10} {'logit diff':>10}")
    for k in sorted(set(rt) | set(jx), key=lambda k: (k[0], k[2], k[1])):
        model, art, name = k
        r, j = rt.get(k), jx.get(k)
        if art not in manifests:
            manifests[art] = af.load_manifest(kit / "art" / art, verify_weights=False)
        m = manifests[art]
        entry = next(e for e in m.entries if e.name == name)
        tokens, start = (r or j)["tokens"], (r or j)["position"]
        best = r["ms"] if r else j["ms"]
        fl = floor_ms(m, entry, tokens, start, gbps) if gbps else None
        other = rt.get((model, art.rsplit("-", 1)[0] + "-xla", name))
        vs_xla = f"{r['ms'] / other['ms']:.2f}" if r and other and not art.endswith("-xla") else ""
        print(f"{model:11} {art.rsplit('-', 1)[1]:9} {name:20} {r['ms'] if r else float('nan'):10.3f} "
              f"{j['ms'] if j else float('nan'):8.3f} {(r['ms'] / j['ms']) if r and j else float('nan'):6.2f} "
              f"{fl if fl else float('nan'):8.3f} {(best / fl) if fl else float('nan'):7.1f} "
              f"{entry.batch * tokens / best * 1e3:9,.0f} {vs_xla:>10} "
              f"{r.get('max_logit_diff', float('nan')) if r else float('nan'):10.2g}")
    serving = [r for r in lines if r.get("stage") == "serving" and "clients" in r]
    if serving:
        print(f"\nserving load (the scheduler, JAX-free): requests at once, {serving[0]['prompt']}-token prompts (half "
              f"shared), {serving[0]['output']} greedy tokens each")
        print(f"{'model':11} {'attention':9} {'requests':>8} {'tok/s':>9} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
              f"{'ITL p50 ms':>10}")
        for r in sorted(serving, key=lambda r: (r["model"], r["clients"], r["art"])):
            print(f"{r['model']:11} {r['art'].rsplit('-', 1)[1]:9} {r['clients']:8d} {r['tok_s']:9,.1f} "
                  f"{r['ttft_p50_ms']:11.1f} {r['ttft_p99_ms']:11.1f} {r['itl_p50_ms'] or float('nan'):10.2f}")
    for r in lines:
        if r.get("what") == "load":
            print(f"load {r['art']}: {r['seconds']} s ({r['platform']})")
        elif r.get("what") == "error":
            print(f"ERROR {r['stage']} {r['art']} {r.get('entry', '')}: {r['error']}")


def logit_bound(model: str) -> float:
    """The tolerance model's bound (relative to the largest |logit|) on two correct bf16 decode steps of `model` at
    its context that attend in another order: f32 roundings on the path to a logit, and each projection input's
    rounding to bf16 (tlaloc_jax/kernels/tolerances.py)."""
    from tlaloc_jax.families import config_from_hf
    from tlaloc_jax.kernels import tolerances as tol
    spec = MODELS[model]
    _, cfg = config_from_hf(spec["hf"])
    rounds = {"float32": tol.decoder_roundings_of(cfg, spec["context"])}
    if spec["dtype"] == "bfloat16":
        rounds["bfloat16"] = tol.bf16_rounding_points(cfg.num_layers, every_activation=False)
    return tol.bound(rounds)


def verdict(lines: list[dict]) -> tuple[str, list[str]]:
    """The cuda decode-attention default this run supports, and why: "pallas" only when, for every model and decode
    entry timed, the Pallas variant ran, its logits are within the tolerance model's bound of plain ops' (its greedy
    ids equal theirs up to near-ties) and its runtime step is faster; "xla" otherwise."""
    rt = {(r["model"], r["art"].rsplit("-", 1)[1], r["entry"]): r for r in lines
          if r.get("stage") == "runtime" and r.get("kind") == "decode"}
    why = [f"{r['art']} {r.get('entry', '')}: error" for r in lines if r.get("what") == "error"]
    checked = 0
    for (model, variant, name), x in sorted(rt.items()):
        if variant != "xla":
            continue
        p = rt.get((model, "pallas", name))
        if p is None:
            why.append(f"{model} {name}: no Pallas result")
            continue
        checked += 1
        b = logit_bound(model)
        if p["max_logit_diff"] > b:
            why.append(f"{model} {name}: logits {p['max_logit_diff']:.2g} from plain ops' (bound {b:.2g})")
        ties = [g for g in p.get("id_gaps", []) if g > 2 * b]
        if ties:
            why.append(f"{model} {name}: {len(ties)} greedy ids differ beyond a near-tie")
        if p["ms"] >= x["ms"]:
            why.append(f"{model} {name}: Pallas step {p['ms']:.3f} ms >= plain ops' {x['ms']:.3f} ms")
    if not checked:
        why.append("no decode entry timed with both variants")
    return ("xla" if why else "pallas"), why


def print_verdict(lines: list[dict]) -> None:
    choice, why = verdict(lines)
    reasons = "; ".join(why[:4]) + (f"; and {len(why) - 4} more" if len(why) > 4 else "")
    print(f"\nVERDICT cuda decode attention default `{choice}`: " + (
        "the Pallas kernel matched plain ops' logits and ids and was faster at every decode entry" if choice == "pallas"
        else f"plain ops stay the default ({reasons})"), flush=True)


def dry_run(kit: Path, steps: int) -> None:
    """The whole flow on this CPU machine: the tiny model exported for cpu (plain-ops attention; the Pallas kernel
    lowers for cuda only, so its cpu 'variant' is the interpreter-free xla one twice), run with the CPU plugin."""
    global MODELS
    MODELS = {"tiny": dict(MODELS["tiny"], batches=(1, 4), context=128, num_blocks=64, prefill=32, serving=True)}
    shutil.rmtree(kit, ignore_errors=True)
    make_kit(kit, ["tiny"], ["xla"], "cpu", tensor_parallel=(2,))
    shutil.copytree(kit / "art" / "tiny-xla", kit / "art" / "tiny-xla2")
    run(kit, None, steps, guard=True)


def guard_jax_free() -> None:
    """Make jax, jaxlib, flax, torch and transformers unimportable: the runtime stage must not need them."""
    class Guard:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("jax", "jaxlib", "flax", "torch", "transformers"):
                raise ImportError(f"guarded: {name} must not be imported by the JAX-free runtime")
    sys.meta_path.insert(0, Guard())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kit", help="export the models for cuda and lay out the kit (on a CPU machine)")
    k.add_argument("--kit", type=Path, default=DEFAULT_KIT)
    k.add_argument("--models", default=",".join(MODELS))
    k.add_argument("--variants", default=",".join(VARIANTS))
    k.add_argument("--tensor-parallel", default="", metavar="N,...",
                   help="also export each model for N GPUs (tensor parallel), e.g. 2,4")
    r = sub.add_parser("run", help="time the kit's bodies (on the GPU machine)")
    r.add_argument("--kit", type=Path, default=DEFAULT_KIT)
    r.add_argument("--plugin", default=None, help="the CUDA PJRT plugin (default: jax_plugins/*/xla_cuda_plugin.so)")
    r.add_argument("--steps", type=int, default=20, help="timed calls per entry, variant and round (3 rounds)")
    r.add_argument("--models", default="", help="models of the kit to time (default: all)")
    r.add_argument("--stages", default="runtime,serving,jax", help="stages to run, in order (default "
                   "runtime,serving,jax)")
    r.add_argument("--budget", type=float, default=300.0, help="seconds the whole run may take (default 300)")
    d = sub.add_parser("dry-run", help="the whole flow on the tiny model for cpu, on this machine")
    d.add_argument("--kit", type=Path, default=ROOT / ".gpu-bench-dry")
    d.add_argument("--steps", type=int, default=3)
    t = sub.add_parser("_table")
    t.add_argument("kit", type=Path)
    for stage in ("_runtime", "_jax", "_serving"):
        s = sub.add_parser(stage)
        s.add_argument("arts", nargs="+", type=Path)
        s.add_argument("--steps", type=int, default=20)
        s.add_argument("--plugin", default="")
        s.add_argument("--guard", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "kit":
        make_kit(a.kit, a.models.split(","), a.variants.split(","), "cuda",
                 tuple(int(n) for n in a.tensor_parallel.split(",") if n))
    elif a.cmd == "run":
        run(a.kit, a.plugin or find_cuda_plugin(), a.steps, models_wanted=[m for m in a.models.split(",") if m],
            stages=a.stages.split(","), budget=a.budget)
    elif a.cmd == "dry-run":
        dry_run(a.kit, a.steps)
    elif a.cmd == "_runtime":
        if a.guard:
            guard_jax_free()
        stage_runtime(a.arts, a.plugin or None, a.steps)
    elif a.cmd == "_table":
        lines = [json.loads(line) for line in (a.kit / "results.jsonl").read_text().splitlines() if line]
        table(lines, a.kit)
        print_verdict(lines)
    elif a.cmd == "_jax":
        stage_jax(a.arts, a.steps)
    elif a.cmd == "_serving":
        if a.guard:
            guard_jax_free()
        stage_serving(a.arts, a.plugin or None, list(SERVING["clients"]), SERVING["output"], SERVING["prompt"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
