"""A tiny DeepSeek-V3 checkpoint with an MTP head: transformers neither builds nor saves one, so the head's tensors
(`model.layers.<N>.*`, N = num_hidden_layers) are added, seeded and random, to a saved checkpoint. And the head's
torch reference straight from those tensors: transformers' own DeepseekV3DecoderLayer loaded with the layer's, the
head's norms, eh_proj and shared head written out beside it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from hf_models import load_hf_torch
from tlaloc_jax.config import SPARSE
from tlaloc_jax.kernels import tolerances as tol

# The head's own tensors beside its decoder layer (the embedding stays the decoder's, as vLLM shares it).
HEAD = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight")


def add_mtp_head(checkpoint: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """Copy `checkpoint` to out_dir with an MTP layer: the last decoder layer's tensors' shapes, drawn anew (norms
    near 1, the router's correction bias spread, the rest N(0, 0.08)), and the head's; num_nextn_predict_layers 1."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out_dir / f.name)
    config = json.loads((checkpoint / "config.json").read_text())
    n = config["num_hidden_layers"]
    E, V = config["hidden_size"], config["vocab_size"]
    tensors = load_file(checkpoint / "model.safetensors")
    rng = np.random.default_rng(seed)

    def draw(name: str, shape) -> np.ndarray:
        if "norm" in name:
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return rng.normal(0.0, 0.3 if "correction_bias" in name else 0.08, shape).astype(np.float32)

    last = f"model.layers.{n - 1}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            new = f"model.layers.{n}." + name[len(last):]
            tensors[new] = draw(new, t.shape)
    shapes = {"enorm.weight": (E,), "hnorm.weight": (E,), "eh_proj.weight": (E, 2 * E),
              "shared_head.norm.weight": (E,), "shared_head.head.weight": (V, E)}
    for name in HEAD:
        tensors[f"model.layers.{n}.{name}"] = draw(name, shapes[name])
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))
    return out_dir


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def torch_mtp(checkpoint, tokens: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """The head's logits [B, T, V] in torch: position t reads hidden[t] and tokens[t], all from the checkpoint."""
    model = load_hf_torch(checkpoint)
    config = model.config
    at = f"model.layers.{config.num_hidden_layers}."
    stored = {k[len(at):]: torch.from_numpy(v) for k, v in load_file(checkpoint / "model.safetensors").items()
              if k.startswith(at)}
    layer = DeepseekV3DecoderLayer(config, config.num_hidden_layers).eval()
    state = {k: v for k, v in stored.items() if k not in HEAD and not k.startswith("mlp.experts.")}
    # The checkpoint stores each expert's projections; transformers' module holds them fused, gate | up.
    X = config.n_routed_experts
    part = lambda e, name: stored[f"mlp.experts.{e}.{name}_proj.weight"]      # noqa: E731
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([part(e, "gate"), part(e, "up")]) for e in range(X)])
    state["mlp.experts.down_proj"] = torch.stack([part(e, "down") for e in range(X)])
    layer.load_state_dict(state)
    eps, Bt, Tt = config.rms_norm_eps, *tokens.shape
    positions = torch.arange(Tt)[None].expand(Bt, Tt)
    e = model.model.embed_tokens(torch.from_numpy(tokens).long())
    e = torch.where(positions[..., None] == 0, 0.0, e)
    x = torch.cat([_rms(e, stored["enorm.weight"], eps), _rms(torch.from_numpy(hidden), stored["hnorm.weight"], eps)],
                  dim=-1) @ stored["eh_proj.weight"].T
    causal = torch.full((Tt, Tt), torch.finfo(torch.float32).min).triu(1)[None, None].expand(Bt, 1, Tt, Tt)
    out = layer(x, attention_mask=causal, position_ids=positions,
                position_embeddings=model.model.rotary_emb(x, positions))
    out = out[0] if isinstance(out, tuple) else out
    return (_rms(out, stored["shared_head.norm.weight"], eps) @ stored["shared_head.head.weight"].T).numpy()


def mtp_bound(cfg, context: int) -> float:
    """The head's path: its two input norms and eh_proj (2E terms), then one decoder layer of its MLP kind and the
    shared head, as tolerances.decoder_roundings_of counts a one-layer decoder."""
    one = dataclasses.replace(cfg, num_layers=1, layer_types=cfg.layer_types[-1:], mlp_types=(SPARSE,))
    return tol.bound(tol.decoder_roundings_of(one, context=context) + tol.rms_norm_roundings(cfg.hidden_size)
                     + 2 * cfg.hidden_size)
