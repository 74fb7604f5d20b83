"""Tiny PEFT LoRA adapters written in PEFT's file layout (adapter_config.json + adapter_model.safetensors, tensors
base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_A.weight [r, in] and lora_B.weight [out, r]), and the
checkpoint with an adapter merged into its weights (W + scale B A, f32): the oracle's model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tlaloc_jax import artifact as af

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
PARTS = {**dict.fromkeys(ATTENTION, "self_attn"), **dict.fromkeys(MLP, "mlp"), **dict.fromkeys(LINEAR, "linear_attn")}


def _text(cfg: dict) -> dict:
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def _dims(cfg: dict) -> dict[str, tuple[int, int]]:
    E, F = cfg["hidden_size"], cfg["intermediate_size"]
    H, K, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    gated = cfg.get("layer_types") is not None and "linear_attention" in cfg["layer_types"]
    dims = {"q_proj": (E, H * D * (2 if gated else 1)), "k_proj": (E, K * D), "v_proj": (E, K * D),
            "o_proj": (H * D, E), "gate_proj": (E, F), "up_proj": (E, F), "down_proj": (F, E)}
    if gated:       # Qwen3.5: a gated q_proj (query then gate per head) and Gated DeltaNet's projections
        Kh, Dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
        Hv, Dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
        dims.update(in_proj_qkv=(E, 2 * Kh * Dk + Hv * Dv), in_proj_z=(E, Hv * Dv), in_proj_b=(E, Hv),
                    in_proj_a=(E, Hv), out_proj=(Hv * Dv, E))
    return dims


def _has(cfg: dict, layer: int, module: str) -> bool:
    """Whether the checkpoint's layer has the module (a hybrid's attention and linear-attention layers differ)."""
    kind = (cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"])[layer]
    return PARTS[module] == "mlp" or (PARTS[module] == "linear_attn") == (kind == "linear_attention")


def write_peft(out: Path, checkpoint: Path, *, seed: int, rank: int, alpha: float,
               targets=ATTENTION + MLP, use_rslora: bool = False, std: float = 0.15, **config) -> Path:
    """A random adapter (A and B both nonzero) for each of the checkpoint's layers that has the targets; `config`
    overrides config keys."""
    from safetensors.numpy import save_file
    raw = json.loads((checkpoint / "config.json").read_text())
    cfg = _text(raw)
    rng = np.random.default_rng(seed)
    dims = _dims(cfg)
    tensors = {}
    model = "model.language_model" if cfg is not raw else "model"
    for i in range(cfg["num_hidden_layers"]):
        for m in targets:
            if not _has(cfg, i, m):
                continue
            fan_in, fan_out = dims[m]
            prefix = f"base_model.model.{model}.layers.{i}.{PARTS[m]}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, std, (rank, fan_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, std, (fan_out, rank)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    body = {**dict(peft_type="LORA", r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                   use_dora=False, fan_in_fan_out=False, bias="none", base_model_name_or_path=str(checkpoint),
                   task_type="CAUSAL_LM"), **config}
    (out / "adapter_config.json").write_text(json.dumps(body))
    return out


def merged_model(checkpoint: Path, adapter: Path, dtype: str = "float32"):
    """The transformers model of the checkpoint with the adapter merged in f32: W += scale * B @ A, A and B first
    rounded to `dtype` (the artifact's adapter slots': what they hold of the adapter)."""
    import torch
    from safetensors.numpy import load_file

    from hf_models import load_hf_torch
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = load_file(adapter / "adapter_model.safetensors")
    model = load_hf_torch(checkpoint)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            a, b = (t.astype(af.numpy_dtype(dtype)) for t in (a, tensors[key.replace(".lora_A.", ".lora_B.")]))
            name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            params[name].add_(torch.from_numpy(scale * (b.astype(np.float64) @ a.astype(np.float64))).float())
    return model
