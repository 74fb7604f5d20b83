"""What kernels written outside XLA buy the CPU decode step: the package's C kernels (kernels/), each a
typed stablehlo.custom_call in a body the serving runtime's plugin compiled (the handler registered with it, as a
served body has it), against the forms the decoder compiles otherwise, interleaved in one process. Two parts of
the step:

  - the 100M Llama's 12 layers of projections (q|k|v, o, gate|up, down, weights out-major) at 1 to 64 rows, for
    f32, bf16 and int8 weights: XLA's form as the decoder writes it (out_major_product) against the projection
    kernel (kernels/projection.c); int4 (groups of 32; --dtypes int4, prefill rows too): quantized_matmul's XLA
    form against the int4 kernel (kernels/projection_int4.c);
  - decode paged attention over 12 layers of 12 / 4 heads of 64, pages of 16 (the serving bench's 82M Llama):
    tlaloc_jax.kernels.paged_attention._decode_cpu against the decode attention kernel
    (kernels/decode_attention.c).

Each kernel's result is checked against XLA's before it is timed.

    python -m bench.native_kernels
    python -m bench.native_kernels --rows 32 --keys 200 --skip-projections
    python -m bench.native_kernels --rows 32 --keys 250 --shared 192 --skip-projections   # rows share a cached prefix
    python -m bench.native_kernels --skip-attention --dtypes bf16,int8 --projection-rows 1,8,16
    python -m bench.native_kernels --skip-attention --dtypes f32,int4 --projection-rows 1,4,256
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time

import numpy as np


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


def projections(rows: list[int], dtypes: list[str], steps: int) -> None:
    import jax
    import jax.numpy as jnp

    from bench.common import device, on_runtime
    from tlaloc_jax.kernels.projection_native import (NATIVE_INT4_PROJECTION, NATIVE_PROJECTION, native_projection,
                                                      native_projections)
    from tlaloc_jax.kernels.quantized_matmul import out_major_product, quantize_array, quantized_matmul, to_out_major
    E, F, Q, L = 768, 2048, 768 + 2 * 256, 12
    rng = np.random.default_rng(0)
    device().register_native(NATIVE_PROJECTION)
    device().register_native(NATIVE_INT4_PROJECTION)
    print(f"\nprojections: {L} layers, hidden {E}, intermediate {F}; weights out-major")
    print(f"{'weights':>7} {'rows':>5} | {'XLA (decoder)':>13} | {'C kernel':>9} | C / XLA | XLA GB/s | C GB/s")
    for name in dtypes:
        dtype = None if name == "int4" else {"f32": np.float32, "bf16": jnp.bfloat16, "int8": np.int8}[name]
        W = []
        for _ in range(L):
            layer = [rng.standard_normal((o, i), np.float32) * 0.02 for o, i in ((Q, E), (E, E), (2 * F, E), (E, F))]
            if name == "int4":     # out-major codes and group scales, as the per-layer layout stores them
                W.append([to_out_major(quantize_array(w.T, "int4", 32)) for w in layer])
                continue
            W.append([np.clip(np.round(w * 3000), -127, 127).astype(np.int8) if name == "int8"
                      else np.asarray(jnp.asarray(w, dtype)) for w in layer])
        nbytes = sum(w.nbytes for layer in W for w in layer)
        scale = 1 / 3000 if name == "int8" else 1.0

        def chain(proj, ws, x):
            for wq, wo, wgu, wd in ws:
                h = x + proj(proj(x, wq)[:, :E], wo)
                g = proj(h, wgu)
                x = h + proj(jax.nn.silu(g[:, :F]) * g[:, F:], wd)
            return x

        def proj(product):     # as linear / quantized_matmul give it: a narrow float weight rounds its input
            def run(a, w):
                return product(a.astype(w.dtype) if w.dtype == jnp.bfloat16 else a, w) * scale
            return run

        def native_int4(ws, x):
            with native_projections():
                return chain(quantized_matmul, ws, x)

        xla_proj = proj(lambda a, w: out_major_product(a, w, reduce_one_row=w.dtype != jnp.float32))
        for B in rows:
            x = rng.standard_normal((B, E), np.float32)
            if name == "int4":
                xla = on_runtime(lambda ws, x: chain(quantized_matmul, ws, x), W, x)
                c = on_runtime(native_int4, W, x, custom_calls=(NATIVE_INT4_PROJECTION,))
            else:
                xla = on_runtime(lambda ws, x: chain(xla_proj, ws, x), W, x)
                c = on_runtime(lambda ws, x: chain(proj(native_projection), ws, x), W, x,
                               custom_calls=(NATIVE_PROJECTION,))
            want, got = np.asarray(xla()[0]), np.asarray(c()[0])
            # (bf16: each projection rounds its input to bf16, where another summation order may round otherwise;
            # int4: the kernel quantizes each projection's input to int8 per block of 32)
            rel = 5e-2 if name in ("bf16", "int4") else 1e-3
            assert np.abs(got - want).max() <= rel * np.abs(want).max(), "the C projection chain differs from XLA's"
            t = medians({"xla": xla, "c": c}, steps)
            print(f"{name:>7} {B:5d} | {t['xla'] * 1e3:10.2f} ms | {t['c'] * 1e3:6.2f} ms | "
                  f"{t['c'] / t['xla']:6.2f}x | {nbytes / t['xla'] / 1e9:8.1f} | {nbytes / t['c'] / 1e9:6.1f}")


def attention(rows: list[int], keys: list[int], context: int, steps: int, shared: int = 0) -> None:
    import jax.numpy as jnp

    from bench.common import device, on_runtime
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
    print(f"\ndecode attention: {L} layers, {H} query / {K} KV heads of {D}, pages of {S}, context {context}"
          + (f", the first {shared} keys of every row shared" if shared else ""))
    print(f"{'rows':>5} {'keys':>5} | {'XLA (_decode_cpu)':>17} | {'C kernel (native)':>17} | C / XLA")
    for B in rows:
        for n in keys:
            P = B * M + 1
            pool = rng.standard_normal((L, 2, P, S, K, D), np.float32)
            q = rng.standard_normal((B, 1, H, D), np.float32)
            tables = np.array([rng.permutation(P - 1)[:M] for _ in range(B)], np.int32)
            if shared:     # every row's table starts with the same pages (a cached prefix), the rest its own
                common = tables[0, :shared // S].copy()
                tables = np.array([np.concatenate([common, [p for p in row if p not in common][:M - len(common)]])
                                   for row in tables], np.int32)
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
    ap.add_argument("--shared", type=int, default=0,
                    help="keys every row's table shares (a cached prefix; whole pages)")
    ap.add_argument("--context", type=int, default=256, help="the entry's context bucket")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--skip-projections", action="store_true")
    ap.add_argument("--dtypes", default="f32,bf16,int8", help="the projections' weight dtypes (f32, bf16, int8, int4)")
    ap.add_argument("--skip-attention", action="store_true")
    a = ap.parse_args(argv)
    print(f"{os.cpu_count()} cores; both forms through the runtime's plugin")
    if not a.skip_projections:
        projections([int(r) for r in a.projection_rows.split(",")], a.dtypes.split(","), a.steps)
    if not a.skip_attention:
        attention([int(r) for r in a.rows.split(",")], [int(k) for k in a.keys.split(",")], a.context, a.steps,
                  a.shared)


if __name__ == "__main__":
    main()
