"""What a kernel written outside XLA would buy the CPU decode step: bench/native_kernels.c (plain C, compiled here with
gcc -O3 -march=native and OpenMP on every core) against the forms the decoder compiles today, run through the serving
runtime's plugin, interleaved in one process. Two parts of the step:

  - the 100M Llama's 12 layers of f32 projections (q|k|v, o, gate|up, down, weights out-major) at 1 to 64 rows:
    XLA's form as the decoder writes it (tlaloc_jax.kernels.quantized_matmul.out_major_product), OpenBLAS through
    numpy, and the C strip kernel that reads every weight once;
  - decode paged attention over 12 layers of 12 / 4 heads of 64, pages of 16 (the serving bench's 82M Llama):
    tlaloc_jax.kernels.paged_attention._decode_cpu against the C kernel (one online softmax a row and KV head).

The attention kernel runs twice: called from Python through ctypes, and as the route a served artifact would take,
a typed stablehlo.custom_call inside a body the runtime compiled, its C handler registered through the plugin's FFI
extension. Each C result is checked against XLA's before it is timed.

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
    import jax
    lib = os.path.join(out_dir, "native_kernels.so")
    subprocess.run(["gcc", "-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC",
                    f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", lib, "-lmvec", "-lm"], check=True)
    so = ctypes.CDLL(lib)
    p, i = ctypes.c_void_p, ctypes.c_int
    so.projection.argtypes = [p, p, p, i, i, i]
    so.decode_attention.argtypes = [p, i, i, i, i, i, p, i, i, p, i, p, ctypes.c_float, p]
    return so


REGISTERED: list = []      # what the plugin keeps pointers to, for the life of the process


def register_native(name: str, handler) -> None:
    """Register a C function (ctypes) as the plugin's FFI handler for `name`, as pypjrt.ffi.register does for a
    Python one: the FFI extension's register_handler, which calls the handler once for its metadata."""
    from pypjrt._lock import dispatching

    from plugin_run import device
    plugin = device()._plugin
    ext = plugin.require_extension("FFI")
    name_b, platform = ctypes.create_string_buffer(name.encode()), ctypes.create_string_buffer(b"Host")
    REGISTERED.extend((name_b, platform, handler))
    args = plugin.args("PJRT_FFI_Register_Handler_Args", target_name=ctypes.cast(name_b, ctypes.c_void_p),
                       target_name_size=len(name), handler=ctypes.cast(handler, ctypes.c_void_p),
                       platform_name=ctypes.cast(platform, ctypes.c_void_p), platform_name_size=4, traits=0)
    register = ctypes.cast(ext.address + 40, ctypes.POINTER(ctypes.c_void_p))[0]   # PJRT_FFI_Extension.register_handler
    with dispatching():
        err = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(register)(ctypes.byref(args))
    if err:
        raise plugin._to_exception(err)


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


def projections(so, rows: list[int], steps: int) -> None:
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
        t = medians({"xla": xla, "blas": lambda: chain(lambda a, w: a @ w.T, silu, W, x),
                     "c": lambda: chain(c_proj, silu, W, x)}, steps)
        print(f"{B:5d} | {t['xla'] * 1e3:10.2f} ms | {t['blas'] * 1e3:6.2f} ms | {t['c'] * 1e3:6.2f} ms | "
              f"{t['c'] / t['xla']:6.2f}x | {nbytes / t['xla'] / 1e9:8.1f} | {nbytes / t['c'] / 1e9:6.1f}")


TARGET = "tlaloc_bench_decode_attention"


def attention(so, rows: list[int], keys: list[int], context: int, steps: int) -> None:
    import jax.numpy as jnp

    from plugin_run import on_runtime
    pa = importlib.import_module("tlaloc_jax.kernels.paged_attention")    # the package's name is the function
    L, S, H, K, D = 12, 16, 12, 4, 64
    M = context // S
    rng = np.random.default_rng(0)

    def xla_form(pool, q, tables, positions, seq_lens):
        return [pa._decode_cpu(0.125, None, pa.CPU_DECODE_KEY_BLOCK, pa.CPU_SHARED_KEY_BLOCK, q, pool,
                               jnp.int32(layer), tables, positions, seq_lens, jnp.int32(0), None) for layer in range(L)]

    register_native(TARGET, so.decode_attention_ffi)

    def in_body(pool, q, tables, positions, seq_lens):    # the C kernel as a custom call inside the compiled body
        import jax
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        return [call(q, pool, jnp.int32(layer), tables, seq_lens, jnp.float32(0.125)) for layer in range(L)]

    print(f"\ndecode attention: {L} layers, {H} query / {K} KV heads of {D}, pages of {S}, context {context}")
    print(f"{'rows':>5} {'keys':>5} | {'XLA (_decode_cpu)':>17} | {'C (ctypes)':>10} | {'C in the body':>13} | "
          "ctypes / XLA | body / XLA")
    for B in rows:
        for n in keys:
            P = B * M + 1
            pool = rng.standard_normal((L, 2, P, S, K, D), np.float32)
            q = rng.standard_normal((B, 1, H, D), np.float32)
            tables = np.array([rng.permutation(P - 1)[:M] for _ in range(B)], np.int32)
            seq_lens = np.full((B,), n, np.int32)
            args = (pool, q, tables, np.full((B, 1), n - 1, np.int32), seq_lens)
            xla = on_runtime(xla_form, *args)
            body = on_runtime(in_body, *args, custom_calls=(TARGET,))
            out = np.empty((L, B, H, D), np.float32)

            def c_form():
                for layer in range(L):
                    so.decode_attention(pool.ctypes.data, layer, P, S, K, D, q.ctypes.data, B, H, tables.ctypes.data,
                                        M, seq_lens.ctypes.data, 0.125, out[layer].ctypes.data)
            c_form()
            want = np.stack([np.asarray(o).reshape(B, H, D) for o in xla()])
            for got in (out, np.stack([np.asarray(o).reshape(B, H, D) for o in body()])):
                assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), "the C attention differs from XLA's"
            t = medians({"xla": xla, "c": c_form, "body": body}, steps)
            print(f"{B:5d} {n:5d} | {t['xla'] * 1e3:14.2f} ms | {t['c'] * 1e3:7.2f} ms | {t['body'] * 1e3:10.2f} ms | "
                  f"{t['c'] / t['xla']:11.2f}x | {t['body'] / t['xla']:9.2f}x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,32")
    ap.add_argument("--projection-rows", default="1,4,8,32,64")
    ap.add_argument("--keys", default="88,200", help="keys each row has written")
    ap.add_argument("--context", type=int, default=256, help="the entry's context bucket")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--skip-projections", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        so = build(tmp)
        print(f"C: gcc -O3 -march=native, OpenMP on {os.cpu_count()} cores; XLA: the runtime's plugin")
        if not a.skip_projections:
            projections(so, [int(r) for r in a.projection_rows.split(",")], a.steps)
        attention(so, [int(r) for r in a.rows.split(",")], [int(k) for k in a.keys.split(",")], a.context, a.steps)


if __name__ == "__main__":
    main()
