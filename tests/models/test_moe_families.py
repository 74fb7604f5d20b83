"""Mixture-of-experts families (qwen3_moe, with dense layers among the sparse ones too, mixtral, gpt_oss, qwen3_next
with its sparse layers, deepseek_v3) against transformers: their family tables, greedy ids and first logits in
process and served, and what a decode step reads.

Routing near-ties. A token's experts are the router's J largest logits, a discontinuous choice: where two logits
are within rounding of each other, this decoder and transformers may choose differently, and then the token's
output (and every later token that attends to it) differs by far more than rounding. The near-tie rule on the
greedy ids tolerates close *final* logits only, so each oracle run here first checks its own routing: over every
token of every prompt and its 16 generated ids, in every sparse layer, transformers' router margin (J-th minus
(J + 1)-th logit; for DeepSeek-V3's grouped choice the least gap of its choice quantity and of its group scores,
kernels.moe.router_margins, whose sigmoid shrinks a logit's error by 4 at least) must exceed twice the tolerance
model's bound times that layer's largest |router logit|. Where
that holds, both sides choose the same experts everywhere and the tolerance model's bound applies to the logits;
the seeds below pass it with room (the smallest margin is printed with TLALOC_TOLERANCE_REPORT=1 as a margin
record). A seed that did not would fail with its own message, never as a mismatch.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest
import torch

import tlaloc_jax
from hf_models import assert_random_weights_round_trip, assert_saved_back, QWEN3_NEXT_MOE, build_checkpoint, load_hf_torch, torch_greedy
from margins import assert_within
from oracle import GreedyMismatch, check_greedy_batch, check_served_greedy, engine_next_token
from tlaloc_jax.checkpoint import load_checkpoint, random_weights
from tlaloc_jax.config import DENSE, FULL, SLIDING, SPARSE, ConfigError
from tlaloc_jax.decoder import StepInputs, moe_spec
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.hf_config import read_rope
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.moe import router_margins
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.layers import rope_inv_freq
from tlaloc_jax.artifact import Role
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs

pytestmark = pytest.mark.numeric

# Two prompts longer than one 32-token prefill chunk of the served path (and than gpt_oss's and mixtral's
# 8-token windows), and short ones.
LONG = [[(i * 37 + 11) % 256 for i in range(100)], [(i * 11 + 5) % 253 for i in range(70)]]
PROMPTS = LONG + [[42], [5, 17, 99, 3, 249, 8, 61]]
NEW = 16

CASES = {
    "qwen3_moe": dict(model_type="qwen3_moe", seed=61),
    # seed 62 failed the routing precondition (a token of the 70-token prompt, layer 0: its router margin was
    # 0.42 of the tie threshold), which is what the precondition is for; 67's smallest margin is 25 times it.
    "mixtral": dict(model_type="mixtral", seed=67),
    # seed 65: the tiny random GPT-OSS seeds 63 and 64 repeat one token from the first step on.
    "gpt_oss": dict(model_type="gpt_oss", seed=65),
    "qwen3_next": dict(model_type="qwen3_next", seed=64, **QWEN3_NEXT_MOE),
    # Dense MLPs among the sparse ones: layer 1 (mlp_only_layers) of sparse, dense, sparse.
    "qwen3_moe_mixed": dict(model_type="qwen3_moe", seed=68, mlp_only_layers=[1]),
    # Latent attention, a dense first layer, grouped routing with a correction bias, a shared expert.
    "deepseek_v3": dict(model_type="deepseek_v3", seed=69),
}
# make test runs these in process; every family runs in process and served under make test-slow.
QUICK = ("qwen3_moe",)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers' delta rule (qwen3_next) and its per-expert loops are many small ops: on a small shared
    machine one torch thread runs them far faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def store():
    return {}


def checkpoint(store, tmp_path_factory, name):
    key = ("checkpoint", name)
    if key not in store:
        store[key] = build_checkpoint(tmp_path_factory.mktemp(name), **CASES[name])
    return store[key]


def logit_bound(cfg) -> float:
    return tol.bound(tol.decoder_roundings_of(cfg, context=max(map(len, PROMPTS)) + NEW))


@torch.no_grad()
def oracle(store, tmp_path_factory, name):
    """transformers' greedy runs of PROMPTS, after checking that no token's routing is within rounding of a tie."""
    key = ("oracle", name)
    if key in store:
        return store[key]
    path = checkpoint(store, tmp_path_factory, name)
    ref = load_hf_torch(path)
    cfg = load_checkpoint(path)[0]
    runs = [torch_greedy(ref, p, NEW) for p in PROMPTS]
    bound, spec = logit_bound(cfg), moe_spec(cfg)
    correction = load_checkpoint(path)[1].get("layers.router_correction")
    sparse = [i for i, t in enumerate(cfg.mlp_types) if t == SPARSE]
    worst = np.inf
    for prompt, run in zip(PROMPTS, runs):
        out = ref(torch.tensor([prompt + run.ids]), output_router_logits=True)
        assert len(out.router_logits) == len(sparse)
        for k, (layer, logits) in enumerate(zip(sparse, out.router_logits)):
            logits = logits.float().numpy()
            margins = router_margins(spec, jnp.asarray(logits), None if correction is None else correction[k])
            ratio = float(np.min(margins)) / (2 * bound * float(np.abs(logits).max()))
            assert ratio > 1, (f"{name}: a token of the {len(prompt)}-token prompt has router logits in layer {layer} "
                               "within rounding of a tie; choose another seed")
            worst = min(worst, ratio)
    # Recorded as a margin: how far below the tie threshold the closest routing choice is (bound / measured).
    assert_within(1.0 / worst, 1.0, f"{name}: closest routing choice (tie threshold / smallest router margin)")
    store[key] = runs
    return runs


def rolled_experts(model):
    """Control: each expert's weights moved to the next expert's place (experts read one off along X)."""
    w = {k: jnp.roll(v, 1, axis=1) if k.startswith("layers.expert_") else v for k, v in model.weights.items()}
    return model.with_weights(w)


def in_process(name, store, tmp_path_factory):
    path = checkpoint(store, tmp_path_factory, name)
    want = oracle(store, tmp_path_factory, name)
    model = tlaloc_jax.load_hf(path, block_size=8)
    assert model.config.experts.num_experts == 8 and model.config.experts.experts_per_token == 2
    bound = logit_bound(model.config)
    check_greedy_batch(PROMPTS, model.generate(PROMPTS, NEW), want, logit_bound=bound,
                       next_token=engine_next_token(model))
    for prompt, first, run in zip(PROMPTS, model.first_logits(PROMPTS), want):
        assert_within(relative_error(first, run.logits[0]), bound, f"{name}, prompt of {len(prompt)}: first logits")
    broken = rolled_experts(model)
    with pytest.raises(GreedyMismatch):
        check_greedy_batch(PROMPTS, broken.generate(PROMPTS, NEW), want, logit_bound=bound,
                           next_token=engine_next_token(broken))
    return model, want, bound


@pytest.mark.parametrize("name", QUICK)
def test_in_process_gives_transformers_ids_and_first_logits(name, store, tmp_path_factory):
    """Prompts prefilled and decoded together in process give transformers' greedy ids (near-tie rule) and first
    logits within the tolerance model's bound. Control: the experts read one off along X fails the check."""
    model, want, bound = in_process(name, store, tmp_path_factory)
    if name == "gpt_oss":
        # Control: the attention sinks dropped (a softmax without its sink term).
        no_sinks = tlaloc_jax.Model(model.config.replace(attention=dict(sinks=False)), model.weights, block_size=8)
        with pytest.raises(GreedyMismatch):
            check_greedy_batch(PROMPTS, no_sinks.generate(PROMPTS, NEW), want, logit_bound=bound,
                               next_token=engine_next_token(no_sinks))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in QUICK])
