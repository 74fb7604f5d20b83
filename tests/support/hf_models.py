"""Tiny random Hugging Face checkpoints, built with transformers from a fixed seed (no downloads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from oracle import OracleRun

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}


# Gated DeltaNet dims: 2 key heads of 16, each read by 2 value heads of 8 (Dk != Dv, GQA-like grouping),
# so a swapped axis or a wrong interleave shows.
LINEAR_DIMS = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=8, linear_conv_kernel_dim=4)

# Mixture-of-experts dims: 8 experts of 32, 2 chosen per token (experts > top-k, so routing matters).
MOE_DIMS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# GPT-OSS's YaRN with the ramp inside the tiny head (original context 64), so the blend is exercised.
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}

# LongRoPE with its original context inside the tests' prompts (64 < 100 + 16), a factor set per half rotated dim.
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.5 * i for i in range(8)]}
# DeepSeek-V3's latent attention with Dv != Dn (a swapped axis shows), 8 experts in 4 groups of which 2 are kept,
# a dense first layer, and YaRN with mscale (the scores' scale gets mscale(factor, mscale_all_dim)^2).
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
DEEPSEEK_DIMS = dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                     num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                     rope_parameters=DEEPSEEK_YARN)

# Small windows so that prompts and generations span several windows.
FAMILY_DEFAULTS = {
    "mistral": dict(sliding_window=8),
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", num_hidden_layers=4),
    "gemma3_text": dict(sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=4,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 100000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # 3 linear : 1 full. Qwen3-Next dense (num_experts 0), one period; Qwen3.5 two periods, so the scan's
    # per-period pool indexing is exercised.
    "qwen3_next": dict(num_hidden_layers=4, num_experts=0, **LINEAR_DIMS),
    "qwen3_5_text": dict(num_hidden_layers=8, **LINEAR_DIMS),
    "qwen3_5": dict(num_hidden_layers=4, **LINEAR_DIMS),
    # Qwen3-Next with its sparse layers: build_checkpoint(..., model_type="qwen3_next", **QWEN3_NEXT_MOE).
    "qwen3_moe": dict(**MOE_DIMS),
    # Mixtral's experts' hidden size is intermediate_size; a window of 8 on every layer.
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8),
    # 4 layers: sliding, full, sliding, full (two periods); the clamp at 0.6 bites on the tiny activations.
    "gpt_oss": dict(num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                    sliding_window=8, swiglu_limit=0.6, rope_parameters=GPT_OSS_YARN, max_position_embeddings=256),
    "phi3": dict(original_max_position_embeddings=64, rope_parameters=PHI3_LONGROPE),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0),
    "deepseek_v3": DEEPSEEK_DIMS,
}
# The families whose configs derive head_dim themselves (DeepSeek-V3's is qk_rope_head_dim).
NO_HEAD_DIM = ("deepseek_v3",)
# Qwen3-Next with a mixture of experts and a shared expert in every layer (norm_topk_prob defaults to true).
QWEN3_NEXT_MOE = dict(MOE_DIMS, shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[])

# A multimodal checkpoint's config: the decoder's keys under text_config, a minimal vision tower beside it.
NESTED = {
    "qwen3_5": dict(vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
                                       num_position_embeddings=16, patch_size=4),
                    image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253),
}

CLASSES = {
    "llama": lambda: (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3": lambda: (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": lambda: (transformers.MistralConfig, transformers.MistralForCausalLM),
    "gemma2": lambda: (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": lambda: (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "qwen3_next": lambda: (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    "qwen3_5_text": lambda: (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    "qwen3_5": lambda: (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
    "qwen3_moe": lambda: (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": lambda: (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "gpt_oss": lambda: (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    "qwen2": lambda: (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "phi3": lambda: (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "olmo2": lambda: (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    "granite": lambda: (transformers.GraniteConfig, transformers.GraniteForCausalLM),
    "deepseek_v3": lambda: (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
}


def build_checkpoint(out_dir: Path, model_type: str = "llama", *, seed: int = 0, tied: bool = False,
                     rope: dict | None = None, legacy_rope_keys: bool = False, max_shard_size: str | None = None,
                     **overrides) -> Path:
    """Write a seeded random checkpoint of `model_type` to out_dir (config.json + safetensors)."""
    kw = {**TINY, **FAMILY_DEFAULTS.get(model_type, {}), "tie_word_embeddings": tied, **overrides}
    if model_type in NO_HEAD_DIM:
        del kw["head_dim"]
    if rope is not None:
        kw["rope_parameters"] = rope
    cls_cfg, cls_model = CLASSES[model_type]()
    if model_type in NESTED:
        kw = dict(NESTED[model_type], text_config=kw, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    config = cls_cfg(**kw)
    model = cls_model(config).eval()
    # Random init leaves norms at 1; perturb every tensor so that a swapped norm or a missing step shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        # DeepSeek's router correction bias is a buffer (zero at init): spread it so that it changes the choice.
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    out_dir.mkdir(parents=True, exist_ok=True)
    if max_shard_size:
        model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(out_dir)
    if legacy_rope_keys:
        _rewrite_rope_legacy(out_dir / "config.json")
    return out_dir


def _rewrite_rope_legacy(path: Path) -> None:
    """Turn transformers 5's `rope_parameters` into the older `rope_theta` + `rope_scaling` keys."""
    import json
    cfg = json.loads(path.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = params
    path.write_text(json.dumps(cfg, indent=2))


def assert_saved_back(path: Path, out_dir: Path) -> None:
    """A checkpoint loaded through its family table and saved back (tlaloc_jax.checkpoint.save_checkpoint) has every
    tensor of the original, bit for bit (split and fused tensors rebuilt from their slots)."""
    import json

    from safetensors.numpy import load_file

    from tlaloc_jax.checkpoint import load_checkpoint, save_checkpoint
    hf_config = json.loads((path / "config.json").read_text())
    out = load_file(save_checkpoint(out_dir, hf_config, load_checkpoint(path)[1]) / "model.safetensors")
    original = load_file(path / "model.safetensors")
    assert out.keys() == original.keys()
    for k, arr in out.items():
        np.testing.assert_array_equal(arr, original[k], err_msg=k)


def assert_random_weights_round_trip(hf_config: dict, out_dir: Path) -> None:
    """Seeded random weights for hf_config's family, saved (save_checkpoint) and loaded back (load_checkpoint): the
    same config and every tensor, bit for bit."""
    from tlaloc_jax.checkpoint import load_checkpoint, random_weights, save_checkpoint
    from tlaloc_jax.families import config_from_hf
    fam, cfg = config_from_hf(hf_config)
    w = random_weights(cfg, fam, seed=3)
    cfg2, w2 = load_checkpoint(save_checkpoint(out_dir, hf_config, w))
    assert cfg2 == cfg and w2.keys() == w.keys()
    for k in w:
        np.testing.assert_array_equal(w2[k], w[k], err_msg=f"{out_dir.name} {k}")


def load_hf_torch(path: Path, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model


@torch.no_grad()
def torch_greedy(model, prompt: list[int], n: int = 16) -> OracleRun:
    """Greedy ids by full recomputation each step (no KV cache), and the logits of every step (f32)."""
    ids = torch.tensor([prompt])
    out, logits = [], []
    for _ in range(n):
        step = model(ids).logits[0, -1].float()
        logits.append(step.numpy())
        nxt = int(torch.argmax(step))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return OracleRun(out, np.stack(logits))

