"""Model families: one table per Hugging Face model type.

A family is data, not code: the HF tensor name and the shape behind each weight slot, whether the tensor
is a linear stored [out, in] that the slot holds [in, out], which optional steps of the decoder are on, and
how to read the config keys. The decoder never branches on a family's name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .config import FULL, LINEAR, SLIDING, ConfigError, DecoderConfig, RopeConfig
from .plan import layer_plan


@dataclass(frozen=True)
class Split:
    """A checkpoint tensor that holds several slots interleaved per group along its first (output) axis.

    The first axis is viewed as [groups, sum(parts)]: each group (an attention head, or a key head with its
    value heads) holds its parts one after another. A slot is the parts `take` of every group, part by part
    and each part group by group, so that heads stay in order: Qwen3-Next's in_proj_qkvz holds, per key head,
    q, k, then v and z of that key head's value heads; q_proj with an output gate holds, per head, query then
    gate. `groups` and each part size name a DecoderConfig attribute, or a product "a*b" of two.
    """

    groups: str
    parts: tuple[str, ...]
    take: tuple[int, ...]


def _size(name: str, cfg: DecoderConfig) -> int:
    return math.prod(int(getattr(cfg, n)) for n in name.split("*"))


def split_rows(split: Split, cfg: DecoderConfig) -> tuple[np.ndarray, int]:
    """(the indices along the checkpoint tensor's first axis that make up the slot, in slot order; that
    axis' full length)."""
    groups = _size(split.groups, cfg)
    sizes = [_size(p, cfg) for p in split.parts]
    width, offsets = sum(sizes), np.cumsum([0] + sizes)
    rows = [g * width + offsets[p] + np.arange(sizes[p]) for p in split.take for g in range(groups)]
    return np.concatenate(rows), groups * width


@dataclass(frozen=True)
class Tensor:
    """One weight slot of a family.

    slot: the name in Weights and in the artifact. Slots starting with "layers." are stacked over layers.
    hf: the checkpoint name; "{p}" is the family's decoder prefix, "{i}" the layer index.
    shape: the slot's shape in one layer, linears [in, out]; each size names a DecoderConfig attribute, or a
        product "a*b" of two (as in Split).
    transpose: the checkpoint stores a linear [out, in]; the slot holds [in, out].
    when: a DecoderConfig flag the slot needs ("qk_norm"), or "untied_head".
    split: the checkpoint tensor holds this slot and others, interleaved along its first axis (Split).
    squeeze: an axis of size 1 that the checkpoint has and the slot drops (a depthwise conv's [C, 1, W]).
    """

    slot: str
    hf: str
    shape: tuple[str, ...]
    transpose: bool = False
    when: str | None = None
    split: Split | None = None
    squeeze: int | None = None

    def __post_init__(self):
        if self.split is not None and self.squeeze is not None:
            raise ValueError(f"slot {self.slot!r}: a split tensor cannot also be squeezed")

    def layer_shape(self, cfg: DecoderConfig) -> tuple[int, ...]:
        """The slot's shape in one layer (the whole slot's, unstacked)."""
        return tuple(_size(size, cfg) for size in self.shape)

    def slot_shape(self, cfg: DecoderConfig) -> tuple[int, ...]:
        """The whole slot's shape: a stacked slot [L', ...] over the layers it holds."""
        layers = stack_layers(self.slot, cfg)
        return (len(layers), *self.layer_shape(cfg)) if layers else self.layer_shape(cfg)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    prefix: str
    tensors: tuple[Tensor, ...]
    qk_norm: bool
    parse: Callable[["Family", dict[str, Any]], DecoderConfig]
    sliding: bool = False          # reads `sliding_window` for every layer (Mistral)
    tied_default: bool = False     # tie_word_embeddings when the config does not say
    text_config: bool = False      # a multimodal checkpoint: the decoder's keys sit under `text_config`

    def slots(self, cfg: DecoderConfig) -> tuple[Tensor, ...]:
        """The tensors this configuration has (optional steps filtered by their flags)."""
        return tuple(t for t in self.tensors if _wanted(t.when, cfg))


def _wanted(when: str | None, cfg: DecoderConfig) -> bool:
    if when is None:
        return True
    if when == "untied_head":
        return not cfg.tie_word_embeddings
    return bool(getattr(cfg, when))


def stack_layers(slot: str, cfg: DecoderConfig) -> tuple[int, ...]:
    """The layers a stacked slot ("group.name") holds, in the decoder's stack order (() for a whole tensor)."""
    if "." not in slot:
        return ()
    # Where the keys and values live (windowed or not) does not move any weight.
    return layer_plan(cfg, windowed=False).group_layers(slot.split(".", 1)[0])


# The HF config keys that name a multimodal checkpoint's placeholder ids; the text decoder cannot
# embed them, so a server refuses them by name.
PLACEHOLDER_KEYS = ("image_token_id", "video_token_id", "image_token_index", "video_token_index", "audio_token_id")


def read_rope(hf: dict[str, Any], params: dict[str, Any] | None = None) -> RopeConfig:
    """RoPE settings from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older files).

    `params` overrides where the parameters are read from (a Gemma 3 layer type's own entry).
    """
    if params is None:
        params = dict(hf.get("rope_parameters") or {})
        if not params:
            params = dict(hf.get("rope_scaling") or {})
            if "rope_theta" in hf:
                params.setdefault("rope_theta", hf["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ConfigError(f"rope type {rope_type!r} (config key rope_parameters/rope_scaling) is not supported; "
                          "supported: 'default', 'linear', 'llama3'")
    kw: dict[str, Any] = dict(theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_type=rope_type)
    needed = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "linear": ("factor",)}.get(rope_type, ())
    for key in needed:
        if key not in params:
            raise ConfigError(f"{rope_type} rope scaling needs {key!r} in rope_parameters/rope_scaling")
        kw[key] = (int if key == "original_max_position_embeddings" else float)(params[key])
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


def _common(family: "Family", hf: dict[str, Any]) -> dict[str, Any]:
    """The keys every decoder family shares."""
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    return dict(
        model_type=hf["model_type"],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.tied_default)),
        qk_norm=family.qk_norm,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        name=str(hf.get("_name_or_path", "") or ""),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos(hf),
        refused_tokens=tuple((int(hf[k]), k) for k in PLACEHOLDER_KEYS if hf.get(k) is not None),
    )


