"""Where a decode step's time goes: the serving bench's 82M Llama decode step (tlaloc_jax.decoder.forward, per-layer
weights, paged KV pool) against the same step with its paged attention replaced by a copy of the queries, each
compiled by the serving runtime's plugin and run interleaved in one process. The difference is what attention
costs; the rest is the projections, norms, rope, the KV write, the head and the argmax.

    python -m bench.step_parts                       # 1, 8 and 32 rows, 150 keys each, a 256-position bucket
    python -m bench.step_parts --rows 32 --keys 88,200
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np


def forward_body(cfg, with_attention: bool, query_block: int | None = None):
    """decoder.forward as a body for common.on_runtime: (pools, weights, inputs) -> (pools, each row's argmax);
    without attention, its paged attention replaced by a copy of the queries. query_block: paged attention's
    query tile on CPU (None: its default)."""
    import functools

    import jax.numpy as jnp

    from tlaloc_jax import decoder
    from tlaloc_jax.inputs import StepInputs
    attention = decoder.paged_attention
    chosen = functools.partial(attention, query_block=query_block)
    if not with_attention:
        chosen = lambda q, *args, **kw: q * 1.0001  # noqa: E731

    def f(pools, weights, inputs):
        # Traced once, when on_runtime exports it: the swap only lasts for that trace.
        decoder.paged_attention = chosen
        try:
            logits, pools = decoder.forward(cfg, weights, pools, StepInputs(**inputs))
        finally:
            decoder.paged_attention = attention
        return pools, jnp.argmax(logits, -1)
    return f


def interleaved_medians(runs, steps: int, warmup: int = 2) -> tuple[list[float], list[float]]:
    """Each of `runs` called in turn, warmup + steps times -> (median wall seconds, median CPU seconds of every
    thread) of each over the last `steps` rounds."""
    walls, cpus = [[] for _ in runs], [[] for _ in runs]
    for i in range(steps + warmup):
        for j, run in enumerate(runs):
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            if i >= warmup:
                walls[j].append(time.perf_counter() - t0)
                cpus[j].append(time.process_time() - c0)
    return [statistics.median(x) for x in walls], [statistics.median(x) for x in cpus]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--keys", default="150", help="keys each row has written (its position + 1)")
    ap.add_argument("--context", type=int, default=256, help="the entry's context bucket")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)

    from bench.common import llama_config
    from bench.common import on_runtime
    from tlaloc_jax.checkpoint import random_weights
    from tlaloc_jax.families import config_from_hf
    from tlaloc_jax.layout import per_layer

    shape = argparse.Namespace(vocab=4096, hidden=768, intermediate=2048, layers=12, heads=12, kv_heads=4,
                               context=a.context)
    fam, cfg = config_from_hf(llama_config(shape))
    weights = per_layer(random_weights(cfg, fam, seed=0, std=0.02))
    S, M = 16, a.context // 16
    rng = np.random.default_rng(0)
    step = functools.partial(forward_body, cfg)

    print(f"82M Llama decode step (12 layers, 12 / 4 heads of 64), pages of {S}, context {a.context}; the runtime "
          "plugin; medians of wall ms (CPU ms of every thread)")
    print(f"{'rows':>5} {'keys':>5} | {'whole step':>18} | {'attention replaced':>18} | attention's share")
    for B in (int(x) for x in a.rows.split(",")):
        for n in (int(x) for x in a.keys.split(",")):
            P = B * M + 1
            pool = (rng.standard_normal((12, 2, P, S, 4, 64), np.float32) * 0.5)
            tables = rng.permutation(P - 1)[:B * M].reshape(B, M).astype(np.int32)
            slot = tables[:, (n - 1) // S] * S + (n - 1) % S
            inputs = dict(token_ids=rng.integers(0, 4096, (B, 1)).astype(np.int32),
                          positions=np.full((B, 1), n - 1, np.int32), block_tables=tables,
                          seq_lens=np.full((B,), n, np.int32), slot_mapping=slot.astype(np.int32)[:, None])
            runs = [on_runtime(step(w), {"kv": pool}, weights, inputs, donate=(0,)) for w in (True, False)]
            (w_all, w_rest), (c_all, c_rest) = ([t * 1e3 for t in ts] for ts in interleaved_medians(runs, a.steps))
            print(f"{B:5d} {n:5d} | {w_all:7.2f} ({c_all:6.1f}) ms | {w_rest:7.2f} ({c_rest:6.1f}) ms | "
                  f"{(w_all - w_rest) / w_all:.0%}")


if __name__ == "__main__":
    main()