def test_in_process_gives_transformers_ids_and_first_logits_slow(name, store, tmp_path_factory):
    in_process(name, store, tmp_path_factory)


def served_first_logits(eng, prompt, monkeypatch) -> np.ndarray:
    """The logits the served engine computes after `prompt` alone (its last prefill chunk's row)."""
    seen = []
    real = eng.runner.run

    def keep_logits(entry, inputs, want):
        if entry.kind == "copy_slots":
            return real(entry, inputs, want)      # a state snapshot's copy: no logits
        out = real(entry, inputs, set(want) | {Role.LOGITS})
        seen.append((out[Role.LOGITS], np.flatnonzero(np.asarray(inputs["seq_lens"]) > 0)))
        return out

    with monkeypatch.context() as patch:
        patch.setattr(eng.runner, "run", keep_logits)
        eng.generate([prompt], 1)
    logits, (row,) = seen[-1]
    return np.asarray(logits)[row]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_served_gives_transformers_ids(name, store, tmp_path_factory, tmp_path, monkeypatch, serve_cache_dir):
    """Exported (decode and 32-token prefill chunks, batches 1 and 4, contexts 64 and 128) and served by the
    JAX-free runtime: each prompt alone, then all decoded together, give transformers' greedy ids (near-tie
    rule), and each prompt's first logits are within the tolerance model's bound of transformers'. The artifact
    stores each layer's experts as one file, [X, in, out] (the per-layer layout). Control: the served expert_down
    weights of every layer rewritten with the experts one off along X (loaded with trust_weights, which skips the hashes)
    fail the check."""
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.serve import Engine
    path = checkpoint(store, tmp_path_factory, name)
    want = oracle(store, tmp_path_factory, name)
    art = tmp_path / "art"
    m = export_checkpoint(path, art, batch_ladder=(1, 4), context_ladder=(64, 128), block_size=8, prefill_chunk=32,
                          prefill_long_chunk=0,
                          progress=False)
    cfg = load_checkpoint(path)[0]
    weights = {w.slot: w for w in m.weights}
    X, E, FX, L = cfg.experts.num_experts, cfg.hidden_size, cfg.experts.intermediate_size, cfg.mlp_types.count(SPARSE)
    for i in range(L):
        assert weights[f"layers.expert_gate.{i}"].shape == (X, E, FX)
        assert weights[f"layers.expert_down.{i}"].shape == (X, FX, E)
    bound = logit_bound(cfg)

    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as eng:
        check_served_greedy(eng, PROMPTS, want, logit_bound=bound, new=NEW)
        for prompt, run in zip(PROMPTS, want):
            assert_within(relative_error(served_first_logits(eng, prompt, monkeypatch), run.logits[0]), bound,
                          f"{name} served, prompt of {len(prompt)}: first logits")
    for i in range(L):
        down = art / weights[f"layers.expert_down.{i}"].file
        arr = np.fromfile(down, np.float32).reshape(X, FX, E)
        np.roll(arr, 1, axis=0).tofile(down)
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False, trust_weights=True) as eng:
        with pytest.raises(GreedyMismatch):
            check_served_greedy(eng, PROMPTS, want, logit_bound=bound, new=NEW)