def _activation(hf: dict[str, Any], family: str, key: str) -> str:
    act = hf.get(key, "silu")
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in names:
        raise ConfigError(f"{family} config key {key}={act!r} is not supported (supported: {', '.join(names)})")
    return names[act]


def parse_dense(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """Llama-style dense decoders (llama, qwen3, mistral): SwiGLU MLP, RMSNorm, RoPE, GQA."""
    for key in ("attention_bias", "mlp_bias"):
        _refuse_flag(hf, key, family.name)
    kw = _common(family, hf)
    window = hf.get("sliding_window") if family.sliding else None
    if family.name == "qwen3" and hf.get("use_sliding_window"):
        raise ConfigError("qwen3 config key use_sliding_window=true is not supported")
    if window:
        kw.update(layer_types=(SLIDING,) * kw["num_layers"], sliding_window=int(window))
    return DecoderConfig(rope=read_rope(hf), hidden_act=_activation(hf, family.name, "hidden_act"), **kw)


def parse_gemma(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """Gemma 2 and Gemma 3 text decoders: (1 + w) norms around attention and MLP, GELU-tanh, scaled
    embeddings, query_pre_attn_scalar, soft-caps, sliding and full layers from `layer_types`."""
    _refuse_flag(hf, "attention_bias", family.name)
    _refuse_flag(hf, "use_bidirectional_attention", family.name)
    kw = _common(family, hf)
    types = hf.get("layer_types")
    if types is None:   # older files: Gemma 2 alternates from a sliding first layer; Gemma 3 every 6th is full
        period = int(hf.get("sliding_window_pattern", 2 if family.name == "gemma2" else 6))
        types = [SLIDING if (i + 1) % period else FULL for i in range(kw["num_layers"])]
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:       # transformers 5: one RoPE per layer type
        rope, rope_sliding = read_rope(hf, dict(params.get(FULL) or {})), read_rope(hf, dict(params.get(SLIDING) or {}))
    else:
        rope = read_rope(hf)
        local = hf.get("rope_local_base_freq")
        rope_sliding = RopeConfig(theta=float(local)) if local is not None else None
    return DecoderConfig(
        rope=rope, rope_sliding=rope_sliding, layer_types=tuple(types),
        sliding_window=int(hf.get("sliding_window") or 0),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0),
        attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        norm_offset=1.0, hidden_act=_activation(hf, family.name, "hidden_activation"), embed_scale=True,
        sandwich_norms=True, **kw)


def _sparse_layers(hf: dict[str, Any], layers: int) -> list[int]:
    """The layers whose MLP is a sparse mixture of experts (Qwen3-Next's rule; none without `num_experts`)."""
    if int(hf.get("num_experts") or 0) <= 0:
        return []
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def parse_hybrid(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """Qwen3-Next and Qwen3.5 text decoders: Gated DeltaNet (LINEAR) layers between gated full-attention
    layers (`layer_types`, or every `full_attention_interval`-th layer full), (1 + w) norms, q/k norms,
    partial rotary (0.25 of the head unless the config says), dense SwiGLU MLPs only."""
    _refuse_flag(hf, "attention_bias", family.name)
    kw = _common(family, hf)
    layers = kw["num_layers"]
    sparse = _sparse_layers(hf, layers)
    if sparse:
        raise ConfigError(
            f"{family.name} layers {sparse} have sparse mixture-of-experts MLPs (config keys num_experts="
            f"{hf.get('num_experts')}, decoder_sparse_step={hf.get('decoder_sparse_step', 1)}, mlp_only_layers="
            f"{hf.get('mlp_only_layers') or []}); only dense MLPs are supported")
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    act = _activation(hf, family.name, "hidden_act")
    if act != "silu":
        raise ConfigError(f"{family.name} config key hidden_act={hf['hidden_act']!r} is not supported "
                          "(the causal conv and the gated norm take silu)")
    rope = read_rope(hf)
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in hf:
        # transformers' default for these families: a quarter of the head rotates.
        rope = dataclasses.replace(rope, partial_rotary_factor=0.25)
    return DecoderConfig(
        rope=rope, layer_types=tuple(types), norm_offset=1.0, hidden_act=act, attn_output_gate=True,
        linear_key_heads=int(hf["linear_num_key_heads"]), linear_key_dim=int(hf["linear_key_head_dim"]),
        linear_value_heads=int(hf["linear_num_value_heads"]), linear_value_dim=int(hf["linear_value_head_dim"]),
        linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)), **kw)


