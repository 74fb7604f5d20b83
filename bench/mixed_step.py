"""Should a step's decode rows and a prompt chunk share one call? A prototype measured in one run.

    python -m bench.mixed_step                     # the 82M Llama of bench/serving.py, 8 decode rows, a 64-token chunk

In-process JAX on the per-layer layout the artifact holds: the decoder's decode call (B rows of one token), its
prefill call (one row of T tokens), and a prototype of one call that runs both groups, their token-wise work
(norms, projections, MLP) on the rows of both at once and their attention apart, each group as its own call
would. Prints the three times (medians, interleaved), the mixed call against the two calls it replaces, and
checks that the mixed call's logits are the two calls' within the decoder's bound.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402


def main(argv=None) -> None:
    import jax
    import jax.numpy as jnp

    import tlaloc_jax
    from bench.common import median_times, add_model_args, llama_config
    from tlaloc_jax.checkpoint import random_weights, save_checkpoint
    from tlaloc_jax.decoder import (DEFAULT_KEY_BLOCK, _layer_slice, decode_key_block, forward, layer_plan,
                                    logits_from_hidden, residual_mlp)
    from tlaloc_jax.families import config_from_hf
    from tlaloc_jax.inputs import StepInputs
    from tlaloc_jax.kernels import kv_cache_write, paged_attention
    from tlaloc_jax.kernels import tolerances as tol
    from tlaloc_jax.layers import apply_rope, embed, linear, rms_norm, rope_tables
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.set_defaults(vocab=4096)
    ap.add_argument("--rows", type=int, default=8, help="decode rows")
    ap.add_argument("--chunk", type=int, default=64, help="prompt tokens of the chunk row")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--work", default="/tmp/tlaloc-mixed-step")
    a = ap.parse_args(argv)

    hf = llama_config(a)
    ck = Path(a.work) / "ck"
    if not (ck / "model.safetensors").exists():
        fam, cfg = config_from_hf(hf)
        save_checkpoint(ck, hf, random_weights(cfg, fam, seed=0, std=0.02))
    block = 16
    model = tlaloc_jax.load_hf(ck, block_size=block, weight_layout="per-layer")
    cfg, weights = model.config, model.weights
    width = a.context // block
    pages = [list(range(i * width, (i + 1) * width)) for i in range(a.rows + 1)]
    pools = model.new_pools((a.rows + 1) * width)
    start = a.context // 2
    dec = StepInputs(**build_step_inputs([RowCall([7], start, pages[i]) for i in range(a.rows)], batch=a.rows,
                                         tokens=1, width=width, block_size=block))
    pre = StepInputs(**build_step_inputs([RowCall(list(range(3, 3 + a.chunk)), 0, pages[a.rows])], batch=1,
                                         tokens=a.chunk, width=width, block_size=block))
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps, off = cfg.rms_norm_eps, cfg.residual.norm_offset

    def mixed(weights, pools, groups):
        """Both groups in one call: token-wise work on their rows together, attention per group."""
        sizes = [g.token_ids.shape for g in groups]
        h = jnp.concatenate([embed(weights["embed"], g.token_ids).reshape(-1, E) for g in groups])
        ropes = [rope_tables(cfg.rope, D, g.positions) for g in groups]
        plan = layer_plan(cfg, windowed=False)
        kv = pools["kv"]
        for i in range(plan.periods):
            for lp in plan.layers:
                lw = _layer_slice(weights, "layers", lp.layer.index(i))
                aw = _layer_slice(weights, lp.group, lp.weights.index(i))
                qkv = linear(rms_norm(h, lw["attn_norm"], eps, off), aw["qkv_proj"])
                qs, at = [], 0
                q, k, v = jnp.split(qkv, (H * D, (H + K) * D), axis=-1)
                q, k, v = q.reshape(-1, H, D), k.reshape(-1, K, D), v.reshape(-1, K, D)
                ks = []
                for (B, T), (cos, sin) in zip(sizes, ropes):
                    sl = slice(at, at + B * T)
                    at += B * T
                    qs.append(apply_rope(q[sl].reshape(B, T, H, D), cos, sin))
                    ks.append(apply_rope(k[sl].reshape(B, T, K, D), cos, sin).reshape(B * T, K, D))
                # One write of every group's keys and values, then the reads: no copy of the pool between them.
                layer = lp.pool.index(i)
                slots = jnp.concatenate([g.slot_mapping.reshape(-1) for g in groups])[None]
                kv = kv_cache_write(kv, jnp.concatenate(ks)[None], v[None], slots, layer)
                outs = []
                for g, (B, T), qg in zip(groups, sizes, qs):
                    kb = decode_key_block(DEFAULT_KEY_BLOCK, block) if T == 1 else DEFAULT_KEY_BLOCK
                    o = paged_attention(qg, kv, layer, g.block_tables, g.positions, g.seq_lens, key_block=kb,
                                        scale=cfg.query_scale)
                    outs.append(o.reshape(B * T, H * D))
                o = linear(jnp.concatenate(outs), aw["o_proj"])
                h = residual_mlp(cfg, lw, h[None], o[None], layer=lp.layer.index(i))[0]
        last, at = [], 0
        for B, T in sizes:
            last += [at + b * T + T - 1 for b in range(B)]
            at += B * T
        x = rms_norm(h[jnp.array(last)], weights["final_norm"], eps, off)
        return logits_from_hidden(cfg, weights, x), {"kv": kv}

    fwd = jax.jit(lambda w, p, i: forward(cfg, w, p, i), donate_argnums=1)
    mix = jax.jit(mixed, donate_argnums=1)
    state = {"p": pools}

    def run(fn, *args):
        def go():
            out, state["p"] = fn(weights, state["p"], *args)
            return out.block_until_ready()
        return go

    two_dec, two_pre = run(fwd, dec), run(fwd, pre)
    one = run(mix, (dec, pre))
    want = np.concatenate([np.asarray(two_dec()), np.asarray(two_pre())])
    got = np.asarray(one())
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=a.context))
    err = np.abs(got - want).max() / np.abs(want).max()
    t_dec, t_pre, t_mix = median_times([two_dec, two_pre, one], a.steps)
    print(f"82M-shaped Llama, context {a.context}, jax {jax.__version__} ({jax.devices()[0].platform})")
    print(f"decode call, {a.rows} rows      {t_dec * 1e3:8.1f} ms")
    print(f"prefill call, {a.chunk} tokens  {t_pre * 1e3:8.1f} ms")
    print(f"mixed call, both            {t_mix * 1e3:8.1f} ms  = {t_mix / (t_dec + t_pre):.2f}x the two calls "
          f"(saves {(t_dec + t_pre - t_mix) * 1e3:.1f} ms a step)")
    print(f"mixed logits against the two calls': {err:.2e} of the largest (bound {bound:.2e}): "
          f"{'within' if err <= bound else 'OUTSIDE'}")


if __name__ == "__main__":
    main()
