"""Model families: one table per Hugging Face model type.

A family is data, not code: the HF tensor name behind each weight slot, whether the tensor is a linear
stored [out, in] that the slot holds [in, out], which optional steps of the decoder are on, and how to
read the config keys. The decoder never branches on a family's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .config import ConfigError, DecoderConfig, RopeConfig


@dataclass(frozen=True)
class Tensor:
    """One weight slot of a family.

    slot: the name in Weights and in the artifact. Slots starting with "layers." are stacked over layers.
    hf: the checkpoint name; "{p}" is the family's decoder prefix, "{i}" the layer index.
    transpose: the checkpoint stores a linear [out, in]; the slot holds [in, out].
    when: a DecoderConfig flag the slot needs ("qk_norm"), or "untied_head".
    """

    slot: str
    hf: str
    transpose: bool = False
    when: str | None = None


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    prefix: str
    tensors: tuple[Tensor, ...]
    qk_norm: bool
    parse: Callable[["Family", dict[str, Any]], DecoderConfig]

    def slots(self, cfg: DecoderConfig) -> tuple[Tensor, ...]:
        """The tensors this configuration has (optional steps filtered by their flags)."""
        return tuple(t for t in self.tensors if _wanted(t.when, cfg))


def _wanted(when: str | None, cfg: DecoderConfig) -> bool:
    if when is None:
        return True
    if when == "untied_head":
        return not cfg.tie_word_embeddings
    return bool(getattr(cfg, when))


# The HF config keys that name a multimodal checkpoint's placeholder ids; the text decoder cannot
# embed them, so a server refuses them by name.
PLACEHOLDER_KEYS = ("image_token_id", "video_token_id", "image_token_index", "video_token_index", "audio_token_id")


def read_rope(hf: dict[str, Any]) -> RopeConfig:
    """RoPE settings from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older files)."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        if "rope_theta" in hf:
            params.setdefault("rope_theta", hf["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"rope type {rope_type!r} (config key rope_parameters/rope_scaling) is not supported; "
                          "supported: 'default', 'llama3'")
    kw: dict[str, Any] = dict(theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_type=rope_type)
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ConfigError(f"llama3 rope scaling needs {key!r} in rope_parameters/rope_scaling")
        kw.update(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                  high_freq_factor=float(params["high_freq_factor"]),
                  original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    prf = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return RopeConfig(partial_rotary_factor=float(prf), **kw)


def _eos(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _refuse_flag(hf: dict[str, Any], key: str, family: str) -> None:
    if hf.get(key):
        raise ConfigError(f"{family} config key {key}={hf[key]!r} is not supported")


def parse_dense(family: Family, hf: dict[str, Any]) -> DecoderConfig:
    """Llama-style dense decoders (llama, qwen3): SwiGLU MLP, RMSNorm, RoPE, GQA."""
    for key in ("attention_bias", "mlp_bias"):
        _refuse_flag(hf, key, family.name)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{family.name} config key hidden_act={act!r} is not supported (expected 'silu')")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{family.name} config key use_sliding_window=true is not supported yet")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    return DecoderConfig(
        model_type=hf["model_type"],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=read_rope(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=family.qk_norm,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        name=str(hf.get("_name_or_path", "") or ""),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos(hf),
        refused_tokens=tuple((int(hf[k]), k) for k in PLACEHOLDER_KEYS if hf.get(k) is not None),
    )


_DENSE_LAYER = (
    Tensor("layers.attn_norm", "{p}layers.{i}.input_layernorm.weight"),
    Tensor("layers.q_proj", "{p}layers.{i}.self_attn.q_proj.weight", transpose=True),
    Tensor("layers.k_proj", "{p}layers.{i}.self_attn.k_proj.weight", transpose=True),
    Tensor("layers.v_proj", "{p}layers.{i}.self_attn.v_proj.weight", transpose=True),
    Tensor("layers.q_norm", "{p}layers.{i}.self_attn.q_norm.weight", when="qk_norm"),
    Tensor("layers.k_norm", "{p}layers.{i}.self_attn.k_norm.weight", when="qk_norm"),
    Tensor("layers.o_proj", "{p}layers.{i}.self_attn.o_proj.weight", transpose=True),
    Tensor("layers.mlp_norm", "{p}layers.{i}.post_attention_layernorm.weight"),
    Tensor("layers.gate_proj", "{p}layers.{i}.mlp.gate_proj.weight", transpose=True),
    Tensor("layers.up_proj", "{p}layers.{i}.mlp.up_proj.weight", transpose=True),
    Tensor("layers.down_proj", "{p}layers.{i}.mlp.down_proj.weight", transpose=True),
)

_DENSE_TOP = (
    Tensor("embed", "{p}embed_tokens.weight"),
    Tensor("final_norm", "{p}norm.weight"),
    # A tied head has no slot: the logits contract the hidden axis of the embedding table itself.
    Tensor("head", "lm_head.weight", transpose=True, when="untied_head"),
)

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "model.", _DENSE_TOP + _DENSE_LAYER, qk_norm=False, parse=parse_dense),
    Family("qwen3", ("qwen3",), "model.", _DENSE_TOP + _DENSE_LAYER, qk_norm=True, parse=parse_dense),
)


def family_for(model_type: str | None) -> Family:
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    known = sorted(t for fam in FAMILIES for t in fam.model_types)
    raise ConfigError(f"unknown model_type {model_type!r} in config.json (known: {', '.join(known)})")


def config_from_hf(hf: dict[str, Any]) -> tuple[Family, DecoderConfig]:
    fam = family_for(hf.get("model_type"))
    try:
        return fam, fam.parse(fam, hf)
    except KeyError as e:
        raise ConfigError(f"{fam.name} config.json is missing the key {e.args[0]!r}") from None
