"""The two weight layouts (tlaloc_jax/layout.py): the per-layer form (one array per layer, q|k|v and gate|up
fused, layers unrolled) computes what the stacked, scanned form computes, for every kind of layer, and its
optimized CPU body reads each weight in place where the scanned one copies it first."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tlaloc_jax
from hf_models import QWEN3_NEXT_MOE, build_checkpoint
from margins import assert_within
from tlaloc_jax.decoder import StepInputs
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.quantized_matmul import NARROW_REDUCE_ROWS
from tlaloc_jax.layers import REDUCE_ROWS, OutMajor, linear
from tlaloc_jax.layout import (FUSED, LINEAR_SLOTS, fuse_projections, in_layout, is_per_layer, out_major,
                               unstack_layers, weight_slice_copies)
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs

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


def test_projections_are_stored_out_in_and_other_slots_are_not():
    rng = np.random.default_rng(1)
    w = {"attn.qkv_proj": (rng.standard_normal((8, 24)), rng.standard_normal((8, 24))),
         "head": rng.standard_normal((8, 10)), "layers.attn_norm": (np.ones(8), np.ones(8)),
         "layers.router": (rng.standard_normal((8, 4)),), "embed": rng.standard_normal((10, 8))}
    got = out_major(w)
    assert isinstance(got["head"], OutMajor) and got["head"].shape == (8, 10)
    np.testing.assert_array_equal(got["head"].out_in, w["head"].T)
    np.testing.assert_array_equal(got["attn.qkv_proj"][1].out_in, w["attn.qkv_proj"][1].T)
    assert got["attn.qkv_proj"][1].out_in.flags.c_contiguous
    # Norms, the embedding table and the MoE router (kernels.moe reads it) keep their arrays.
    assert got["layers.attn_norm"] is w["layers.attn_norm"] and got["embed"] is w["embed"]
    assert got["layers.router"] is w["layers.router"]
    assert "layers.router" not in LINEAR_SLOTS and "embed" not in LINEAR_SLOTS


@pytest.mark.numeric
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 2, 5, NARROW_REDUCE_ROWS, NARROW_REDUCE_ROWS + 1, 40, REDUCE_ROWS, REDUCE_ROWS + 1])
def test_out_major_linear_is_the_dot(rows, dtype):
    """linear over an OutMajor weight (multiply-reduce on CPU for 2..REDUCE_ROWS rows, 2..NARROW_REDUCE_ROWS for
    bf16; a dot otherwise) against the product in float64 of the same rounded operands; the control reads the
    weight in the wrong orientation."""
    rng = np.random.default_rng(rows)
    I, O = 96, 96
    x = rng.standard_normal((rows, I)).astype(np.float32)
    w = (rng.standard_normal((I, O)) / np.sqrt(I)).astype(dtype)
    xr = x.astype(dtype).astype(np.float64)                   # linear rounds x to a bf16 weight's dtype
    want = xr @ w.astype(np.float64)
    f = jax.jit(linear)
    got = f(jnp.asarray(x.reshape(1, rows, I)), OutMajor(jnp.asarray(np.ascontiguousarray(w.T))))
    assert got.shape == (1, rows, O) and got.dtype == jnp.float32
    bound = tol.bound(I + 1)                                  # I - 1 additions, each product exact in f32
    assert_within(tol.relative_error(got[0], want), bound, f"OutMajor linear, {rows} rows, {dtype}")
    wrong = f(jnp.asarray(x), OutMajor(jnp.asarray(w)))       # control: [I, O] read as [O, I]
    assert tol.relative_error(wrong, want) > 100 * bound


def _layer_projection_reduces(hlo: str, batch: int, cfg) -> int:
    """The reduce instructions of an optimized CPU body with a layer projection's [batch, O] f32 result."""
    widths = {(cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.num_heads * cfg.head_dim,
              2 * cfg.intermediate_size, cfg.hidden_size}
    return sum(int(o) in widths for o in re.findall(rf"= f32\[{batch},(\d+)\]\{{1,0\}} reduce\(", hlo))


def test_cpu_body_runs_few_row_projections_as_multiply_reduce(checkpoints, tmp_path_factory):
    """On CPU the per-layer batch-4 decode body computes each layer projection (q|k|v, o, gate|up, down) as a
    reduce over the [O, I] weight; the batch-1 body (dots) and the stacked body at batch 4 are the controls."""
    path = _checkpoint(checkpoints, tmp_path_factory, "llama")
    counts = {}
    for layout, batch in (("per-layer", 4), ("per-layer", 1), ("stacked", 4)):
        model = tlaloc_jax.load_hf(path, block_size=8, weight_layout=layout)
        rows = [RowCall([5], 3, [2 * i, 2 * i + 1]) for i in range(batch)]
        inputs = build_step_inputs(rows, batch=batch, tokens=1, width=2, block_size=8)
        hlo = model._step.lower(model.weights, model.new_pools(8), StepInputs(
            **{k: jnp.asarray(v) for k, v in inputs.items()})).compile().as_text()
        counts[layout, batch] = _layer_projection_reduces(hlo, batch, model.config)
    layers = model.config.num_layers
    assert counts == {("per-layer", 4): 4 * layers, ("per-layer", 1): 0, ("stacked", 4): 0}, counts


def test_decode_body_computes_cos_and_sin_once(checkpoints, tmp_path_factory, monkeypatch):
    """The rope tables' cos and sin are computed once a call (layers.rope_tables doubles them after), where XLA fused
    them into every layer's rotation of q and of k, once per head; the control, doubling the frequencies first,
    computes them there."""
    from tlaloc_jax import decoder, layers

    def doubled_first(rope, head_dim, positions):
        freqs = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * layers.rope_inv_freq(rope, head_dim)
        freqs = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(freqs), jnp.sin(freqs)
    path = _checkpoint(checkpoints, tmp_path_factory, "llama")
    counts = {}
    for doubled_after in (True, False):
        if not doubled_after:
            monkeypatch.setattr(decoder, "rope_tables", doubled_first)
        model = tlaloc_jax.load_hf(path, block_size=8, weight_layout="per-layer")
        inputs = build_step_inputs([RowCall([5], 3, [0, 1])], batch=1, tokens=1, width=2, block_size=8)
        hlo = model._step.lower(model.weights, model.new_pools(8), StepInputs(
            **{k: jnp.asarray(v) for k, v in inputs.items()})).compile().as_text()
        counts[doubled_after] = len(re.findall(r" cosine\(", hlo)), len(re.findall(r" sine\(", hlo))
    assert counts[True] == (1, 1), counts
    assert min(counts[False]) >= 2 * model.config.num_layers, counts
