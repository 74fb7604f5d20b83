"""DeepSeek-V3 beyond the mixture-of-experts checks it shares (tests/models/test_moe_families.py: greedy ids in process and
served, its table's tensors): its config keys and refusals, its MoE block (grouped routing with a correction bias,
routed_scaling_factor, a shared expert) against transformers' own, its interleaved rotation, and its artifact:
a KV pool that holds the latent and the rotated key only, int8 for the latent attention's projections.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hf_models import DEEPSEEK_DIMS, build_checkpoint, load_hf_torch, torch_greedy
from margins import assert_within
from oracle import GreedyMismatch, check_greedy_batch, engine_next_token
from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import load_checkpoint
from tlaloc_jax.config import DENSE, SPARSE, ConfigError, LatentConfig
from tlaloc_jax.decoder import moe_spec, pool_shapes
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.moe import moe, moe_reference, route, router_logits, router_margins
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.layers import apply_rope

pytestmark = pytest.mark.numeric

SEED = 69          # tests/models/test_moe_families.py's deepseek_v3 case


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("deepseek"), "deepseek_v3", seed=SEED)


def test_config_keys(checkpoint):
    cfg = load_checkpoint(checkpoint)[0]
    attn = load_hf_torch(checkpoint).model.layers[0].self_attn
    assert cfg.mla == LatentConfig(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=12)
    assert cfg.head_dim == 8
    assert cfg.latent_width == 40 and cfg.rope.interleaved and cfg.rope.rope_type == "yarn"
    assert cfg.mlp_types == (DENSE, SPARSE, SPARSE)
    e = cfg.experts
    assert (e.router_scoring, e.router_normalize, e.router_correction) == ("sigmoid", True, True)
    assert (cfg.experts.router_groups, cfg.experts.router_top_groups, cfg.experts.routed_scaling) == (4, 2, 2.5)
    assert cfg.shared_expert and not cfg.shared_expert_gate and cfg.experts.shared_intermediate_size == 32
    # The scores' scale: qk_head_dim^-1/2 times YaRN's mscale(factor, mscale_all_dim)^2, as transformers has it.
    assert cfg.query_scale == pytest.approx(attn.scaling, rel=1e-15) and cfg.query_scale != 24 ** -0.5


def test_refusals_name_their_keys():
    base = dict(model_type="deepseek_v3", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=2, **{k: v for k, v in DEEPSEEK_DIMS.items() if k != "rope_parameters"})
    base.update(num_key_value_heads=2)
    cfg = config_from_hf(base)[1]
    assert cfg.mlp_types == (DENSE, SPARSE) and cfg.rope.interleaved and cfg.q_lora
    assert config_from_hf(dict(base, q_lora_rank=None))[1].q_direct
    for key, value in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("moe_layer_freq", 2)):
        with pytest.raises(ConfigError, match=f"deepseek_v3 config key {key}={value!r} is not supported"):
            config_from_hf(dict(base, **{key: value}))
    with pytest.raises(ConfigError, match="deepseek_v3 config key attention_bias=True"):
        config_from_hf(dict(base, attention_bias=True))
    with pytest.raises(ConfigError, match="n_group=3 must divide num_experts=8"):
        config_from_hf(dict(base, n_group=3))


def test_what_has_no_latent_form_refuses_it(checkpoint, tmp_path):
    """The Pallas GPU and native CPU decode kernels and the dense training forward have no latent attention: each
    refuses by name when asked for; a cpu export that does not ask gets plain ops (no native attention kernel named:
    only the projection kernel, the cpu default for f32 calls of a few rows)."""
    from tlaloc_jax.dense import dense_hidden, training_attention
    from tlaloc_jax.export import ExportError, export_checkpoint
    with pytest.raises(ExportError, match=r"Pallas GPU decode-attention kernel has no latent-attention form "
                                          r"\(deepseek_v3\)"):
        export_checkpoint(checkpoint, tmp_path / "art", batch_ladder=(1,), context_ladder=(64,), platform="cuda",
                          decode_attention="pallas", progress=False)
    with pytest.raises(ExportError, match=r"the native decode-attention kernel cannot serve this model: it has no "
                                          r"latent-attention form \(deepseek_v3\)"):
        export_checkpoint(checkpoint, tmp_path / "native", batch_ladder=(1,), context_ladder=(64,),
                          decode_attention="native", progress=False)
    m = export_checkpoint(checkpoint, tmp_path / "default", batch_ladder=(1,), context_ladder=(64,), progress=False)
    assert m.versions.custom_calls == ("tlaloc_projection_v1",)
    cfg, w = load_checkpoint(checkpoint)
    with pytest.raises(ConfigError, match=r"the dense forward has no latent attention \(deepseek_v3 config"):
        dense_hidden(cfg, w, jnp.zeros((1, 4), jnp.int32), attention=training_attention())


@torch.no_grad()
def test_moe_block_matches_transformers(checkpoint):
    """Layer 1's mixture of experts (sigmoid scores, the correction bias for the choice only, 2 of 4 groups, top-2,
    renormalised, times routed_scaling_factor 2.5, plus the shared expert) against transformers' DeepseekV3MoE on 48
    tokens: the same experts chosen (no choice within rounding of a tie: checked first), outputs within the
    tolerance model's bound, for kernels.moe's fast form and its dense reference. Controls: the correction bias
    dropped or the groups ignored choose other experts; the scaling factor left out breaks the outputs' match."""
    cfg, w = load_checkpoint(checkpoint)
    block = load_hf_torch(checkpoint).model.layers[1].mlp
    x = torch.randn(2, 24, cfg.hidden_size, generator=torch.Generator().manual_seed(3)) * 2.0
    want = block(x).numpy()
    _, _, want_idx = block.gate(x)
    xj = jnp.asarray(x.numpy())
    spec = moe_spec(cfg)
    layer = {name[len("layers."):]: w[name][0] for name in w
             if name.startswith("layers.") and ("expert" in name or "router" in name or "shared" in name)}
    experts = {k: layer[f"expert_{k}"] for k in ("gate", "up", "down")}
    shared = {k: layer[f"shared_{k}"] for k in ("gate", "up", "down")}
    correction = layer["router_correction"]
    logits = router_logits(xj, layer["router"])
    bound = tol.bound(tol.moe_roundings(hidden=cfg.hidden_size, expert_hidden=cfg.experts.intermediate_size,
                                        experts=cfg.experts.num_experts, top_k=cfg.experts.experts_per_token,
                                        shared_hidden=cfg.experts.shared_intermediate_size))
    ratio = float(jnp.min(router_margins(spec, logits, correction))) / (2 * bound * float(jnp.max(jnp.abs(logits))))
    assert ratio > 1, "a routing choice within rounding of a tie: choose another input seed"
    idx = np.sort(np.asarray(route(spec, logits, correction)[0]).reshape(-1, spec.top_k), axis=-1)
    np.testing.assert_array_equal(idx, np.sort(want_idx.numpy(), axis=-1))

    def run(f, spec=spec, correction=correction):
        call = jax.jit(lambda x, c: f(spec, x, layer["router"], experts, correction=c, shared=shared))
        return np.asarray(call(xj, correction))

    assert_within(relative_error(run(moe), want), bound, "deepseek MoE block vs transformers")
    assert_within(relative_error(run(moe_reference), want), bound, "deepseek MoE reference vs transformers")
    # Controls: without the correction bias, or the groups, other experts are chosen; without the scaling factor
    # the output is off.
    for what, spec_, corr in (("no correction", spec, None),
                              ("no groups", dataclasses.replace(spec, groups=1, top_groups=1), correction)):
        chosen = np.sort(np.asarray(route(spec_, logits, corr)[0]).reshape(-1, spec.top_k), axis=-1)
        assert np.any(chosen != np.sort(want_idx.numpy(), axis=-1)), f"control ({what}) chose alike"
    unscaled = run(moe_reference, spec=dataclasses.replace(spec, scale=1.0))
    assert relative_error(unscaled, want) > 100 * bound, "control (no scaling) matched"