# ---------------------------------------------------------------------------------------------------
# What a decode step reads: only the chosen experts, each in place.


def _materialised(hlo: str, shapes) -> list[str]:
    """The instructions of an optimized HLO module that make an f32 buffer of one of `shapes`: results of
    computations, not the weights a step is handed (parameters, loop-carried aliases, layouts)."""
    found = []
    for line in hlo.splitlines():
        if re.search(r"parameter\(|get-tuple-element\(|bitcast\(| tuple\(", line) or line.startswith("HloModule"):
            continue
        if any(re.search(r"= f32\[" + ",".join(map(str, shape)) + r"\]", line) for shape in shapes):
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("layout", ["stacked", "per-layer"])
def test_decode_step_copies_no_layer_of_experts(store, tmp_path_factory, layout):
    """The compiled decode step (B = 4, T = 1) holds no [X, E, F] buffer: the experts of a layer are never
    sliced out of the stacked [L, X, E, F] weights as a whole (which reads every expert), only each chosen
    expert's [E, F] is; nor, in the per-layer layout (what the exporter writes), out of a layer's [X, E, F]
    weight. Control: a step that slices a layer's experts out of the stack whole is caught by the same check."""
    model = tlaloc_jax.load_hf(checkpoint(store, tmp_path_factory, "qwen3_moe"), block_size=8, weight_layout=layout)
    cfg = model.config
    X, E, FX = cfg.experts.num_experts, cfg.hidden_size, cfg.experts.intermediate_size
    pools = model.new_pools(16)
    inputs = build_step_inputs([RowCall([3], 5, [0, 1]), RowCall([4], 2, [2]), RowCall([], 0, None),
                                RowCall([9], 0, [3])], batch=4, tokens=1, width=2, block_size=8)
    hlo = model._step.lower(model.weights, pools, StepInputs(**{k: jnp.asarray(v) for k, v in inputs.items()})
                            ).compile().as_text()
    layer_of_experts = (X, E, FX), (X, FX, E)
    assert _materialised(hlo, layer_of_experts) == []
    # Control: a step that takes a layer's experts out of the stack whole (then scales them) is caught.
    stacked = jnp.zeros((cfg.num_layers, X, E, FX), jnp.float32)
    whole = jax.jit(lambda w, i: lax.dynamic_index_in_dim(w, i, keepdims=False) * 2.0).lower(
        stacked, jnp.int32(1)).compile().as_text()
    assert _materialised(whole, layer_of_experts)
    one_expert = rf"f32\[1,1,{E},{FX}\]"
    assert re.search(one_expert, hlo) or re.search(rf"f32\[{E},{FX}\]", hlo)


