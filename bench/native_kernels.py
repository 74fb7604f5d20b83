"""What a kernel written outside XLA buys the CPU decode step: plain C compiled here (gcc -O3 -march=native, OpenMP on
every core) against the forms the decoder compiles, run through the serving runtime's plugin, interleaved in one
process. Two parts of the step:

  - the 100M Llama's 12 layers of f32 projections (q|k|v, o, gate|up, down, weights out-major) at 1 to 64 rows:
    XLA's form as the decoder writes it (tlaloc_jax.kernels.quantized_matmul.out_major_product), OpenBLAS through
    numpy, and the C strip kernel that reads every weight once;
  - decode paged attention over 12 layers of 12 / 4 heads of 64, pages of 16 (the serving bench's 82M Llama):
    tlaloc_jax.kernels.paged_attention._decode_cpu against the native kernel an artifact exported with
    decode_attention "native" calls (tlaloc_jax/native/decode_attention.c), as a served body does: a typed
    stablehlo.custom_call in a body the runtime compiled, the handler registered with its plugin.

The projection kernel is bench/native_kernels.c. Each C result is checked against XLA's before it is timed.

    python bench/native_kernels.py
    python bench/native_kernels.py --rows 32 --keys 200 --skip-projections
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# OpenMP's threads sleep between calls instead of spinning on the cores XLA's pool needs for the interleaved form.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import numpy as np  # noqa: E402

SOURCE = Path(__file__).with_name("native_kernels.c")


def build(out_dir: str) -> ctypes.CDLL:
    lib = os.path.join(out_dir, "native_kernels.so")
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", lib, "-lm"],
                   check=True)
    so = ctypes.CDLL(lib)
    p, i = ctypes.c_void_p, ctypes.c_int
    so.projection.argtypes = [p, p, p, i, i, i]
    return so


def medians(fns: dict, steps: int) -> dict:
    """Median wall seconds of each function, interleaved, after two warm-up rounds."""
    times = {k: [] for k in fns}
    for i in range(steps + 2):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def projections(so, rows: list[int], steps: int, blas: bool = True) -> None:
    import jax

    from plugin_run import on_runtime
    from tlaloc_jax.kernels.quantized_matmul import out_major_product
    E, F, Q, L = 768, 2048, 768 + 2 * 256, 12
    rng = np.random.default_rng(0)
    W = [[rng.standard_normal((o, i), np.float32) * 0.02 for o, i in ((Q, E), (E, E), (2 * F, E), (E, F))]
         for _ in range(L)]
    nbytes = sum(w.nbytes for layer in W for w in layer)

    def chain(proj, silu, ws, x):      # traced by JAX for XLA's form, run by numpy for the host ones
        for wq, wo, wgu, wd in ws:
            h = x + proj(proj(x, wq)[:, :E], wo)
            g = proj(h, wgu)
            x = h + proj(silu(g[:, :F]) * g[:, F:], wd)
        return x

    def c_proj(x, w):
        y = np.empty((x.shape[0], w.shape[0]), np.float32)
        x = np.ascontiguousarray(x, np.float32)
        so.projection(w.ctypes.data, x.ctypes.data, y.ctypes.data, x.shape[0], w.shape[0], w.shape[1])
        return y

    def silu(v):
        return v / (1.0 + np.exp(-v))

    print(f"\nprojections: {L} layers, hidden {E}, intermediate {F}, {nbytes / 2**20:.0f} MiB of f32 weights")
    print(f"{'rows':>5} | {'XLA (decoder)':>13} | {'OpenBLAS':>9} | {'C strips':>9} | C / XLA | XLA GB/s | C GB/s")
    for B in rows:
        x = rng.standard_normal((B, E), np.float32)
        xla = on_runtime(lambda ws, x: chain(lambda a, w: out_major_product(a, w, reduce_one_row=False), jax.nn.silu,
                                             ws, x), W, x)
        want = xla()[0]
        got = chain(c_proj, silu, W, x)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), "the C projection chain differs from XLA's"
        forms = {"xla": xla, "c": lambda: chain(c_proj, silu, W, x)}
        if blas:      # (OpenBLAS's threads spin after a call, on the cores the next form needs)
            forms["blas"] = lambda: chain(lambda a, w: a @ w.T, silu, W, x)
        t = medians(forms, steps)
        blas_ms = f"{t['blas'] * 1e3:6.2f} ms" if blas else f"{'-':>9}"
        print(f"{B:5d} | {t['xla'] * 1e3:10.2f} ms | {blas_ms} | {t['c'] * 1e3:6.2f} ms | "
              f"{t['c'] / t['xla']:6.2f}x | {nbytes / t['xla'] / 1e9:8.1f} | {nbytes / t['c'] / 1e9:6.1f}")


def attention(rows: list[int], keys: list[int], context: int, steps: int) -> None:
    import jax.numpy as jnp

    from plugin_run import device, on_runtime
    from tlaloc_jax.kernels.paged_attention_native import NATIVE_DECODE_ATTENTION, native_decode_attention
    pa = importlib.import_module("tlaloc_jax.kernels.paged_attention")    # the package's name is the function
    L, S, H, K, D = 12, 16, 12, 4, 64
    M = context // S
    rng = np.random.default_rng(0)

    def xla_form(pool, q, tables, positions, seq_lens):
        return [pa._decode_cpu(0.125, None, pa.CPU_DECODE_KEY_BLOCK, pa.CPU_SHARED_KEY_BLOCK, q, pool,
                               jnp.int32(layer), tables, positions, seq_lens, jnp.int32(0), None) for layer in range(L)]

    def native_form(pool, q, tables, positions, seq_lens):
        return [native_decode_attention(q, pool, layer, tables, positions, seq_lens, scale=0.125) for layer in range(L)]

    device().register_native(NATIVE_DECODE_ATTENTION)
    print(f"\ndecode attention: {L} layers, {H} query / {K} KV heads of {D}, pages of {S}, context {context}")
    print(f"{'rows':>5} {'keys':>5} | {'XLA (_decode_cpu)':>17} | {'C kernel (native)':>17} | C / XLA")
    for B in rows:
        for n in keys:
            P = B * M + 1
            pool = rng.standard_normal((L, 2, P, S, K, D), np.float32)
            q = rng.standard_normal((B, 1, H, D), np.float32)
            tables = np.array([rng.permutation(P - 1)[:M] for _ in range(B)], np.int32)
            args = (pool, q, tables, np.full((B, 1), n - 1, np.int32), np.full((B,), n, np.int32))
            xla = on_runtime(xla_form, *args)
            body = on_runtime(native_form, *args, custom_calls=(NATIVE_DECODE_ATTENTION,))
            want = np.stack([np.asarray(o) for o in xla()])
            got = np.stack([np.asarray(o) for o in body()])
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), "the C attention differs from XLA's"
            t = medians({"xla": xla, "body": body}, steps)
            print(f"{B:5d} {n:5d} | {t['xla'] * 1e3:14.2f} ms | {t['body'] * 1e3:14.2f} ms | "
                  f"{t['body'] / t['xla']:6.2f}x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,32")
    ap.add_argument("--projection-rows", default="1,4,8,32,64")
    ap.add_argument("--keys", default="88,200", help="keys each row has written")
    ap.add_argument("--context", type=int, default=256, help="the entry's context bucket")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--skip-projections", action="store_true")
    ap.add_argument("--no-blas", action="store_true", help="leave OpenBLAS out of the projections' forms")
    ap.add_argument("--skip-attention", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        so = build(tmp)
        print(f"C: gcc -O3 -march=native, OpenMP on {os.cpu_count()} cores; XLA: the runtime's plugin")
        if not a.skip_projections:
            projections(so, [int(r) for r in a.projection_rows.split(",")], a.steps, blas=not a.no_blas)
        if not a.skip_attention:
            attention([int(r) for r in a.rows.split(",")], [int(k) for k in a.keys.split(",")], a.context,
                      a.steps)


if __name__ == "__main__":
    main()
