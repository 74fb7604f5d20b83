"""The two weight layouts (tlaloc_jax/layout.py): the per-layer form (one array per layer, q|k|v and gate|up
fused, layers unrolled) computes what the stacked, scanned form computes, for every kind of layer, and its
optimized CPU body reads each weight in place where the scanned one copies it first."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import tlaloc_jax
from hf_models import QWEN3_NEXT_MOE, build_checkpoint
from margins import assert_within
from tlaloc_jax.decoder import StepInputs
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.layout import FUSED, fuse_projections, in_layout, is_per_layer, unstack_layers, weight_slice_copies
from tlaloc_jax.paging import RowCall, build_step_inputs

PROMPTS = [[3, 17, 91, 4, 200, 8, 33], [250, 1, 7]]
NEW = 4

# Each kind of layer the decoder unrolls: fused q|k|v and gate|up (llama, with biases in gpt_oss), sliding
# windows and sandwich norms (gemma2), linear-attention layers in two periods (qwen3_5_text), experts per layer
# with a shared expert (qwen3_next sparse) and with sinks and biases (gpt_oss).
CASES = {
    "llama": dict(model_type="llama"),
    "gemma2": dict(model_type="gemma2"),
    "qwen3_5_text": dict(model_type="qwen3_5_text"),
    "qwen3_next_moe": dict(model_type="qwen3_next", **QWEN3_NEXT_MOE),
    "gpt_oss": dict(model_type="gpt_oss"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {}


def _checkpoint(store, tmp_path_factory, name):
    if name not in store:
        store[name] = build_checkpoint(tmp_path_factory.mktemp(name), seed=3, **CASES[name])
    return store[name]


# llama in `make test`; the rest in `make test-slow` (the served parity tests export the per-layer layout for
# llama, qwen3, gemma2/3, mistral and qwen3.5 against transformers in `make test` already).
@pytest.mark.numeric
@pytest.mark.parametrize("name", [n if n == "llama" else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_per_layer_computes_what_stacked_does(checkpoints, tmp_path_factory, name):
    path = _checkpoint(checkpoints, tmp_path_factory, name)
    stacked = tlaloc_jax.load_hf(path, block_size=8)
    per_layer = tlaloc_jax.load_hf(path, block_size=8, weight_layout="per-layer")
    assert is_per_layer(per_layer.weights) and not is_per_layer(stacked.weights)
    cfg = stacked.config
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=max(map(len, PROMPTS)) + NEW))
    want = stacked.first_logits(PROMPTS)
    assert_within(tol.relative_error(per_layer.first_logits(PROMPTS), want), bound, f"{name}: first logits")
    assert per_layer.generate(PROMPTS, NEW) == stacked.generate(PROMPTS, NEW)


def test_fusion_joins_parts_on_the_output_axis_and_unstacking_keeps_every_layer():
    rng = np.random.default_rng(0)
    w = {"attn.q_proj": rng.standard_normal((3, 8, 16)), "attn.k_proj": rng.standard_normal((3, 8, 4)),
         "attn.v_proj": rng.standard_normal((3, 8, 4)), "layers.gate_proj": rng.standard_normal((3, 8, 6)),
         "layers.up_proj": rng.standard_normal((3, 8, 6)), "layers.down_proj": rng.standard_normal((3, 6, 8)),
         "embed": rng.standard_normal((10, 8))}
    fused = fuse_projections(w)
    assert set(fused) == {"attn.qkv_proj", "layers.gate_up_proj", "layers.down_proj", "embed"}
    np.testing.assert_array_equal(fused["attn.qkv_proj"][1, :, 16:20], w["attn.k_proj"][1])
    np.testing.assert_array_equal(fused["layers.gate_up_proj"][2, :, 6:], w["layers.up_proj"][2])
    per = unstack_layers(fused)
    assert per["embed"] is fused["embed"]
    assert len(per["layers.down_proj"]) == 3
    np.testing.assert_array_equal(per["layers.down_proj"][2], w["layers.down_proj"][2])
    assert set(FUSED) >= {"attn.qkv_proj", "layers.gate_up_proj"}
    with pytest.raises(ValueError, match="unknown weight layout 'rows'"):
        in_layout(w, "rows")


def test_per_layer_body_reads_weights_in_place(checkpoints, tmp_path_factory):
    """XLA's CPU dot cannot read a dynamic slice in place: the scanned body copies each layer's weights out of
    their stacks (the control), the per-layer body copies none."""
    path = _checkpoint(checkpoints, tmp_path_factory, "llama")
    copies = {}
    for layout in ("stacked", "per-layer"):
        model = tlaloc_jax.load_hf(path, block_size=8, weight_layout=layout)
        cfg = model.config
        pools = model.new_pools(8)
        inputs = build_step_inputs([RowCall([5], 3, [0, 1])], batch=1, tokens=1, width=2, block_size=8)
        hlo = model._step.lower(model.weights, pools, StepInputs(**{k: jnp.asarray(v) for k, v in inputs.items()})
                                ).compile().as_text()
        # The smallest projection of one layer: a k or v projection.
        copies[layout] = weight_slice_copies(hlo, 4 * cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim)
    assert len(copies["stacked"]) >= 4, copies     # the control: q, k, v, o, gate, up, down copied
    assert copies["per-layer"] == []