@pytest.mark.slow
def test_moe_decoder_trains_through_the_dense_forward(monkeypatch):
    """jax.grad of the training forward's next-token loss (tlaloc_jax.dense: layers scanned, each layer's experts
    [X, ...]) for a tiny qwen3_moe through kernels.moe's custom_vjp, against the same loss with the dense reference
    in its place. Routing near-ties: the reference run records every router margin, which must exceed twice the
    forward's logit bound (module docstring)."""
    from tlaloc_jax import decoder
    from tlaloc_jax.dense import next_token_loss, training_attention
    from tlaloc_jax.kernels.moe import moe_reference, router_logits, router_margins
    hf = dict(MOE_BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    fam, cfg = config_from_hf(hf)
    weights = {k: jnp.asarray(v) for k, v in random_weights(cfg, fam, seed=5, std=0.3).items()}
    batch = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 18)), jnp.int32)
    margins = []

    def dense_moe(spec, x, router, experts, *, router_bias=None, correction=None, shared=None, valid=None,
                  layer=None, first_expert=0):
        assert first_expert == 0        # one device: every expert is this shard's
        logits = router_logits(x, router, router_bias)
        jax.debug.callback(lambda m, s: margins.append(float(np.min(m)) / float(s)),
                           router_margins(spec, logits, correction), jnp.max(jnp.abs(logits)))
        return moe_reference(spec, x, router, experts, router_bias=router_bias, correction=correction, shared=shared,
                             valid=valid)

    def grads():
        loss = lambda w: next_token_loss(cfg, w, batch, attention=training_attention(key_block=8))  # noqa: E731
        return jax.jit(jax.grad(loss))(weights)

    got = grads()
    with monkeypatch.context() as patch:
        patch.setattr(decoder, "moe", dense_moe)
        want = grads()
    forward = tol.decoder_roundings_of(cfg, context=17)
    assert margins and min(margins) > 2 * tol.bound(forward), "a routing choice within rounding of a tie"
    bound = tol.bound(tol.backward_roundings(forward, batch_tokens=2 * 17))
    assert set(got) == set(want)
    for k in sorted(got):
        assert_within(relative_error(got[k], want[k]), bound, f"dense forward's gradient of {k}")


# ---------------------------------------------------------------------------------------------------
# The family tables.


