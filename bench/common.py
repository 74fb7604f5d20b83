"""What the benches share (run them as `python -m bench.NAME` from the repository root): interleaved timing, memory
read rates, the CPU's matmul and FMA ceilings, the random Llama most of them build, and a JAX function run on the
serving runtime's plugin (on_runtime).

    from bench.common import add_model_args, llama_config, median_times, save_random_checkpoint
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")     # in-process JAX as the benches compare it: on the CPU

import numpy as np  # noqa: E402


def disk_bytes(path: Path) -> int:
    """Bytes of the files under `path` (a file's own size; 0 where nothing is there)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def median_time(fn, steps: int, warmup: int = 2) -> float:
    return median_times([fn], steps, warmup)[0]


def median_times(fns, steps: int, warmup: int = 2) -> list[float]:
    """Median seconds of each function, the functions interleaved so that drift hits them alike."""
    return [wall for wall, _ in median_wall_cpu(fns, steps, warmup)]


def median_wall_cpu(fns, steps: int, warmup: int = 2) -> list[tuple[float, float]]:
    """(median wall seconds, median CPU seconds of this process, every thread) of each function, interleaved. On a
    loaded machine the CPU time is the steadier measure of the work a call does: waiting for a core adds none."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [([], []) for _ in fns]
    for _ in range(steps):
        for fn, (ts, cs) in zip(fns, times):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            cs.append(time.process_time() - c0)
    return [(statistics.median(ts), statistics.median(cs)) for ts, cs in times]


def step_fields(entry) -> list[str]:
    """The step inputs of an entry, by StepInputs field, in its signature order (a body takes them first)."""
    from tlaloc_jax import artifact as af
    return [af.STEP_FIELDS[s.role] for s in entry.inputs if s.role in af.STEP_FIELDS]


class Reader:
    """One read pass over `arrays`, split over `threads` threads (numpy releases the GIL in a reduction; the bytes
    summed as integers, which read faster than floats and never meet a denormal): timed in rounds with the steps
    (steady_rounds), it gives the floor's read rate at the same moments as theirs (a shared VM's read rate drifts by
    a third between minutes). Given the runtime's own weights (weight_memory), it reads the very pages a step reads:
    on a VM two allocations of the same size can read 25% apart. `best`: the fastest pass seen."""

    def __init__(self, arrays: list[np.ndarray], threads: int):
        from concurrent.futures import ThreadPoolExecutor
        words = [a.reshape(-1).view(np.uint8)[:a.nbytes // 8 * 8].view(np.uint64) for a in arrays]
        self.nbytes = sum(w.nbytes for w in words)
        self.parts = [[np.array_split(w, threads)[t] for w in words] for t in range(threads)]   # a share a thread
        self.pool = ThreadPoolExecutor(threads)
        self.best = float("inf")

    def __call__(self) -> None:
        t0 = time.perf_counter()
        list(self.pool.map(lambda part: sum(int(w.sum(dtype=np.uint64)) for w in part), self.parts))
        self.best = min(self.best, time.perf_counter() - t0)

    def rate(self, seconds: float) -> float:
        return self.nbytes / seconds


def best_read_rate(arrays: list[np.ndarray], threads: int, passes: int = 3) -> float:
    """Bytes/s of the fastest of `passes` passes over `arrays` with `threads` threads (Reader)."""
    read = Reader(arrays, threads)
    for _ in range(passes):
        read()
    return read.rate(read.best)


def weight_memory(engine, skip: set[str]) -> list[np.ndarray]:
    """The runtime's weights (but the slots in `skip`) as byte arrays over their device memory, which the CPU plugin
    keeps in host memory; elsewhere a host buffer of the same size."""
    import ctypes
    dev, m = engine.runner.device, engine.manifest
    if not dev.host_memory:
        return [np.ones(sum(w.nbytes for w in m.weights if w.slot not in skip), np.uint8)]
    return [np.ctypeslib.as_array((ctypes.c_uint8 * w.nbytes).from_address(
        dev.device_address(engine.runner.weights[w.slot]))) for w in m.weights if w.slot not in skip and w.nbytes]


def steady_rounds(step, readers, steps: int, rounds: int, fresh=None) -> list[tuple[float, float, float]]:
    """(seconds a step, read bytes/s, `fresh`'s read bytes/s or 0) for each of `rounds` rounds: 2 * `steps` steps
    back to back, as a decode loop runs them, the last `steps` timed, then two passes of each reader back to back
    after an untimed one (the better of `readers`' rates; `fresh`'s apart). After the read passes (or any pause) the
    step takes about 20 steps to come back to its steady time (docs/cpu.md); a round's ratio compares the steady
    step with the read rate of the same moments."""
    def rate_of(read) -> float:
        read()
        t0 = time.perf_counter()
        read()
        read()
        return read.rate((time.perf_counter() - t0) / 2)

    out = []
    for _ in range(rounds):
        for _ in range(steps):
            step()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        t_step = (time.perf_counter() - t0) / steps
        out.append((t_step, max(rate_of(read) for read in readers), rate_of(fresh) if fresh else 0.0))
    return out


def matmul_peak(device, dtype: str, rows: int = 512, inner: int = 2048, cols: int = 4096,
                steps: int = 5) -> float:
    """FLOP/s of a [rows, inner] x [inner, cols] matmul (operands in `dtype`, f32 accumulation, eight of them in one
    body so that launch costs vanish), compiled and run by the runtime's PJRT device: the rate the plugin's XLA
    reaches on this CPU with every thread, the ceiling a prefill of the same dtype can approach."""
    import jax
    import jax.numpy as jnp
    from jax import export as jax_export
    from jax import lax
    dt = jnp.dtype(dtype)

    def body(x, ws):
        return [lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32) for w in ws]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, inner)).astype(dt)
    ws = [rng.standard_normal((cols, inner)).astype(dt) for _ in range(8)]
    exp = jax_export.export(jax.jit(body), platforms=["cpu"])(x, ws)
    exe = device.compile(exp.mlir_module_serialized, name=f"matmul_peak_{dtype}")
    bufs = [device.upload(a) for a in (x, *ws)]

    def run():
        for o in device.execute(exe, bufs, donate=()):
            o.close()
    t = median_time(run, steps, warmup=1)
    for b in bufs:
        b.close()
    return 2 * rows * inner * cols * len(ws) / t


def prefill_flops(cfg, tokens: int) -> float:
    """FLOPs of a prefill of `tokens` tokens from position 0: every layer projection once per token (2 per weight),
    the head once (the last token's logits), and causal attention's scores and weighted sum (2 * 2 * D per head and
    visible key)."""
    proj = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    proj += cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    keys = tokens * (tokens + 1) / 2
    return (2 * (tokens * proj * cfg.num_layers + cfg.hidden_size * cfg.vocab_size)
            + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys)


# The 100M-parameter Llama of the decode-speed issue, and the context.
MODEL_DEFAULTS = dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=16000, context=256)


def add_model_args(ap: argparse.ArgumentParser, **defaults: int) -> None:
    """The random Llama's shape and the context: --hidden ... --context, MODEL_DEFAULTS unless `defaults` says."""
    for name, value in dict(MODEL_DEFAULTS, **defaults).items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=value)


def llama_config(args) -> dict:
    """The Hugging Face config of the random Llama that add_model_args describes."""
    return dict(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=args.hidden // args.heads, rms_norm_eps=1e-6, max_position_embeddings=4 * args.context,
                tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def save_random_checkpoint(hf: dict, out: Path) -> int:
    """A checkpoint of `hf`'s model with random weights (seed 0, std 0.02) written to `out`; its parameter count."""
    from tlaloc_jax.checkpoint import random_weights, save_checkpoint
    from tlaloc_jax.families import config_from_hf
    fam, cfg = config_from_hf(hf)
    weights = random_weights(cfg, fam, seed=0, std=0.02)
    save_checkpoint(out, hf, weights)
    return sum(w.size for w in weights.values())


# -- a JAX function on the serving runtime's plugin --------------------------------------------------------------


_DEVICE = None


def device():
    """One runtime Device for the process (no compile cache: a bench times fresh bodies): what on_runtime compiles
    and runs on."""
    global _DEVICE
    if _DEVICE is None:
        from tlaloc_jax.serve.runtime.pjrt import Device
        _DEVICE = Device(None, cache_dir=None)
    return _DEVICE


def on_runtime(fn, *args, donate: tuple[int, ...] = (), custom_calls: tuple[str, ...] = ()):
    """fn(*args) run as the serving runtime would: exported (jax.export) and compiled by the runtime's PJRT plugin
    (whose XLA differs from in-process jaxlib's); -> a callable running it on the uploaded args. Donated args (by
    position in `args`, each a pytree) are replaced by the outputs aliased to them after every run, as the runtime
    does. custom_calls: FFI targets fn may call (registered with the plugin by the caller)."""
    import jax
    from jax import export as jax_export
    leaves, tree = jax.tree_util.tree_flatten(list(args))
    specs = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in leaves]
    donated_leaves = []
    for i in donate:
        start = len(jax.tree_util.tree_leaves(list(args[:i])))
        donated_leaves += list(range(start, start + len(jax.tree_util.tree_leaves(args[i]))))
    exp = jax_export.export(jax.jit(lambda *xs: fn(*jax.tree_util.tree_unflatten(tree, list(xs))),
                                    donate_argnums=tuple(donated_leaves)),
                            disabled_checks=[jax_export.DisabledSafetyCheck.custom_call(t)
                                             for t in custom_calls])(*specs)
    kept = sorted(exp.module_kept_var_idx)
    dev = device()
    exe = dev.compile(exp.mlir_module_serialized)
    bufs = [dev.upload(np.asarray(leaves[i])) for i in kept]
    # Donated inputs alias the leading outputs, in order (the donated leaves come back as the first outputs
    # only when fn returns them first: on_runtime's callers return their pools first).
    donated = [kept.index(i) for i in donated_leaves if i in kept]

    def run():
        outs = dev.execute(exe, bufs, donate=set(donated))
        for j, arg in enumerate(donated):
            bufs[arg] = outs[j]
        return [dev.to_host(o) for j, o in enumerate(outs) if j >= len(donated) and o is not None]
    return run


# -- the CPU's f32 FMA ceiling -----------------------------------------------------------------------------------


_SOURCE = r"""
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
#elif defined(__AVX__)
typedef float vec __attribute__((vector_size(32)));
#else
typedef float vec __attribute__((vector_size(16)));
#endif

int lanes(void) { return sizeof(vec) / sizeof(float); }

/* n rounds of ten independent a = a * m + c, each chain its own variable (kept in a register); -> a sum, so
   that nothing is dead. */
float fma_rounds(long n, float m0, float c0) {
    vec m, c, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9;
    for (int j = 0; j < lanes(); j++) {
        m[j] = m0; c[j] = c0;
        a0[j] = j; a1[j] = j + 1; a2[j] = j + 2; a3[j] = j + 3; a4[j] = j + 4;
        a5[j] = j + 5; a6[j] = j + 6; a7[j] = j + 7; a8[j] = j + 8; a9[j] = j + 9;
    }
    for (long r = 0; r < n; r++) {
        a0 = a0 * m + c; a1 = a1 * m + c; a2 = a2 * m + c; a3 = a3 * m + c; a4 = a4 * m + c;
        a5 = a5 * m + c; a6 = a6 * m + c; a7 = a7 * m + c; a8 = a8 * m + c; a9 = a9 * m + c;
    }
    vec t = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9;
    float s = 0;
    for (int j = 0; j < lanes(); j++) s += t[j];
    return s;
}
"""


@functools.cache
def _library() -> ctypes.CDLL:
    """The loop built once a process (the library stays loaded from its temporary folder, removed after)."""
    from tlaloc_jax.native import _compiler, march
    with tempfile.TemporaryDirectory(prefix="fma_peak") as tmp:
        tmp = Path(tmp)
        (tmp / "fma.c").write_text(_SOURCE)
        subprocess.run([*_compiler(), "-O2", "-ffp-contract=fast", "-shared", "-fPIC", march(), str(tmp / "fma.c"),
                        "-o", str(tmp / "fma.so")], check=True)
        lib = ctypes.CDLL(str(tmp / "fma.so"))
    lib.fma_rounds.argtypes = (ctypes.c_long, ctypes.c_float, ctypes.c_float)
    lib.fma_rounds.restype = ctypes.c_float
    return lib


def fma_peak(threads: int | None = None, seconds: float = 0.3, repeats: int = 5) -> float:
    """FLOP/s (2 a multiply-add) of `threads` threads (default: every core) running FMA chains at once; the best
    of `repeats` runs of about `seconds` each. ctypes releases the GIL, so the threads run in parallel."""
    lib = _library()
    threads = threads or os.cpu_count() or 1
    per_round = 2 * 10 * lib.lanes()   # ten chains
    n = 1 << 16
    while True:                                    # rounds for about `seconds` on one thread
        t0 = time.perf_counter()
        lib.fma_rounds(n, 0.999999, 1e-6)
        if time.perf_counter() - t0 > seconds / 4:
            break
        n *= 2
    n = int(n * seconds / max(time.perf_counter() - t0, 1e-6))
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=lib.fma_rounds, args=(n, 0.999999, 1e-6)) for _ in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, threads * n * per_round / (time.perf_counter() - t0))
    return best
