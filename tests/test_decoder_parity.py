"""The paged decoder under jax.jit against transformers on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tlaloc_jax
from hf_models import LLAMA3_ROPE, build_checkpoint, load_hf_torch, torch_greedy

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


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp(request.param), **CASES[request.param])


def test_greedy_ids_and_first_logits_match_transformers(checkpoint):
    ref = load_hf_torch(checkpoint)
    model = tlaloc_jax.load_hf(checkpoint, dtype="float32")
    ids = model.generate(PROMPTS, max_new_tokens=16)
    logits = model.first_logits(PROMPTS)
    for prompt, got, first in zip(PROMPTS, ids, logits):
        want, want_first = torch_greedy(ref, prompt, 16)
        assert got == want
        scale = float(want_first.abs().max())
        err = float(np.abs(first - want_first.numpy()).max())
        assert err <= 1e-4 * scale, f"first-step logits differ by {err} (largest logit {scale})"


def test_sharded_checkpoint_is_read(tmp_path):
    path = build_checkpoint(tmp_path / "c", model_type="qwen3", seed=4, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*.safetensors"))) > 1


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_bf16_weights_match_transformers_in_bf16(tmp_path, model_type):
    """bf16 weights: each projection rounds its input to bf16 and accumulates bf16 x bf16 in f32.

    transformers in bf16 also rounds every activation to bf16, so the two differ by bf16 rounding of
    the activations: we require 2e-2 of the largest logit (measured here: 7.2e-3 to 1.2e-2). Against
    transformers in f32 on the same bf16-rounded weights the only difference is the rounding of the
    projection inputs: we require 1e-2 (measured: 3.6e-3 to 6.5e-3).
    """
    path = build_checkpoint(tmp_path / "c", model_type=model_type, seed=5)
    model = tlaloc_jax.load_hf(path, dtype="bfloat16")
    assert all(str(w.dtype) == "bfloat16" for w in model.weights.values())
    got = model.first_logits(PROMPTS)
    bf16_ref = load_hf_torch(path, dtype=torch.bfloat16)
    f32_on_bf16 = load_hf_torch(path, dtype=torch.bfloat16).float()
    f32_ref = load_hf_torch(path)
    for prompt, g in zip(PROMPTS, got):
        with torch.no_grad():
            want_bf16 = bf16_ref(torch.tensor([prompt])).logits[0, -1].float().numpy()
            want_f32w = f32_on_bf16(torch.tensor([prompt])).logits[0, -1].float().numpy()
            want_f32 = f32_ref(torch.tensor([prompt])).logits[0, -1].float().numpy()
        scale = np.abs(want_bf16).max()
        err_bf16 = np.abs(g - want_bf16).max() / scale
        err_f32w = np.abs(g - want_f32w).max() / scale
        assert err_bf16 <= 2e-2, f"bf16: {err_bf16:.3g} of the largest logit"
        assert err_f32w <= 1e-2, f"f32 on bf16 weights: {err_f32w:.3g} of the largest logit"
        # Control: the bf16 path is really bf16 (an f32 model would sit far closer to the f32 reference).
        assert np.abs(g - want_f32).max() / scale > 1e-4


def test_control_a_model_that_ignores_the_window_differs(tmp_path):
    """The window checks bite: the same mistral weights read with full attention give other logits."""
    path = build_checkpoint(tmp_path / "m", model_type="mistral", seed=31)
    ref = load_hf_torch(path)
    model = tlaloc_jax.load_hf(path)
    full = tlaloc_jax.Model(model.config.replace(layer_types=("full_attention",) * model.config.num_layers),
                            model.weights)
    prompt = PROMPTS[3]
    _, want = torch_greedy(ref, prompt, 1)
    scale = float(want.abs().max())
    assert np.abs(model.first_logits([prompt])[0] - want.numpy()).max() <= 1e-4 * scale
    assert np.abs(full.first_logits([prompt])[0] - want.numpy()).max() > 1e-2 * scale
