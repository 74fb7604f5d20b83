"""The paged decoder under jax.jit against transformers on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tlaloc_jax
from hf_models import LLAMA3_ROPE, build_checkpoint, load_hf_torch, torch_greedy
from margins import assert_within
from oracle import GreedyMismatch, check_greedy_batch, engine_next_token, transposed_weight
from tlaloc_jax.kernels import tolerances as tol

pytestmark = pytest.mark.numeric

PROMPTS = [[5, 17, 99, 3, 250, 8, 61], [42], [7, 7, 7, 1, 2, 3, 200, 100, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43],
           [(i * 37 + 11) % 256 for i in range(41)]]

CASES = {
    "llama-untied": dict(model_type="llama", tied=False),
    "llama-tied-llama3rope": dict(model_type="llama", tied=True, rope=LLAMA3_ROPE, seed=1),
    "llama-legacy-rope-keys": dict(model_type="llama", rope=LLAMA3_ROPE, legacy_rope_keys=True, seed=2),
    "qwen3-tied": dict(model_type="qwen3", tied=True, seed=3),
    "qwen3-untied-sharded": dict(model_type="qwen3", tied=False, seed=4, max_shard_size="100KB"),
    # Window 8: prompts and generations span several windows.
    "mistral-window8": dict(model_type="mistral", seed=31),
    "gemma2-softcaps-window8": dict(model_type="gemma2", tied=True, seed=32),
    "gemma3-rope-per-layer-type": dict(model_type="gemma3_text", tied=True, seed=33),
}


# gemma2 and gemma3 run in `make test-slow`: their families are checked against transformers served in test_windowed.
@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n.startswith(("gemma2", "gemma3")) else n
                                        for n in CASES])
def checkpoint(request, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp(request.param), **CASES[request.param])


def f32_logit_bound(cfg, new_tokens: int = 16) -> float:
    """The tolerance model's bound for a logit of this decoder against transformers, both in f32."""
    return tol.bound(tol.decoder_roundings_of(cfg, context=max(map(len, PROMPTS)) + new_tokens))


def test_greedy_ids_and_first_logits_match_transformers(checkpoint):
    ref = load_hf_torch(checkpoint)
    model = tlaloc_jax.load_hf(checkpoint, dtype="float32")
    bound = f32_logit_bound(model.config)
    want = [torch_greedy(ref, prompt, 16) for prompt in PROMPTS]
    check_greedy_batch(PROMPTS, model.generate(PROMPTS, max_new_tokens=16), want, logit_bound=bound,
                       next_token=engine_next_token(model))
    for prompt, first, oracle in zip(PROMPTS, model.first_logits(PROMPTS), want):
        assert_within(tol.relative_error(first, oracle.logits[0]), bound,
                      f"{model.config.model_type}, prompt of {len(prompt)}: first logits")
    # Control: the same checks on a model that reads its attention output projection transposed fail.
    broken = transposed_weight(model)
    with pytest.raises(GreedyMismatch):
        check_greedy_batch(PROMPTS, broken.generate(PROMPTS, max_new_tokens=16), want, logit_bound=bound,
                           next_token=engine_next_token(broken))


def test_with_weights_runs_what_the_model_compiled(tmp_path):
    """Model.with_weights: other weights of the same shapes through the same jitted calls (no new compile), giving
    the Model's own logits with its own weights and other logits with others."""
    model = tlaloc_jax.load_hf(build_checkpoint(tmp_path / "c", model_type="llama", seed=6), dtype="float32")
    want = model.first_logits(PROMPTS)
    compiled = model._greedy._cache_size()
    same = model.with_weights(dict(model.weights))
    np.testing.assert_array_equal(same.first_logits(PROMPTS), want)
    other = transposed_weight(model)
    assert tol.relative_error(other.first_logits(PROMPTS), want) > 0.01
    assert other._greedy is model._greedy and model._greedy._cache_size() == compiled
    np.testing.assert_array_equal(model.first_logits(PROMPTS), want)     # the model's own weights are untouched


def test_sharded_checkpoint_is_read(tmp_path):
    path = build_checkpoint(tmp_path / "c", model_type="qwen3", seed=4, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*.safetensors"))) > 1


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_bf16_weights_match_transformers_in_bf16(tmp_path, model_type):
    """bf16 weights: each projection rounds its input to bf16 and accumulates bf16 x bf16 in f32.

    transformers in bf16 also rounds every activation to bf16, so the two differ by bf16 roundings at up to
    13 points a layer; against transformers in f32 on the same bf16-rounded weights the difference is only
    this library's rounding of the projection inputs (4 a layer). Both bounds come from the tolerance model.
    """
    path = build_checkpoint(tmp_path / "c", model_type=model_type, seed=5)
    model = tlaloc_jax.load_hf(path, dtype="bfloat16")
    assert all(str(w.dtype) == "bfloat16" for w in model.weights.values())
    cfg = model.config
    f32_path = tol.decoder_roundings_of(cfg, context=max(map(len, PROMPTS)))
    bound_bf16 = tol.bound({"bfloat16": tol.bf16_rounding_points(cfg.num_layers, every_activation=True),
                            "float32": f32_path})
    bound_f32w = tol.bound({"bfloat16": tol.bf16_rounding_points(cfg.num_layers, every_activation=False),
                            "float32": f32_path})
    got = model.first_logits(PROMPTS)
    bf16_ref = load_hf_torch(path, dtype=torch.bfloat16)
    f32_on_bf16 = load_hf_torch(path, dtype=torch.bfloat16).float()
    f32_ref = load_hf_torch(path)
    for prompt, g in zip(PROMPTS, got):
        with torch.no_grad():
            want_bf16 = bf16_ref(torch.tensor([prompt])).logits[0, -1].float().numpy()
            want_f32w = f32_on_bf16(torch.tensor([prompt])).logits[0, -1].float().numpy()
            want_f32 = f32_ref(torch.tensor([prompt])).logits[0, -1].float().numpy()
        assert_within(tol.relative_error(g, want_bf16), bound_bf16, f"{model_type} bf16 vs transformers bf16")
        assert_within(tol.relative_error(g, want_f32w), bound_f32w, f"{model_type} bf16 vs transformers f32 on bf16")
        # Control: the bf16 path is really bf16: one bf16 rounding of the weights alone (u = 2^-8 of each,
        # summed over the hidden size) moves it from the f32 model by far more than the f32 bound.
        assert tol.relative_error(g, want_f32) > 10 * f32_logit_bound(cfg)


def test_control_a_model_that_ignores_the_window_differs(tmp_path):
    """The window checks bite: the same mistral weights read with full attention give other logits."""
    path = build_checkpoint(tmp_path / "m", model_type="mistral", seed=31)
    ref = load_hf_torch(path)
    model = tlaloc_jax.load_hf(path)
    full = tlaloc_jax.Model(model.config.replace(layer_types=("full_attention",) * model.config.num_layers),
                            model.weights)
    prompt = PROMPTS[3]
    want = torch_greedy(ref, prompt, 1).logits[0]
    bound = f32_logit_bound(model.config)
    assert_within(tol.relative_error(model.first_logits([prompt])[0], want), bound, "mistral first logits")
    assert tol.relative_error(full.first_logits([prompt])[0], want) > 1e-2
