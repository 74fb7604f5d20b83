"""Mixture of experts: a decode step of a small MoE decoder against the same model with every expert computed
densely, and the weight bytes each step reads. One run prints both.

    JAX_PLATFORMS=cpu .venv/bin/python -m bench.moe [--experts 32] [--top-k 4] [--batch 1 4] ...

The model is the built-in decoder (tlaloc_jax.decoder.forward) on a Qwen3-MoE-shaped config with random
weights: every layer's MLP a mixture of X experts of which each token uses J. The sparse step is the decoder
as it ships (kernels.moe: each chosen (token, expert) pair reads its expert's weights in place); the dense
step is the same decoder with kernels.moe.moe_reference in its place, which runs all X experts on every token
and weighs them by a routing matrix that is zero off the chosen ones (what a dense all-experts product
costs; the decoder's experts are stacked [L, X, E, F] and scanned over layers, so the dense step also copies
each layer's [X, E, F] out of the stack, as any whole-layer read of stacked weights does on CPU). Both compute
the same logits; the bench checks that they agree.

Bytes a decode step reads, counted from the weights' shapes and the experts the router actually chose for
the step's tokens: the embedding rows, every layer's attention projections, norms and router, the chosen
experts' gate, up and down ([E, F] + [E, F] + [F, E] each, once per (token, expert) pair, as the gathered
form reads them), the final norm and the head; the dense step reads all X experts of every layer instead.
(The KV pages read are the same for both and left out.) XLA's cost analysis cannot count this for the sparse
step: its loop over the chosen pairs has a trip count known only at run time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from tlaloc_jax import decoder
from tlaloc_jax.checkpoint import random_weights
from tlaloc_jax.decoder import StepInputs, forward, init_pools
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.kernels.moe import moe_reference, route, router_logits
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs, pages_for

MIB = 2**20
BLOCK = 16


def hf_config(args) -> dict:
    return dict(model_type="qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden,
                intermediate_size=args.expert_hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                num_key_value_heads=2, head_dim=args.hidden // 8, num_experts=args.experts,
                num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_hidden, norm_topk_prob=True)


def dense_moe(spec, x, router, experts, *, router_bias=None, correction=None, shared=None, valid=None, layer=None):
    """kernels.moe.moe's signature over the dense reference: every expert on every token."""
    if layer is not None:
        experts = {k: v[layer] for k, v in experts.items()}
    return moe_reference(spec, x, router, experts, router_bias=router_bias, correction=correction, shared=shared,
                         valid=valid)


def compiled_step(cfg, weights, pools, inputs, dense: bool):
    """forward, jitted with the pools donated, compiled now (with the dense MoE traced in, for dense=True)."""
    step = jax.jit(functools.partial(forward, cfg), donate_argnums=(1,))
    with mock.patch.object(decoder, "moe", dense_moe) if dense else mock.patch.object(decoder, "moe", decoder.moe):
        return step.lower(weights, pools, inputs).compile()


def median_seconds(step, weights, pools, inputs, repeats):
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        logits, pools = step(weights, pools, inputs)
        logits.block_until_ready()
        if i >= 2:                          # two warm-up calls
            times.append(time.perf_counter() - start)
    return statistics.median(times), logits, pools


def decode_inputs(batch: int, context: int, vocab: int, seed: int) -> tuple[StepInputs, int]:
    """A decode call: `batch` sequences at position context - 1, each holding its own pages."""
    rng = np.random.default_rng(seed)
    need = pages_for(context, BLOCK)
    rows = [RowCall([int(rng.integers(vocab))], context - 1, list(range(b * need, (b + 1) * need)))
            for b in range(batch)]
    inputs = build_step_inputs(rows, batch=batch, tokens=1, width=need, block_size=BLOCK)
    return StepInputs(**{k: jnp.asarray(v) for k, v in inputs.items()}), batch * need


