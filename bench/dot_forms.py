"""How a batch-B projection chain is written, against its time on XLA's CPU backend: the 100M Llama's 12 layers of
f32 projections alone (q|k|v, o, gate|up, down; one array per layer and projection), no attention, timed in one
process with the variants interleaved, at batch 1 and 4 (--batches), compiled by in-process jaxlib or, with
--runtime, by the serving runtime's PJRT plugin (its XLA is newer: what a served artifact runs).

Forms:
  dot      x[B, in] @ W[in, out]                         (what the decoder writes)
  dot_t    x[B, in] . Wt[out, in] -> [B, out]             (weights stored [out, in])
  reduce_t sum(Wt[None] * x[:, None], -1)                 (weights [out, in], a multiply-reduce fusion)
  reduce_ob sum(Wt[:, None] * x[None], -1).T              (the same, its products laid out [out, B]: no faster at 1-16
                                                           rows in one run, 19.8 against 17.1 ms at 4)
  blocked  Wb[out/T, in, T], a batched dot over the T-column strips (each strip contiguous)

    python bench/dot_forms.py [--isa AVX2] [--no-ynn]
    python bench/dot_forms.py --runtime --forms dot_t,reduce_t --batches 16,32,64,96   # REDUCE_ROWS' crossover
"""

from __future__ import annotations

import argparse
import os
import sys
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--qkv", type=int, default=768 + 2 * 256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--tile", type=int, default=64)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--no-ynn", action="store_true")
    ap.add_argument("--forms", default="dot,dot_t,reduce_t,blocked")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--runtime", action="store_true", help="compile and run through the serving runtime's plugin")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    E, F, Q, L, T = args.hidden, args.intermediate, args.qkv, args.layers, args.tile
    rng = np.random.default_rng(0)
    shapes = [(E, Q), (E, E), (E, 2 * F), (F, E)]
    W = [[(rng.standard_normal(s, np.float32) * 0.02) for s in shapes] for _ in range(L)]
    nbytes = sum(w.nbytes for layer in W for w in layer)

    def chain(proj):
        def f(ws, x):
            for layer in ws:
                h = proj(x, layer[0], 0)[:, :E]
                h = x + proj(h, layer[1], 1)
                g = proj(h, layer[2], 2)
                g = jax.nn.silu(g[:, :F]) * g[:, F:]
                x = h + proj(g, layer[3], 3)
            return x
        return f

    forms = {
        "dot": (lambda w: w, lambda x, w, i: x @ w),
        "dot_t": (lambda w: np.ascontiguousarray(w.T),
                  lambda x, w, i: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))),
        "reduce_t": (lambda w: np.ascontiguousarray(w.T),
                     lambda x, w, i: jnp.sum(w[None, :, :] * x[:, None, :], axis=-1)),
        "reduce_ob": (lambda w: np.ascontiguousarray(w.T),
                      lambda x, w, i: jnp.sum(w[:, None, :] * x[None, :, :], axis=-1).T),
        "reduce_t2": (lambda w: np.ascontiguousarray(w.T),
                      lambda x, w, i: jnp.sum(w[None, :, :] * jnp.concatenate([x, x])[:, None, :], axis=-1)[:x.shape[0]]),
        "reduce": (lambda w: w, lambda x, w, i: jnp.sum(w[None, :, :] * x[:, :, None], axis=1)),
        "blocked": (lambda w: np.ascontiguousarray(w.reshape(w.shape[0], -1, T).transpose(1, 0, 2)),
                    lambda x, w, i: jnp.einsum("bi,jit->bjt", x, w).reshape(x.shape[0], -1)),
    }
    chosen = args.forms.split(",")
    options = {}
    if args.isa:
        options["xla_cpu_max_isa"] = args.isa
    if args.no_ynn:
        options["xla_cpu_experimental_ynn_fusion_type"] = ""
    if args.runtime and (args.isa or args.no_ynn):
        ap.error("--isa and --no-ynn set in-process compiler options; for --runtime set XLA_FLAGS instead")
    print(f"{L} layers, hidden {E}, intermediate {F}, qkv {Q}: {nbytes / 2**20:.0f} MiB of f32 weights; "
          f"isa {args.isa or 'native'}; ynn {'off' if args.no_ynn else 'default'}; "
          f"{'the runtime plugin' if args.runtime else f'jax {jax.__version__}'}")
    results = {}
    batches = [int(b) for b in args.batches.split(",")]
    for B in batches:
        x = jnp.asarray(rng.standard_normal((B, E), np.float32))
        compiled, weights, outs = {}, {}, {}
        for name in chosen:
            prep, proj = forms[name]
            if args.runtime:
                from plugin_run import on_runtime
                ws = [[prep(w) for w in layer] for layer in W]
                run = on_runtime(chain(proj), ws, np.asarray(x))
                compiled[name], weights[name] = (lambda _w, _x, run=run: run()[0]), ws
            else:
                ws = [[jnp.asarray(prep(w)) for w in layer] for layer in W]
                c = jax.jit(chain(proj)).lower(ws, x).compile(compiler_options=options)
                compiled[name], weights[name] = c, ws
            outs[name] = np.asarray(compiled[name](weights[name], x))
        ref = outs[chosen[0]]
        for name in chosen[1:]:
            err = np.abs(outs[name] - ref).max() / np.abs(ref).max()
            assert err < 1e-4, (name, B, err)
        times = {n: [] for n in chosen}
        for i in range(args.steps + 2):
            for name in chosen:
                t0 = time.perf_counter()
                jax.block_until_ready(compiled[name](weights[name], x))
                if i >= 2:
                    times[name].append(time.perf_counter() - t0)
        for name in chosen:
            results[name, B] = statistics.median(times[name])
        del compiled, weights
    print(f"{'form':>9} | " + " | ".join(f"{f'batch {b} ms':>10}" for b in batches))
    for name in chosen:
        print(f"{name:>9} | " + " | ".join(f"{results[name, b] * 1e3:10.2f}" for b in batches))


if __name__ == "__main__":
    main()