def test_interleaved_rotation_matches_transformers():
    """apply_rope(interleaved=True) gives transformers' apply_rotary_pos_emb_interleave; the rotate-half pairing
    (the control) does not."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 5, 3, 8)).astype(np.float32)          # [B, T, H, R]
    freqs = rng.uniform(0, 3, (1, 5, 4)).astype(np.float32)
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))
    want, _ = apply_rotary_pos_emb_interleave(torch.tensor(q).transpose(1, 2), torch.tensor(q).transpose(1, 2),
                                              torch.tensor(cos), torch.tensor(sin))
    want = want.transpose(1, 2).numpy()
    bound = tol.bound(3)                                               # two products and a sum
    assert_within(relative_error(apply_rope(q, cos, sin, interleaved=True), want), bound, "interleaved rotation")
    assert relative_error(apply_rope(q, cos, sin), want) > 100 * bound


# ---------------------------------------------------------------------------------------------------
# The artifact: the latent pool, int8.


def export_int8(checkpoint, out, **ladders):
    from tlaloc_jax.export import export_checkpoint
    export_checkpoint(checkpoint, out, block_size=8, prefill_chunk=32, prefill_long_chunk=0, weight_quant="int8",
                      progress=False, **ladders)
    return out


@pytest.fixture(scope="module")
def int8_artifact(checkpoint, tmp_path_factory):
    """The smallest ladders: what the manifest records does not depend on them."""
    return export_int8(checkpoint, tmp_path_factory.mktemp("deepseek-int8") / "art", batch_ladder=(1,),
                       context_ladder=(64,))


def kv_bytes_per_token(m: af.Manifest) -> int:
    """The bytes a token's position takes in the artifact's paged pools, from the manifest alone."""
    return sum(p.nbytes // (p.capacity * m.block_size) for p in m.pools if p.kind == af.PoolKind.PAGED_KV)


def test_kv_pool_holds_the_latent_only(checkpoint, int8_artifact):
    """The one KV pool is paged_kv [L, 1, P, S, 1, C + R]: per token and layer the latent (32) and the rotated key
    (8), f32: 160 bytes a layer, against 256 for a GQA model of the same size (2 KV heads of 16: keys and values) and
    576 for the heads' expanded keys (Dn + R) and values (Dv)."""
    cfg = load_checkpoint(checkpoint)[0]
    m = af.load_manifest(int8_artifact)
    assert [(p.name, p.kind) for p in m.pools] == [("kv", af.PoolKind.PAGED_KV)]
    (pool,) = m.pools
    assert pool.shape == (cfg.num_layers, 1, pool.capacity, 8, 1, cfg.mla.kv_lora_rank + cfg.head_dim)
    per_token = kv_bytes_per_token(m)
    assert per_token == cfg.num_layers * (cfg.mla.kv_lora_rank + cfg.head_dim) * 4 == 3 * 160
    gqa = cfg.replace(mla=LatentConfig(), num_kv_heads=2, head_dim=16)
    shape = pool_shapes(gqa, 1, 1)["kv"]
    assert per_token * 1.6 == np.prod(shape) * 4 == cfg.num_layers * 256
    expanded = cfg.num_heads * (cfg.qk_head_dim + cfg.mla.v_head_dim) * 4 * cfg.num_layers
    assert expanded == 3 * 576


