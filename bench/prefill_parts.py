"""Where a prefill's time goes: bench/decode.py's 100M Llama prefill of one prompt (tlaloc_jax.decoder.forward,
per-layer weights, paged KV pool, f32) against three cut-down bodies, each compiled by the serving runtime's
plugin and run interleaved in one process (f32 weights, or with --weight-dtype bfloat16 every weight in bf16 as
`--weight-dtype bfloat16` exports them; the KV pool f32 either way, the export's default):

  - the same prefill with its paged attention replaced by a copy of the queries (the difference is attention);
  - the projections alone: every layer's four dots (q | k | v, o, gate | up, down) on the same weights and rows,
    chained, and the head on the last row (the rest of the prefill is attention, norms, rope, the activation,
    the KV write and the embedding);
  - one projection shape (gate | up) repeated to fill the same FLOPs: the best rate the plugin's dot reaches on
    this prefill's rows, the ceiling the projections can approach;
  - the same prefill with its attention in one query tile (paged attention's query_block past the prompt): what
    the tiles save, each folding only the key blocks its own tokens see ("untiled / tiled").

The FLOP rates count the projections' and attention's multiply-adds (bench/decode.py's prefill_flops), against
the f32 FMA peak of every core (bench/common.py's fma_peak) measured in the same run; for bf16 weights, against the rate the
plugin's bf16 dot reaches on large matmuls (AVX512-BF16 or AMX where the CPU has them: no simple vector peak
bounds it). "ceiling": how much faster the prefill could be at most, were its projections to run at that peak and
everything else to take no time.

    python -m bench.prefill_parts                  # 128 tokens in a 256-position bucket
    python -m bench.prefill_parts --tokens 64,256 --context 512
    python -m bench.prefill_parts --weight-dtype bfloat16
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="128", help="prompt lengths, one prefill call each (64 or more: shorter "
                    "calls take the decode forms of the projections)")
    ap.add_argument("--context", type=int, default=256, help="the entry's context bucket")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--weight-dtype", default="float32", choices=("float32", "bfloat16"))
    a = ap.parse_args(argv)

    import jax.numpy as jnp

    from bench.common import MODEL_DEFAULTS, llama_config, matmul_peak, prefill_flops
    from bench.common import fma_peak
    from bench.common import device, on_runtime
    from bench.step_parts import forward_body, interleaved_medians
    from tlaloc_jax.checkpoint import random_weights, weight_dtype
    from tlaloc_jax.families import config_from_hf
    from tlaloc_jax.layers import linear
    from tlaloc_jax.layout import per_layer
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs

    shape = argparse.Namespace(**dict(MODEL_DEFAULTS, context=a.context))
    fam, cfg = config_from_hf(llama_config(shape))
    weights = random_weights(cfg, fam, seed=0, std=0.02)
    weights = per_layer({k: v.astype(weight_dtype(a.weight_dtype)) for k, v in weights.items()})
    S = 16
    M = a.context // S
    rng = np.random.default_rng(0)

    def projections(pools, weights, inputs):
        # The layer's dots in order, each fed by the last (shapes as in the layer; no norms, rope or attention).
        h = jnp.take(weights["embed"], inputs["token_ids"], axis=0)
        H = cfg.num_heads * cfg.head_dim
        for i in range(cfg.num_layers):
            qkv = linear(h, weights["attn.qkv_proj"][i])
            h = h + linear(qkv[..., :H], weights["attn.o_proj"][i])
            gu = linear(h, weights["layers.gate_up_proj"][i])
            h = h + linear(gu[..., :cfg.intermediate_size], weights["layers.down_proj"][i])
        return pools, jnp.argmax(linear(h[:, -1], weights["head"]), -1)

    def same_dot(n):
        # gate | up's dot n times on the prompt's rows: the rate one projection shape reaches, chained.
        def f(pools, weights, inputs):
            h = jnp.take(weights["embed"], inputs["token_ids"], axis=0)
            outs = []
            for i in range(n):
                gu = linear(h, weights["layers.gate_up_proj"][i % cfg.num_layers])
                outs.append(gu[..., :1])
                h = h + gu[..., :cfg.hidden_size] * 1e-3
            return pools, jnp.concatenate(outs, -1)
        return f

    big = matmul_peak(device(), "float32")
    fma = fma_peak()
    bf16 = a.weight_dtype == "bfloat16"
    peak = matmul_peak(device(), "bfloat16") if bf16 else fma
    print(f"100M Llama prefill (12 layers, hidden 768, 12 / 4 heads of 64, MLP 2048, vocab 16000), "
          f"{'bf16' if bf16 else 'f32'} weights, context {a.context}; the runtime plugin; medians of wall ms (CPU ms "
          f"of every thread)")
    print(f"f32 FMA peak of {os.cpu_count()} cores {fma / 1e9:.1f} GFLOP/s; the plugin's 8 x 512 x 2048 x 4096 "
          f"matmuls {big / 1e9:.1f} GFLOP/s in f32 ({big / fma:.2f}x the FMA peak)"
          + (f", {peak / 1e9:.1f} GFLOP/s in bf16 ({peak / fma:.2f}x the f32 FMA peak; the peak below)" if bf16
             else ""))
    print(f"{'tokens':>6} | {'whole prefill':>17} | {'no attention':>17} | {'projections':>17} | "
          f"{'one dot shape':>17} | attention | other | x peak: prefill, projections, one shape | ceiling | "
          f"untiled / tiled")
    for T in (int(x) for x in a.tokens.split(",")):
        P = M + 1
        pool = rng.standard_normal((cfg.num_layers, 2, P, S, cfg.num_kv_heads, cfg.head_dim), np.float32) * 0.5
        inputs = build_step_inputs([RowCall([7] * T, 0, list(range(M)))], batch=1, tokens=T, width=M, block_size=S)
        inputs = {k: np.asarray(v) for k, v in inputs.items()}
        inputs["token_ids"] = rng.integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
        flops_proj = prefill_flops(cfg, T) - 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * (T + 1) / 2
        flops_gu = 2 * T * cfg.hidden_size * 2 * cfg.intermediate_size
        n_same = max(1, round(flops_proj / flops_gu))
        bodies = [forward_body(cfg, True), forward_body(cfg, False), projections, same_dot(n_same),
                  forward_body(cfg, True, query_block=1 << 30)]
        runs = [on_runtime(f, {"kv": pool}, weights, inputs, donate=(0,)) for f in bodies]
        w, c = interleaved_medians(runs, a.steps)
        rates = (prefill_flops(cfg, T) / w[0], flops_proj / w[2], n_same * flops_gu / w[3])
        cells = " | ".join(f"{w[j] * 1e3:7.1f} ({c[j] * 1e3:6.1f})" for j in range(4))
        print(f"{T:6d} | {cells} | {(w[0] - w[1]) / w[0]:9.0%} | {(w[1] - w[2]) / w[0]:5.0%} | "
              f"{' / '.join(f'{r / peak:.2f}x' for r in rates):>42} | {w[0] / (flops_proj / peak):.2f}x | "
              f"{w[4] / w[0]:.2f}x")
        print(f"{'':6} | {T / w[0]:.0f} tok/s")
    print("attention: (whole - no attention) / whole; other: (no attention - projections) / whole (norms, rope, "
          "activation, KV write, embedding)")


if __name__ == "__main__":
    main()