def test_config_keys(store, tmp_path_factory):
    cfgs = {name: load_checkpoint(checkpoint(store, tmp_path_factory, name))[0] for name in CASES}
    q, mx, g, nx = cfgs["qwen3_moe"], cfgs["mixtral"], cfgs["gpt_oss"], cfgs["qwen3_next"]
    assert q.attention.qk_norm
    assert (q.experts.router_scoring, q.experts.router_normalize, q.experts.intermediate_size) == ("softmax", False, 32)
    assert (mx.experts.router_scoring, mx.experts.router_normalize,
            mx.experts.intermediate_size) == ("softmax", True, 32)
    assert mx.layer_types == (SLIDING,) * 3 and mx.sliding_window == 8
    assert (g.experts.router_scoring, g.experts.activation, g.experts.router_bias,
            g.experts.expert_bias) == ("topk_softmax", "swiglu_clamped", True, True)
    assert g.attention.bias and g.attention.sinks and g.experts.swiglu_limit == 0.6 and g.experts.swiglu_alpha == 1.702
    assert g.layer_types == (SLIDING, FULL, SLIDING, FULL) and g.rope.rope_type == "yarn"
    assert nx.experts.router_normalize and nx.experts.shared_intermediate_size == 48 and nx.attention.output_gate
    assert not any(c.shared_expert for c in (q, mx, g))


@pytest.mark.parametrize("name", list(CASES))
def test_weights_read_as_transformers_holds_them(name, store, tmp_path_factory):
    """Each expert's slot [X, in, out] against transformers' own modules (whatever its checkpoint layout: one
    tensor per expert, or GPT-OSS's fused gate_up with gate and up alternating)."""
    path = checkpoint(store, tmp_path_factory, name)
    cfg, w = load_checkpoint(path)
    layer = 1 if cfg.mlp_types[1] == SPARSE else cfg.mlp_types.index(SPARSE)   # and its place in the expert stacks:
    k = cfg.mlp_types[:layer].count(SPARSE)
    mlp = load_hf_torch(path).model.layers[layer].mlp
    experts = mlp.experts
    if name == "gpt_oss":
        gate_up = experts.gate_up_proj.detach().numpy()                      # [X, E, 2 FX], [in, out]
        np.testing.assert_array_equal(w["layers.expert_gate"][k], gate_up[..., 0::2])
        np.testing.assert_array_equal(w["layers.expert_up"][k], gate_up[..., 1::2])
        np.testing.assert_array_equal(w["layers.expert_up_bias"][k], experts.gate_up_proj_bias.detach().numpy()[:, 1::2])
        np.testing.assert_array_equal(w["layers.router_bias"][k], mlp.router.bias.detach().numpy())
    else:
        gate_up = experts.gate_up_proj.detach().numpy()                      # [X, 2 FX, E], [out, in]
        FX = cfg.experts.intermediate_size
        np.testing.assert_array_equal(w["layers.expert_gate"][k], gate_up[:, :FX].swapaxes(1, 2))
        np.testing.assert_array_equal(w["layers.expert_up"][k], gate_up[:, FX:].swapaxes(1, 2))
        np.testing.assert_array_equal(w["layers.expert_down"][k], experts.down_proj.detach().numpy().swapaxes(1, 2))
    if DENSE in cfg.mlp_types:      # the dense layers' MLPs stack apart, in layer order
        dense = cfg.mlp_types.index(DENSE)
        np.testing.assert_array_equal(w["layers.gate_proj"][0], load_hf_torch(path).model.layers[dense].mlp.gate_proj
                                      .weight.detach().numpy().T)


@pytest.mark.parametrize("name", list(CASES))
def test_save_checkpoint_writes_back_every_tensor(name, store, tmp_path_factory, tmp_path):
    """Load a transformers checkpoint and save it back: every tensor bit for bit (the per-expert tensors, and
    GPT-OSS's gate_up rebuilt from its two alternating halves)."""
    assert_saved_back(checkpoint(store, tmp_path_factory, name), tmp_path / "c")


