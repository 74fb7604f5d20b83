"""Tiny checkpoints with an MTP head: transformers neither builds nor saves one, so the head's tensors (DeepSeek-V3's
`model.layers.<N>.*`, N = num_hidden_layers; Qwen3-Next's `mtp.*`) are added, seeded and random, to a saved
checkpoint. And each head's torch reference straight from those tensors: transformers' own decoder layer class loaded
with the layer's, the head's norms, projection and head written out beside it as vLLM defines them."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

from hf_models import load_hf_torch
from tlaloc_jax.config import SPARSE
from tlaloc_jax.kernels import tolerances as tol

# The head's own tensors beside its decoder layer (the embedding stays the decoder's, as vLLM shares it).
HEAD = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight")
# Qwen3-Next's, under mtp. (its embedding and lm_head are the decoder's).
QWEN3_NEXT_HEAD = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "fc.weight", "norm.weight")


def _copied(checkpoint: Path, out_dir: Path) -> tuple[dict, dict]:
    """The checkpoint's files but its weights copied to out_dir; -> (its config, its tensors)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out_dir / f.name)
    return json.loads((checkpoint / "config.json").read_text()), load_file(checkpoint / "model.safetensors")


def _saved(out_dir: Path, config: dict, tensors: dict) -> Path:
    """out_dir with `tensors` as its weights and one MTP layer in its config."""
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))
    return out_dir


def add_mtp_head(checkpoint: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """Copy `checkpoint` to out_dir with an MTP layer: the last decoder layer's tensors' shapes, drawn anew (norms
    near 1, the router's correction bias spread, the rest N(0, 0.08)), and the head's; num_nextn_predict_layers 1."""
    config, tensors = _copied(checkpoint, out_dir)
    n = config["num_hidden_layers"]
    E, V = config["hidden_size"], config["vocab_size"]
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
    return _saved(out_dir, config, tensors)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _loaded(layer, stored: dict, head: tuple[str, ...], experts: int):
    """A transformers decoder layer loaded with the head's layer tensors (`stored`, less the head's own): the checkpoint
    stores each expert's projections, the module holds them fused, gate | up."""
    state = {k: v for k, v in stored.items() if k not in head and not k.startswith("mlp.experts.")}
    if experts:
        part = lambda e, name: stored[f"mlp.experts.{e}.{name}_proj.weight"]      # noqa: E731
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([part(e, "gate"), part(e, "up")])
                                                         for e in range(experts)])
        state["mlp.experts.down_proj"] = torch.stack([part(e, "down") for e in range(experts)])
    layer.load_state_dict(state)
    return layer.eval()


def _causal_layer(layer, model, x, positions):
    """The layer over x [B, T, E] at positions, causally masked, as transformers' model calls it."""
    Bt, Tt = positions.shape
    causal = torch.full((Tt, Tt), torch.finfo(torch.float32).min).triu(1)[None, None].expand(Bt, 1, Tt, Tt)
    out = layer(x, attention_mask=causal, position_ids=positions,
                position_embeddings=model.model.rotary_emb(x, positions))
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def torch_hidden(checkpoint, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' decoder over tokens [B, T] -> its hidden states [B, T, E] before and after its final norm (what
    vLLM's target model returns, and an MTP head reads)."""
    model = load_hf_torch(checkpoint)
    before = []
    hook = model.model.norm.register_forward_hook(lambda module, args, out: before.append(args[0]))
    try:
        after = model.model(torch.from_numpy(tokens).long()).last_hidden_state
    finally:
        hook.remove()
    return before[0].numpy(), after.numpy()


@torch.no_grad()
def torch_mtp(checkpoint, tokens: np.ndarray, hidden: np.ndarray, chained: np.ndarray | None = None, *,
              chain_normed: bool = True) -> np.ndarray:
    """DeepSeek-V3's head's logits [B, T + k, V] in torch, all from the checkpoint: position t < T reads hidden[t] and
    tokens[t]; position T + j reads chained[:, j] [B, k] and the head's own state at the position before it, which
    vLLM chains after shared_head.norm (chain_normed; False: the layer's output before it)."""
    model = load_hf_torch(checkpoint)
    config = model.config
    at = f"model.layers.{config.num_hidden_layers}."
    stored = {k[len(at):]: torch.from_numpy(v) for k, v in load_file(checkpoint / "model.safetensors").items()
              if k.startswith(at)}
    layer = _loaded(DeepseekV3DecoderLayer(config, config.num_hidden_layers), stored, HEAD, config.n_routed_experts)
    eps = config.rms_norm_eps
    norm = lambda h: _rms(h, stored["shared_head.norm.weight"], eps)      # noqa: E731

    def head(ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])[None].expand(*ids.shape)
        e = torch.where(positions[..., None] == 0, 0.0, model.model.embed_tokens(ids))
        x = torch.cat([_rms(e, stored["enorm.weight"], eps), _rms(h, stored["hnorm.weight"], eps)],
                      dim=-1) @ stored["eh_proj.weight"].T
        return _causal_layer(layer, model, x, positions)

    ids, h = torch.from_numpy(tokens).long(), torch.from_numpy(hidden)
    out = head(ids, h)
    for j in range(0 if chained is None else chained.shape[1]):
        state = norm(out[:, -1:]) if chain_normed else out[:, -1:]
        ids, h = torch.cat([ids, torch.from_numpy(chained[:, j:j + 1]).long()], dim=1), torch.cat([h, state], dim=1)
        out = head(ids, h)
    return (norm(out) @ stored["shared_head.head.weight"].T).numpy()