def test_int8_quantizes_the_new_projections(int8_artifact):
    """The latent attention's q_a, q_b, kv_a and o projections, the dense layer's gate|up and down, the experts and
    the shared expert are stored int8 (codes and scales per layer); k_b, v_b, the router and its correction bias
    keep f32."""
    quant = {w.slot for w in af.load_manifest(int8_artifact).weights if w.quant}
    plain = {w.slot for w in af.load_manifest(int8_artifact).weights if not w.quant}
    for slot in ("attn.q_a_proj", "attn.q_b_proj", "attn.kv_a_proj", "attn.o_proj"):
        assert {f"{slot}.{i}.{part}" for i in range(3) for part in ("codes", "scales")} <= quant, slot
    for slot in ("layers.shared_gate", "layers.shared_up", "layers.shared_down", "layers.expert_gate"):
        assert {f"{slot}.{i}.codes" for i in range(2)} <= quant, slot
    assert {"layers.gate_up_proj.0.codes", "layers.down_proj.0.codes"} <= quant
    assert {"attn.k_b_proj.0", "attn.v_b_proj.2", "layers.router.1", "layers.router_correction.1"} <= plain


@pytest.mark.slow
def test_served_int8_matches_the_dequantized_checkpoint(checkpoint, tmp_path):
    """The int8 artifact served by the JAX-free runtime: its greedy ids, prompts alone and 4 at once, against
    transformers running the weights the codes stand for (the dequantized checkpoint), near-tie rule at the f32
    bound. Control: the wrong-axis codes, in process."""
    import tlaloc_jax
    from tlaloc_jax.checkpoint import read_config, save_checkpoint
    from quant_controls import wrong_axis_weights
    from tlaloc_jax.export._quant import quantize_weights
    from tlaloc_jax.kernels.quantized_matmul import QuantizedWeight, dequantize
    from tlaloc_jax.serve import Engine
    from test_moe_families import PROMPTS, NEW
    cfg, weights = load_checkpoint(checkpoint, "float32")
    deq = {k: (dequantize(v).astype(np.float32) if isinstance(v, QuantizedWeight) else v)
           for k, v in quantize_weights(weights, "int8", 0, compute="float32").items()}
    save_checkpoint(tmp_path / "deq", read_config(checkpoint), deq)
    oracle = load_hf_torch(tmp_path / "deq")
    want = [torch_greedy(oracle, p, NEW) for p in PROMPTS]
    bound = tol.bound(tol.decoder_roundings_of(cfg, max(map(len, PROMPTS)) + NEW))
    art = export_int8(checkpoint, tmp_path / "art", batch_ladder=(1, 4), context_ladder=(64, 128))
    with Engine.load(art, progress=False) as eng:
        next_token = engine_next_token(eng)
        check_greedy_batch(PROMPTS, [eng.generate([p], NEW)[0] for p in PROMPTS], want, logit_bound=bound,
                           next_token=next_token)
        check_greedy_batch(PROMPTS, eng.generate(PROMPTS, NEW), want, logit_bound=bound, next_token=next_token)
    wrong = tlaloc_jax.Model(cfg, wrong_axis_weights(weights, "int8", 0, compute="float32"), block_size=8)
    with pytest.raises(GreedyMismatch):
        check_greedy_batch(PROMPTS, wrong.generate(PROMPTS, NEW), want, logit_bound=bound,
                           next_token=engine_next_token(wrong))