def chosen_experts(cfg, weights, pools, inputs) -> tuple[int, int]:
    """-> ((token, expert) pairs, distinct (layer, expert)s) the step's router chooses for its live tokens:
    the decoder run once with its moe wrapped to report each layer's choices (jax.debug.callback)."""
    seen = []
    real = decoder.moe

    def reporting_moe(spec, x, router, experts, *, router_bias=None, correction=None, shared=None, valid=None,
                      layer=None):
        idx, _ = route(spec, router_logits(x, router, router_bias), correction)
        jax.debug.callback(lambda i, v, l: seen.append((int(l), np.asarray(i)[np.asarray(v)])), idx, valid, layer)
        return real(spec, x, router, experts, router_bias=router_bias, correction=correction, shared=shared,
                    valid=valid, layer=layer)

    with mock.patch.object(decoder, "moe", reporting_moe):
        jax.block_until_ready(jax.jit(functools.partial(forward, cfg))(weights, pools, inputs))
    pairs = sum(idx.size for _, idx in seen)
    distinct = sum(len(np.unique(idx)) for _, idx in seen)
    return pairs, distinct


def step_bytes(cfg, weights, live_tokens: int, experts_read: int) -> int:
    """Weight bytes a decode step reads (module docstring): experts_read expert-sized reads over all layers."""
    expert_bytes = sum(weights[f"layers.expert_{k}"][0, 0].nbytes for k in ("gate", "up", "down"))
    rest = sum(w.nbytes for name, w in weights.items() if not name.startswith("layers.expert_") and name != "embed")
    return live_tokens * weights["embed"][0].nbytes + rest + experts_read * expert_bytes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)

    fam, cfg = config_from_hf(hf_config(args))
    weights = {k: jnp.asarray(v) for k, v in random_weights(cfg, fam, seed=0).items()}
    expert_mib = sum(weights[f"layers.expert_{k}"].nbytes for k in ("gate", "up", "down")) / MIB
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.experts.num_experts} experts of "
          f"{cfg.experts.intermediate_size} ({expert_mib:.1f} MiB of experts), top-{cfg.experts.experts_per_token}; "
          f"decode at context {args.context}, {jax.devices()[0].platform}")
    for batch in args.batch:
        inputs, pages = decode_inputs(batch, args.context, cfg.vocab_size, seed=batch)
        results = {}
        for dense in (False, True):
            pools = init_pools(cfg, pages, BLOCK)
            step = compiled_step(cfg, weights, pools, inputs, dense)
            results[dense] = median_seconds(step, weights, pools, inputs, args.repeats)[:2]
        (t_sparse, sparse_logits), (t_dense, dense_logits) = results[False], results[True]
        err = relative_error(sparse_logits, dense_logits)
        assert err < 1e-4, f"the sparse and dense steps disagree: relative error {err:.3g}"
        pairs, distinct = chosen_experts(cfg, weights, init_pools(cfg, pages, BLOCK), inputs)
        assert pairs == batch * cfg.experts.experts_per_token * cfg.num_layers
        b_sparse = step_bytes(cfg, weights, batch, pairs)
        b_dense = step_bytes(cfg, weights, batch, cfg.num_layers * cfg.experts.num_experts)
        print(f"batch {batch}: decode step {t_sparse * 1e3:.2f} ms sparse, {t_dense * 1e3:.2f} ms dense "
              f"(dense / sparse {t_dense / t_sparse:.2f}x); weights read {b_sparse / MIB:.1f} MiB sparse "
              f"({pairs} (token, expert) pairs over {cfg.num_layers} layers; {distinct} distinct experts, "
              f"{step_bytes(cfg, weights, batch, distinct) / MIB:.1f} MiB, if shared experts were read once), "
              f"{b_dense / MIB:.1f} MiB dense ({b_dense / b_sparse:.2f}x); "
              f"{b_sparse / t_sparse / 2**30:.1f} GiB/s sparse, {b_dense / t_dense / 2**30:.1f} GiB/s dense; "
              f"logits agree to {err:.2g}")


if __name__ == "__main__":
    main()
