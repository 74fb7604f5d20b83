"""Penalties' token counts: from a host-built history input (what tlaloc_jax/kernels/in_body_sampler.py does) or
from a pool of per-sequence counts kept on the device and updated in the body. Prints each one's cost per decode
step and memory.

    python -m bench.penalties [--vocab 151936] [--batch 8] [--context 1024] [--slots 64]

history: TOKEN_HISTORY [B, C] int32 uploaded each step (B C 4 bytes), scattered into [B, V] counts in the body.
pool: a [slots, V] int32 pool (slots V 4 bytes of device memory, for every sequence the pools can hold), its rows
gathered each step and the chosen token added back (a scatter into the donated pool). Both then apply the same
penalties to [B, V] logits; the time is the body's (jit on this CPU), the upload is the host's bytes per step.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from tlaloc_jax import artifact as af
from tlaloc_jax.kernels import in_body_sampler as S


def _time(fn, *args, reps=20) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
        jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=64)
    args = ap.parse_args(argv)
    B, V, C, P = args.batch, args.vocab, args.context, args.slots
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32))
    params = np.tile(np.array([af.SAMPLING_NEUTRAL[c] for c in af.SAMPLING_COLUMNS], np.float32), (B, 1))
    params[:, 4:7] = [0.5, 0.3, 1.2]
    params = jnp.asarray(params)
    seq_lens = jnp.full((B,), C - 1, jnp.int32)
    steps = jnp.full((B,), C // 2, jnp.int32)
    history = jnp.asarray(rng.integers(0, V, (B, C)).astype(np.int32))

    by_history = jax.jit(lambda x, p, h, sl, st: S._penalize(x, p, h, sl, st))

    def by_pool(x, p, pool, slots, chosen):
        counts = pool[slots]                                            # [B, V]: output counts * 2 + prompt bit
        out = (counts >> 1).astype(jnp.float32)
        seen = counts > 0
        rep = p[:, 6, None]
        x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
        x = x - p[:, 5, None] * out - p[:, 4, None] * (out > 0)
        return x, pool.at[slots, chosen].add(2)
    by_pool = jax.jit(by_pool, donate_argnums=(2,))
    pool = jnp.zeros((P, V), jnp.int32)
    slots = jnp.arange(B, dtype=jnp.int32)
    chosen = jnp.zeros((B,), jnp.int32)

    t_hist = _time(by_history, logits, params, history, seq_lens, steps)
    t0 = time.perf_counter()
    for _ in range(20):
        x, pool = by_pool(logits, params, pool, slots, chosen)
        jax.block_until_ready(x)
    t_pool = (time.perf_counter() - t0) / 20
    print(f"V {V}, B {B}, C {C}, slots {P}")
    print("| design | body per step (ms) | host bytes per step | device memory |")
    print("|---|---|---|---|")
    print(f"| history input (chosen) | {t_hist * 1e3:.2f} | {B * C * 4 / 1024:.0f} KiB | none |")
    print(f"| counts pool | {t_pool * 1e3:.2f} | 0 | {P * V * 4 / 2**20:.0f} MiB |")
    print(f"history / pool time: {t_hist / t_pool:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