# Slot names: "embed", "final_norm", "head" are whole tensors; "layers.*" are stacked over every layer,
# "attn.*" over the attention layers (full and sliding), "linear.*" over the linear-attention layers, in
# layer order.
# Slot sizes (docs/glossary.md), as the DecoderConfig attributes that hold them.
E, F, V, D = "hidden_size", "intermediate_size", "vocab_size", "head_dim"
HD, KD = "num_heads*head_dim", "num_kv_heads*head_dim"
# A linear layer's: C conv channels (q | k | v), W conv taps, Hv value heads of Dv.
C, W, Hv, Dv, HvDv = ("conv_channels", "linear_conv_kernel", "linear_value_heads", "linear_value_dim",
                      "linear_value_heads*linear_value_dim")
_ATTN = (
    Tensor("attn.q_proj", "{p}layers.{i}.self_attn.q_proj.weight", (E, HD), transpose=True),
    Tensor("attn.k_proj", "{p}layers.{i}.self_attn.k_proj.weight", (E, KD), transpose=True),
    Tensor("attn.v_proj", "{p}layers.{i}.self_attn.v_proj.weight", (E, KD), transpose=True),
    Tensor("attn.q_norm", "{p}layers.{i}.self_attn.q_norm.weight", (D,), when="qk_norm"),
    Tensor("attn.k_norm", "{p}layers.{i}.self_attn.k_norm.weight", (D,), when="qk_norm"),
    Tensor("attn.o_proj", "{p}layers.{i}.self_attn.o_proj.weight", (HD, E), transpose=True),
)
_MLP = (
    Tensor("layers.gate_proj", "{p}layers.{i}.mlp.gate_proj.weight", (E, F), transpose=True),
    Tensor("layers.up_proj", "{p}layers.{i}.mlp.up_proj.weight", (E, F), transpose=True),
    Tensor("layers.down_proj", "{p}layers.{i}.mlp.down_proj.weight", (F, E), transpose=True),
)
_DENSE_LAYER = (
    Tensor("layers.attn_norm", "{p}layers.{i}.input_layernorm.weight", (E,)),
    *_ATTN,
    Tensor("layers.mlp_norm", "{p}layers.{i}.post_attention_layernorm.weight", (E,)),
    *_MLP,
)
# Gemma's post_attention_layernorm follows the attention; its pre_feedforward_layernorm is the MLP's input norm.
_GEMMA_LAYER = (
    Tensor("layers.attn_norm", "{p}layers.{i}.input_layernorm.weight", (E,)),
    *_ATTN,
    Tensor("layers.post_attn_norm", "{p}layers.{i}.post_attention_layernorm.weight", (E,)),
    Tensor("layers.mlp_norm", "{p}layers.{i}.pre_feedforward_layernorm.weight", (E,)),
    *_MLP,
    Tensor("layers.post_mlp_norm", "{p}layers.{i}.post_feedforward_layernorm.weight", (E,)),
)
# Qwen3-Next / Qwen3.5: q_proj holds, per head, the query and then the output gate.
_GATED_Q = "{p}layers.{i}.self_attn.q_proj.weight"
_GATED_ATTN = (
    Tensor("attn.q_proj", _GATED_Q, (E, HD), transpose=True,
           split=Split("num_heads", ("head_dim", "head_dim"), (0,))),
    Tensor("attn.gate_proj", _GATED_Q, (E, HD), transpose=True,
           split=Split("num_heads", ("head_dim", "head_dim"), (1,)), when="attn_output_gate"),
    *_ATTN[1:],
)
# Gated DeltaNet. The conv runs over the channels q | k | v (in_qkv's outputs); z gates the output norm.
_DELTANET_TAIL = (
    Tensor("linear.conv", "{p}layers.{i}.linear_attn.conv1d.weight", (C, W), squeeze=1),
    Tensor("linear.dt_bias", "{p}layers.{i}.linear_attn.dt_bias", (Hv,)),
    Tensor("linear.a_log", "{p}layers.{i}.linear_attn.A_log", (Hv,)),
    Tensor("linear.norm", "{p}layers.{i}.linear_attn.norm.weight", (Dv,)),
    Tensor("linear.out_proj", "{p}layers.{i}.linear_attn.out_proj.weight", (HvDv, E), transpose=True),
)
_DELTANET = (       # Qwen3.5: one projection per input
    Tensor("linear.in_qkv", "{p}layers.{i}.linear_attn.in_proj_qkv.weight", (E, C), transpose=True),
    Tensor("linear.in_z", "{p}layers.{i}.linear_attn.in_proj_z.weight", (E, HvDv), transpose=True),
    Tensor("linear.in_b", "{p}layers.{i}.linear_attn.in_proj_b.weight", (E, Hv), transpose=True),
    Tensor("linear.in_a", "{p}layers.{i}.linear_attn.in_proj_a.weight", (E, Hv), transpose=True),
    *_DELTANET_TAIL,
)
# Qwen3-Next: in_proj_qkvz holds, per key head, q [Dk], k [Dk], then v and z of its value heads [group * Dv]
# each; in_proj_ba, per key head, b then a of its value heads [group] each.
_QKVZ = ("linear_key_dim", "linear_key_dim", "linear_group*linear_value_dim", "linear_group*linear_value_dim")
_BA = ("linear_group", "linear_group")
_QKVZ_HF, _BA_HF = "{p}layers.{i}.linear_attn.in_proj_qkvz.weight", "{p}layers.{i}.linear_attn.in_proj_ba.weight"
_DELTANET_INTERLEAVED = (
    Tensor("linear.in_qkv", _QKVZ_HF, (E, C), transpose=True, split=Split("linear_key_heads", _QKVZ, (0, 1, 2))),
    Tensor("linear.in_z", _QKVZ_HF, (E, HvDv), transpose=True, split=Split("linear_key_heads", _QKVZ, (3,))),
    Tensor("linear.in_b", _BA_HF, (E, Hv), transpose=True, split=Split("linear_key_heads", _BA, (0,))),
    Tensor("linear.in_a", _BA_HF, (E, Hv), transpose=True, split=Split("linear_key_heads", _BA, (1,))),
    *_DELTANET_TAIL,
)
_NORMS_MLP = (
    Tensor("layers.mlp_norm", "{p}layers.{i}.post_attention_layernorm.weight", (E,)),
    *_MLP,
)
_QWEN3_5_LAYER = (Tensor("layers.attn_norm", "{p}layers.{i}.input_layernorm.weight", (E,)), *_GATED_ATTN,
                  *_DELTANET, *_NORMS_MLP)