MOE_BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8)


def test_refusals_name_their_keys():
    q = dict(MOE_BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    config_from_hf(q)
    # Dense layers among the sparse ones, by Qwen's two keys.
    assert config_from_hf(dict(q, decoder_sparse_step=2))[1].mlp_types == (DENSE, SPARSE)
    assert config_from_hf(dict(q, mlp_only_layers=[1]))[1].mlp_types == (SPARSE, DENSE)
    with pytest.raises(ConfigError, match=r"qwen3_moe config has no experts"):
        config_from_hf(dict(q, num_experts=0))
    with pytest.raises(ConfigError, match="num_experts_per_tok=5 must be between 1 and num_experts=4"):
        config_from_hf(dict(q, num_experts_per_tok=5))
    with pytest.raises(ConfigError, match="qwen3_moe config key hidden_act='gelu_pytorch_tanh' is not supported for "
                                          "experts"):
        config_from_hf(dict(q, hidden_act="gelu_pytorch_tanh"))
    with pytest.raises(ConfigError, match="qwen3_moe config key attention_bias=True"):
        config_from_hf(dict(q, attention_bias=True))
    g = dict(MOE_BASE, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2)
    assert config_from_hf(g)[1].layer_types == (SLIDING, FULL)
    # The Hub's GPT-OSS checkpoints store their experts in MXFP4.
    with pytest.raises(ConfigError, match=r"gpt_oss config key quantization_config \(quant_method 'mxfp4'\) is not "
                                          "supported"):
        config_from_hf(dict(g, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": []}))
    # Qwen3-MoE's use_sliding_window puts every layer in the window, as transformers does.
    assert config_from_hf(dict(q, use_sliding_window=True, sliding_window=16))[1].layer_types == (SLIDING,) * 2
    assert config_from_hf(dict(q, sliding_window=16))[1].layer_types == (FULL,) * 2


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "qwen3_next"])
def test_random_weights_round_trip(model_type, tmp_path):
    hf = dict(MOE_BASE, model_type=model_type, num_experts_per_tok=2, moe_intermediate_size=8)
    hf["num_local_experts" if model_type in ("mixtral", "gpt_oss") else "num_experts"] = 4
    if model_type == "qwen3_next":
        hf.update(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
                  linear_value_head_dim=4, shared_expert_intermediate_size=12)
    assert_random_weights_round_trip(hf, tmp_path / model_type)


@pytest.mark.parametrize("params", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    dict(factor=4.0, original_max_position_embeddings=64),
    dict(factor=8.0, original_max_position_embeddings=256, mscale=1.0, mscale_all_dim=0.5, beta_fast=16.0),
    dict(factor=2.0, original_max_position_embeddings=128, attention_factor=1.3, partial_rotary_factor=0.5),
], ids=["gpt-oss", "defaults", "mscale", "attention_factor"])
def test_yarn_frequencies_match_transformers(params):
    """YaRN's inverse frequencies and cos/sin scale against transformers' own computation (both in f32; torch's
    and numpy's pow differ by an ulp, counted as a transcendental)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope_parameters = dict(rope_type="yarn", rope_theta=150000.0, **params)
    hf = dict(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=2, head_dim=32, max_position_embeddings=4096, rope_parameters=rope_parameters)
    config = LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = read_rope(hf)
    assert rope.attention_factor == pytest.approx(want_factor, rel=1e-12)
    rtol = tol.bound(tol.TRANSCENDENTAL_ULPS + 4)    # pow, the divide, the ramp's blend (a product and a sum)
    np.testing.assert_allclose(rope_inv_freq(rope, 32), want_inv.numpy(), rtol=rtol, atol=0)
    # The blend is exercised: some frequencies are neither the original nor the interpolated ones.
    original = 1.0 / 150000.0 ** (np.arange(0, 32 * rope.partial_rotary_factor, 2) / (32 * rope.partial_rotary_factor))
    assert np.any(np.abs(rope_inv_freq(rope, 32) / original - 1) > 1e-3)