def add_qwen3_next_mtp(checkpoint: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """Copy a Qwen3-Next `checkpoint` to out_dir with its MTP head, `mtp.*`: mtp.layers.0 of the last full-attention
    layer's tensors' shapes and the head's fc and norms, drawn anew (the zero-centred norms' weights N(0, 0.1), so
    1 + w near 1; the rest N(0, 0.08)); num_nextn_predict_layers 1."""
    config, tensors = _copied(checkpoint, out_dir)
    E = config["hidden_size"]
    full = max(i for i, t in enumerate(config["layer_types"]) if t == "full_attention")
    rng = np.random.default_rng(seed)

    def draw(name: str, shape) -> np.ndarray:
        return rng.normal(0.0, 0.1 if "norm" in name else 0.08, shape).astype(np.float32)

    src = f"model.layers.{full}."
    for name, t in list(tensors.items()):
        if name.startswith(src):
            new = "mtp.layers.0." + name[len(src):]
            tensors[new] = draw(new, t.shape)
    shapes = {"fc.weight": (E, 2 * E)}
    for name in QWEN3_NEXT_HEAD:
        tensors[f"mtp.{name}"] = draw(name, shapes.get(name, (E,)))
    return _saved(out_dir, config, tensors)


def _rms1(x, w, eps):
    """Qwen3-Next's zero-centred RMSNorm (vLLM's GemmaRMSNorm): the weight plus one."""
    return _rms(x, 1.0 + w, eps)


@torch.no_grad()
def torch_qwen3_next_mtp(checkpoint, tokens: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """Qwen3-Next's head's logits [B, T, V] in torch, as vLLM's Qwen3NextMultiTokenPredictor computes them: position
    t reads hidden[t] and tokens[t]; fc(concat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden))), the
    full-attention layer (transformers' Qwen3NextDecoderLayer), mtp.norm, the decoder's lm_head."""
    model = load_hf_torch(checkpoint)
    config = model.config
    stored = {k[len("mtp."):]: torch.from_numpy(v) for k, v in load_file(checkpoint / "model.safetensors").items()
              if k.startswith("mtp.")}
    full = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    layer = _loaded(Qwen3NextDecoderLayer(config, full),
                    {k[len("layers.0."):]: v for k, v in stored.items() if k.startswith("layers.0.")}, (),
                    config.num_experts)
    eps, (Bt, Tt) = config.rms_norm_eps, tokens.shape
    positions = torch.arange(Tt)[None].expand(Bt, Tt)
    e = model.model.embed_tokens(torch.from_numpy(tokens).long())
    x = torch.cat([_rms1(e, stored["pre_fc_norm_embedding.weight"], eps),
                   _rms1(torch.from_numpy(hidden), stored["pre_fc_norm_hidden.weight"], eps)], dim=-1)
    out = _causal_layer(layer, model, x @ stored["fc.weight"].T, positions)
    return model.lm_head(_rms1(out, stored["norm.weight"], eps)).numpy()


def mtp_bound(cfg, context: int, kind: str = SPARSE, *, steps: int = 1) -> float:
    """The head's path: its two input norms and eh_proj (2E terms), then one decoder layer of its MLP kind and the
    shared head, as tolerances.decoder_roundings_of counts a one-layer decoder; steps such paths in a row for a
    position whose hidden state the head chained."""
    one = dataclasses.replace(cfg, num_layers=1, layer_types=cfg.layer_types[-1:], mlp_types=(kind,))
    return tol.bound(steps * (tol.decoder_roundings_of(one, context=context) + tol.rms_norm_roundings(cfg.hidden_size)
                              + 2 * cfg.hidden_size))