_QWEN3_NEXT_LAYER = (Tensor("layers.attn_norm", "{p}layers.{i}.input_layernorm.weight", (E,)), *_GATED_ATTN,
                     *_DELTANET_INTERLEAVED, *_NORMS_MLP)
_TOP = (
    Tensor("embed", "{p}embed_tokens.weight", (V, E)),
    Tensor("final_norm", "{p}norm.weight", (E,)),
    # A tied head has no slot: the logits contract the hidden axis of the embedding table itself.
    Tensor("head", "lm_head.weight", (E, V), transpose=True, when="untied_head"),
)

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "model.", _TOP + _DENSE_LAYER, qk_norm=False, parse=parse_dense),
    Family("qwen3", ("qwen3",), "model.", _TOP + _DENSE_LAYER, qk_norm=True, parse=parse_dense),
    Family("mistral", ("mistral",), "model.", _TOP + _DENSE_LAYER, qk_norm=False, parse=parse_dense, sliding=True),
    Family("gemma2", ("gemma2",), "model.", _TOP + _GEMMA_LAYER, qk_norm=False, parse=parse_gemma,
           tied_default=True),
    Family("gemma3_text", ("gemma3_text",), "model.", _TOP + _GEMMA_LAYER, qk_norm=True, parse=parse_gemma,
           tied_default=True),
    Family("qwen3_next", ("qwen3_next",), "model.", _TOP + _QWEN3_NEXT_LAYER, qk_norm=True, parse=parse_hybrid),
    Family("qwen3_5_text", ("qwen3_5_text",), "model.", _TOP + _QWEN3_5_LAYER, qk_norm=True, parse=parse_hybrid),
    # The text decoder of a Qwen3.5 checkpoint (vision tower and MTP head not read).
    Family("qwen3_5", ("qwen3_5",), "model.language_model.", _TOP + _QWEN3_5_LAYER, qk_norm=True,
           parse=parse_hybrid, text_config=True),
)


def family_for(model_type: str | None) -> Family:
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    known = sorted(t for fam in FAMILIES for t in fam.model_types)
    raise ConfigError(f"unknown model_type {model_type!r} in config.json (known: {', '.join(known)})")


def text_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's decoder keys: `text_config`, under the keys of the top level (model_type,
    tie_word_embeddings, the placeholder token ids) except the other towers' configs."""
    if not isinstance(hf.get("text_config"), dict):
        raise ConfigError(f"{hf.get('model_type')} config.json has no text_config")
    top = {k: v for k, v in hf.items() if not k.endswith("_config")}
    return {**hf["text_config"], **top}


def config_from_hf(hf: dict[str, Any]) -> tuple[Family, DecoderConfig]:
    fam = family_for(hf.get("model_type"))
    if fam.text_config:
        hf = text_keys(hf)
    try:
        return fam, fam.parse(fam, hf)
    except KeyError as e:
        raise ConfigError(f"{fam.name} config.json is missing the key {e.args[0]!r}") from None
