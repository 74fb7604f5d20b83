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

from .config import DENSE, FULL, LINEAR, SLIDING, SPARSE, ConfigError, DecoderConfig, RopeConfig
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
    axis: int = 0      # the checkpoint tensor's axis that holds the groups (one layer's tensor, as stored)


def _size(name: str, cfg: DecoderConfig) -> int:
    """A size: a DecoderConfig attribute, a number, or a product "a*b" of them."""
    return math.prod(int(n) if n.isdigit() else int(getattr(cfg, n)) for n in name.split("*"))


def split_rows(split: Split, cfg: DecoderConfig) -> tuple[np.ndarray, int]:
    """(the indices along the checkpoint tensor's split axis that make up the slot, in slot order; that
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
    hf: the checkpoint name; "{p}" is the family's decoder prefix, "{i}" the layer index, "{e}" an expert's:
        the checkpoint holds one tensor per expert, and the slot stacks them along its first axis (X).
    shape: the slot's shape in one layer, linears [in, out], experts' [X, in, out]; each size names a
        DecoderConfig attribute, a number, or a product "a*b" of them (as in Split).
    transpose: the checkpoint stores a linear [out, in] (its last two axes); the slot holds [in, out].
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

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf

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
    experts: "Experts | None" = None   # how the config describes mixture-of-experts MLPs (None: dense only)

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
    return layer_plan(cfg, windowed=False).slot_layers(slot)


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
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} (config key rope_parameters/rope_scaling) is not supported; "
                          f"supported: {', '.join(map(repr, ROPE_TYPES))}")
    kw: dict[str, Any] = dict(theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_type=rope_type)
    if rope_type == "longrope" and "original_max_position_embeddings" not in params:
        # Phi-3's files keep it beside max_position_embeddings, at the top level.
        params = {**params, "original_max_position_embeddings": hf.get("original_max_position_embeddings")}
    needed = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "linear": ("factor",), "yarn": ("original_max_position_embeddings",),
              "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}.get(rope_type, ())
    for key in needed:
        if params.get(key) is None:
            raise ConfigError(f"{rope_type} rope scaling needs {key!r} in rope_parameters/rope_scaling")
        if key.endswith("_factor") and rope_type == "longrope":
            kw[key] = tuple(float(f) for f in params[key])
        else:
            kw[key] = (int if key == "original_max_position_embeddings" else float)(params[key])
    if rope_type == "yarn":
        kw.update(_yarn(hf, params, kw["original_max_position_embeddings"]))
    if rope_type == "longrope":
        kw["attention_factor"] = _longrope_attention_factor(hf, params, kw["original_max_position_embeddings"])
    prf = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return RopeConfig(partial_rotary_factor=prf, **kw)


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def _longrope_attention_factor(hf: dict[str, Any], params: dict[str, Any], original: int) -> float:
    """LongRoPE's cos/sin scale, as transformers computes it for every call whichever factors it uses: the
    config's attention_factor, else sqrt(1 + ln(factor) / ln(original)) with factor (else max_position_embeddings
    / original) above 1, else 1."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else float(hf["max_position_embeddings"]) / original
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0


def _yarn(hf: dict[str, Any], params: dict[str, Any], original: int) -> dict[str, Any]:
    """YaRN's keys, with transformers' defaults: the factor (else max_position_embeddings / original), the
    ramp's beta_fast and beta_slow, truncate, and the cos/sin scale (attention_factor, else from mscale)."""
    factor = params.get("factor")
    factor = float(factor) if factor is not None else float(hf["max_position_embeddings"]) / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return dict(factor=factor, beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0), truncate=bool(params.get("truncate", True)),
                attention_factor=float(attention_factor))


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
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(f"{family.name} config key quantization_config (quant_method {method!r}) is not "
                          "supported: the weights must be stored unquantized (float32 or bfloat16)")
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


def parse_qwen2(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """Qwen2 / Qwen2.5: Llama's layers with biases on q, k and v; with use_sliding_window, the layers from
    max_window_layers on (or as `layer_types` says) slide."""
    kw = _common(family, hf)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    types = hf.get("layer_types") or [SLIDING if window and i >= int(hf.get("max_window_layers", 0)) else FULL
                                      for i in range(kw["num_layers"])]
    # A sliding layer without a window (use_sliding_window false) attends to everything, as in transformers.
    types = tuple(t if window else FULL for t in types)
    return DecoderConfig(rope=read_rope(hf), hidden_act=_activation(hf, family.name, "hidden_act"), layer_types=types,
                         sliding_window=int(window or 0), attention_bias=True, **kw)


def parse_phi3(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """Phi-3 / Phi-4-mini: Llama's layers with fused qkv_proj and gate_up_proj in the checkpoint (split by the
    table), a window on every layer when sliding_window is set, partial rotary, and LongRoPE (rope type
    "longrope"; older files say "su" or "yarn", which transformers reads as longrope for this family), whose
    original context is the top-level original_max_position_embeddings."""
    hf = dict(hf)
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) in ("su", "yarn", "longrope"):
            # transformers' Phi3Config: the top-level original_max_position_embeddings (its default 4096) wins over
            # the one in the rope parameters.
            orig = hf.get("original_max_position_embeddings", 4096)
            hf[key] = {**{k: v for k, v in params.items() if k != "type"}, "rope_type": "longrope",
                       "original_max_position_embeddings": orig}
    cfg = parse_dense(family, hf)
    rope, rotated = cfg.rope, int(cfg.head_dim * cfg.rope.partial_rotary_factor)
    if rope.rope_type == "longrope" and {len(rope.short_factor), len(rope.long_factor)} != {rotated // 2}:
        raise ConfigError(f"{family.name} longrope short_factor and long_factor need {rotated // 2} entries each (half "
                          f"the {rotated} rotated dims), got {len(rope.short_factor)} and {len(rope.long_factor)}")
    return cfg


def parse_olmo2(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """OLMo 2: no norms before attention and the MLP, a norm after each (before its residual add), and q/k norms
    over the whole q and k projections; attention_bias puts biases on q, k, v and o."""
    kw = _common(family, hf)
    bias = bool(hf.get("attention_bias"))
    return DecoderConfig(rope=read_rope(hf), hidden_act=_activation(hf, family.name, "hidden_act"),
                         input_norms=False, sandwich_norms=True, qk_norm_whole=True, attention_bias=bias,
                         output_bias=bias, **kw)


def parse_granite(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """Granite: Llama's layers with scalars on the residual stream (embedding_multiplier, residual_multiplier,
    logits_scaling) and the scores' scale given (attention_multiplier); attention_bias puts biases on q, k, v
    and o."""
    _refuse_flag(hf, "mlp_bias", family.name)
    kw = _common(family, hf)
    bias = bool(hf.get("attention_bias"))
    return DecoderConfig(rope=read_rope(hf), hidden_act=_activation(hf, family.name, "hidden_act"),
                         attention_bias=bias, output_bias=bias,
                         embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                         residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                         logits_scaling=float(hf.get("logits_scaling", 1.0)),
                         attention_multiplier=float(hf.get("attention_multiplier", 1.0)), **kw)


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


@dataclass(frozen=True)
class Experts:
    """How a family's config describes its mixture-of-experts MLPs (kernels/moe.py names the scorings and
    activations).

    scoring: the router's scoring; normalize: the config key that renormalises the chosen weights
    (norm_topk_prob) and its default, or None with the family's fixed choice in normalize_default;
    hidden_key: the key of an expert's hidden size; biases: router and expert biases (GPT-OSS);
    shared_key: the key of a shared expert's hidden size (Qwen3-Next), or a product "a*b" of keys (DeepSeek's
    n_shared_experts*moe_intermediate_size: its shared experts run as one), or None; shared_gated: the shared
    expert's output is scaled by sigmoid(x Ws) (Qwen3-Next).
    sparse: which layers are sparse, SPARSE_RULES: "step" (every decoder_sparse_step-th layer not in
    mlp_only_layers: Qwen3-MoE, Qwen3-Next), "all" (Mixtral, GPT-OSS), "after_dense" (the layers from
    first_k_dense_replace on: DeepSeek-V3). The dense layers run the gated MLP of intermediate_size.
    grouped: DeepSeek-V3's choice (a correction bias, n_group groups of which topk_group are kept) and
    routed_scaling_factor.
    """

    scoring: str
    hidden_key: str
    normalize: str | None = None
    normalize_default: bool = False
    activation: str = "silu"
    biases: bool = False
    shared_key: str | None = None
    shared_gated: bool = False
    sparse: str = "step"
    grouped: bool = False


SPARSE_RULES = ("step", "all", "after_dense")


def _num_experts(hf: dict[str, Any]) -> int:
    # transformers writes Qwen3-MoE's num_experts as num_local_experts (an attribute_map); the Hub's files say
    # num_experts; DeepSeek's n_routed_experts.
    return int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)


def _sparse_layers(spec: Experts | None, hf: dict[str, Any], layers: int) -> list[int]:
    """The layers whose MLP is a sparse mixture of experts, by the family's rule (Experts.sparse); none without
    experts. A family without experts reads Qwen's keys, to refuse a config that asks for some."""
    if _num_experts(hf) <= 0:
        return []
    rule = spec.sparse if spec else "step"
    if rule == "all":
        return list(range(layers))
    if rule == "after_dense":
        return list(range(int(hf.get("first_k_dense_replace") or 0), layers))
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def _moe_keys(family: "Family", hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """The DecoderConfig keys of a family's mixture-of-experts MLPs ({} when every MLP is dense)."""
    spec = family.experts
    sparse = _sparse_layers(spec, hf, layers)
    if not sparse:
        return {}
    if spec is None:
        keys = (f"num_experts={_num_experts(hf)}, decoder_sparse_step={hf.get('decoder_sparse_step', 1)}, "
                f"mlp_only_layers={hf.get('mlp_only_layers') or []}")
        raise ConfigError(f"{family.name} layers {sparse} have sparse mixture-of-experts MLPs (config keys {keys}); "
                          "only dense MLPs are supported")
    act = _activation(hf, family.name, "hidden_act")
    if spec.activation == "silu" and act != "silu":
        raise ConfigError(f"{family.name} config key hidden_act={hf['hidden_act']!r} is not supported for experts "
                          "(SwiGLU experts take silu)")
    normalize = bool(hf.get(spec.normalize, spec.normalize_default)) if spec.normalize else spec.normalize_default
    kw = dict(num_experts=_num_experts(hf), experts_per_token=int(hf["num_experts_per_tok"]),
              moe_intermediate_size=int(hf[spec.hidden_key]), router_scoring=spec.scoring,
              router_normalize=normalize, router_bias=spec.biases, expert_bias=spec.biases,
              expert_activation=spec.activation,
              mlp_types=tuple(SPARSE if i in sparse else DENSE for i in range(layers)))
    if spec.activation == "swiglu_clamped":
        kw.update(swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)))
    if spec.shared_key:
        kw["shared_expert_intermediate_size"] = math.prod(int(hf.get(k) or 0) for k in spec.shared_key.split("*"))
        kw["shared_expert_gated"] = spec.shared_gated
    if spec.grouped:
        kw.update(router_correction=True, router_groups=int(hf.get("n_group") or 1),
                  router_top_groups=int(hf.get("topk_group") or 1),
                  routed_scaling=float(hf.get("routed_scaling_factor", 1.0)))
    return kw


def parse_moe(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """Mixture-of-experts decoders with Llama-style attention: Qwen3-MoE (q/k norms; every layer sliding with
    use_sliding_window), Mixtral (every layer sliding when sliding_window is set)."""
    for key in ("attention_bias", "mlp_bias"):
        _refuse_flag(hf, key, family.name)
    kw = _common(family, hf)
    if family.sliding:
        window = hf.get("sliding_window")
    else:
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window:
        kw.update(layer_types=(SLIDING,) * kw["num_layers"], sliding_window=int(window))
    moe = _moe_keys(family, hf, kw["num_layers"])
    if not moe:
        raise ConfigError(f"{family.name} config has no experts (config key num_experts / num_local_experts)")
    return DecoderConfig(rope=read_rope(hf), **moe, **kw)


def parse_gpt_oss(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """GPT-OSS: attention with biases and a sink per head, sliding and full layers (`layer_types`, else
    alternating from a sliding first layer), YaRN RoPE, and experts with a biased router (softmax over the
    chosen logits) and GPT-OSS's clamped SwiGLU with biases."""
    kw = _common(family, hf)
    layers = kw["num_layers"]
    types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    moe = _moe_keys(family, hf, layers)
    if not moe:
        raise ConfigError(f"{family.name} config has no experts (config key num_local_experts)")
    # transformers' default window (128) where the config leaves it out.
    return DecoderConfig(rope=read_rope(hf), layer_types=tuple(types), sliding_window=int(hf.get("sliding_window") or 128),
                         attention_bias=bool(hf.get("attention_bias", True)),
                         output_bias=bool(hf.get("attention_bias", True)), attn_sinks=True, **moe, **kw)


def parse_deepseek(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """DeepSeek-V3: multi-head latent attention in every layer (one latent of kv_lora_rank and a rotated key of
    qk_rope_head_dim cached per position; queries through a q_lora_rank bottleneck, or one q_proj when it is
    null), YaRN or plain RoPE on the rotated part (pairs interleaved with rope_interleave), the scores scaled by
    qk_head_dim^-1/2 and YaRN's mscale(factor, mscale_all_dim)^2; dense MLPs in the first first_k_dense_replace
    layers and a mixture of experts after them (sigmoid scores, a correction bias for the choice, group-limited
    top-k, routed_scaling_factor, shared experts)."""
    _refuse_flag(hf, "attention_bias", family.name)
    for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, allowed) != allowed:
            raise ConfigError(f"{family.name} config key {key}={hf[key]!r} is not supported (transformers' DeepSeek-V3 "
                              f"runs {key}={allowed!r})")
    kw = _common(family, hf)
    rope_dim = int(hf["qk_rope_head_dim"])
    # The rotated key is shared by every head: head_dim is its size (transformers sets config.head_dim so too).
    kw.update(head_dim=rope_dim, num_kv_heads=kw["num_heads"])
    moe = _moe_keys(family, hf, kw["num_layers"])
    rope = dataclasses.replace(read_rope(hf), interleaved=bool(hf.get("rope_interleave", True)))
    scale = (int(hf["qk_nope_head_dim"]) + rope_dim) ** -0.5
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.rope_type != "default" and params.get("mscale_all_dim"):
        m = 0.1 * float(params["mscale_all_dim"]) * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
        scale *= m * m
    return DecoderConfig(rope=rope, hidden_act=_activation(hf, family.name, "hidden_act"),
                         kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                         qk_nope_head_dim=int(hf["qk_nope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                         attention_multiplier=scale, **moe, **kw)


def parse_hybrid(family: "Family", hf: dict[str, Any]) -> DecoderConfig:
    """Qwen3-Next and Qwen3.5 text decoders: Gated DeltaNet (LINEAR) layers between gated full-attention
    layers (`layer_types`, or every `full_attention_interval`-th layer full), (1 + w) norms, q/k norms,
    partial rotary (0.25 of the head unless the config says), dense SwiGLU MLPs, or (Qwen3-Next) a mixture
    of experts with a shared expert in every layer."""
    _refuse_flag(hf, "attention_bias", family.name)
    kw = _common(family, hf)
    layers = kw["num_layers"]
    moe = _moe_keys(family, hf, layers)
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
        linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)), **moe, **kw)


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
# Mixture-of-experts MLPs: X experts of hidden FX stacked [X, in, out] per layer, a router [E, X].
X, FX, FS = "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"
_QWEN_EXPERTS = (   # Qwen3-MoE, Qwen3-Next: one tensor per expert
    Tensor("layers.router", "{p}layers.{i}.mlp.gate.weight", (E, X), transpose=True, when="moe"),
    Tensor("layers.expert_gate", "{p}layers.{i}.mlp.experts.{e}.gate_proj.weight", (X, E, FX), transpose=True,
           when="moe"),
    Tensor("layers.expert_up", "{p}layers.{i}.mlp.experts.{e}.up_proj.weight", (X, E, FX), transpose=True,
           when="moe"),
    Tensor("layers.expert_down", "{p}layers.{i}.mlp.experts.{e}.down_proj.weight", (X, FX, E), transpose=True,
           when="moe"),
)
def _shared_expert(module: str) -> tuple[Tensor, ...]:
    """A shared expert's SwiGLU, every token runs it: Qwen3-Next's mlp.shared_expert, DeepSeek's mlp.shared_experts."""
    return tuple(Tensor(f"layers.shared_{part}", f"{{p}}layers.{{i}}.mlp.{module}.{part}_proj.weight", shape,
                        transpose=True, when="shared_expert")
                 for part, shape in (("gate", (E, FS)), ("up", (E, FS)), ("down", (FS, E))))


_SHARED_EXPERT = (  # Qwen3-Next: scaled by sigmoid(x Ws)
    *_shared_expert("shared_expert"),
    Tensor("layers.shared_expert_gate", "{p}layers.{i}.mlp.shared_expert_gate.weight", (E, "1"), transpose=True,
           when="shared_expert_gate"),
)
_MIXTRAL_EXPERTS = (  # w1 gate, w3 up, w2 down
    Tensor("layers.router", "{p}layers.{i}.block_sparse_moe.gate.weight", (E, X), transpose=True),
    Tensor("layers.expert_gate", "{p}layers.{i}.block_sparse_moe.experts.{e}.w1.weight", (X, E, FX), transpose=True),
    Tensor("layers.expert_up", "{p}layers.{i}.block_sparse_moe.experts.{e}.w3.weight", (X, E, FX), transpose=True),
    Tensor("layers.expert_down", "{p}layers.{i}.block_sparse_moe.experts.{e}.w2.weight", (X, FX, E), transpose=True),
)
# GPT-OSS stores its experts fused and [in, out] already: gate_up_proj [X, E, 2 FX] holds gate and up
# alternating along its last axis (gate = [..., 0::2], up = [..., 1::2]), its bias [X, 2 FX] likewise.
_GATE_UP, _GATE_UP_BIAS = "{p}layers.{i}.mlp.experts.gate_up_proj", "{p}layers.{i}.mlp.experts.gate_up_proj_bias"
_ALTERNATE = (FX, ("1", "1"))
_GPT_OSS_EXPERTS = (
    Tensor("layers.router", "{p}layers.{i}.mlp.router.weight", (E, X), transpose=True),
    Tensor("layers.router_bias", "{p}layers.{i}.mlp.router.bias", (X,), when="router_bias"),
    Tensor("layers.expert_gate", _GATE_UP, (X, E, FX), split=Split(*_ALTERNATE, (0,), axis=2)),
    Tensor("layers.expert_up", _GATE_UP, (X, E, FX), split=Split(*_ALTERNATE, (1,), axis=2)),
    Tensor("layers.expert_down", "{p}layers.{i}.mlp.experts.down_proj", (X, FX, E)),
    Tensor("layers.expert_gate_bias", _GATE_UP_BIAS, (X, FX), split=Split(*_ALTERNATE, (0,), axis=1),
           when="expert_bias"),
    Tensor("layers.expert_up_bias", _GATE_UP_BIAS, (X, FX), split=Split(*_ALTERNATE, (1,), axis=1),
           when="expert_bias"),
    Tensor("layers.expert_down_bias", "{p}layers.{i}.mlp.experts.down_proj_bias", (X, E), when="expert_bias"),
)
# Biases on q, k and v (Qwen2, GPT-OSS; OLMo 2 and Granite with attention_bias), on o (GPT-OSS, OLMo 2, Granite).
_QKV_BIASES = (
    Tensor("attn.q_bias", "{p}layers.{i}.self_attn.q_proj.bias", (HD,), when="attention_bias"),
    Tensor("attn.k_bias", "{p}layers.{i}.self_attn.k_proj.bias", (KD,), when="attention_bias"),
    Tensor("attn.v_bias", "{p}layers.{i}.self_attn.v_proj.bias", (KD,), when="attention_bias"),
)
_O_BIAS = Tensor("attn.o_bias", "{p}layers.{i}.self_attn.o_proj.bias", (E,), when="output_bias")
_ATTN_BIASES_SINKS = (
    *_QKV_BIASES, _O_BIAS,
    Tensor("attn.sinks", "{p}layers.{i}.self_attn.sinks", ("num_heads",), when="attn_sinks"),
)
_NORMS = (
    Tensor("layers.attn_norm", "{p}layers.{i}.input_layernorm.weight", (E,)),
    Tensor("layers.mlp_norm", "{p}layers.{i}.post_attention_layernorm.weight", (E,)),
)
_DENSE_MLP = tuple(dataclasses.replace(t, when="dense_mlp") for t in _MLP)   # the dense layers of a mixed model
_QWEN3_MOE_LAYER = (*_NORMS, *_ATTN, *_DENSE_MLP, *_QWEN_EXPERTS)
_MIXTRAL_LAYER = (*_NORMS, *_ATTN, *_MIXTRAL_EXPERTS)
_GPT_OSS_LAYER = (*_NORMS, *_ATTN, *_ATTN_BIASES_SINKS, *_GPT_OSS_EXPERTS)
_NORMS_MLP = (
    Tensor("layers.mlp_norm", "{p}layers.{i}.post_attention_layernorm.weight", (E,)),
    *_DENSE_MLP,
)
_QWEN3_5_LAYER = (Tensor("layers.attn_norm", "{p}layers.{i}.input_layernorm.weight", (E,)), *_GATED_ATTN,
                  *_DELTANET, *_NORMS_MLP)
_QWEN3_NEXT_LAYER = (Tensor("layers.attn_norm", "{p}layers.{i}.input_layernorm.weight", (E,)), *_GATED_ATTN,
                     *_DELTANET_INTERLEAVED, *_NORMS_MLP, *_QWEN_EXPERTS, *_SHARED_EXPERT)
_BIASED_LAYER = (*_DENSE_LAYER, *_QKV_BIASES, _O_BIAS)
# Phi-3 fuses q | k | v and gate | up in the checkpoint (one group each, parts in order).
_QKV_HF, _GATE_UP_HF = "{p}layers.{i}.self_attn.qkv_proj.weight", "{p}layers.{i}.mlp.gate_up_proj.weight"
_QKV_PARTS, _GATE_UP_PARTS = ("1", (HD, KD, KD)), ("1", (F, F))
_PHI3_LAYER = (
    Tensor("layers.attn_norm", "{p}layers.{i}.input_layernorm.weight", (E,)),
    *(Tensor(f"attn.{name}_proj", _QKV_HF, (E, size), transpose=True, split=Split(*_QKV_PARTS, (part,)))
      for part, (name, size) in enumerate((("q", HD), ("k", KD), ("v", KD)))),
    _ATTN[-1],
    Tensor("layers.mlp_norm", "{p}layers.{i}.post_attention_layernorm.weight", (E,)),
    *(Tensor(f"layers.{name}_proj", _GATE_UP_HF, (E, F), transpose=True, split=Split(*_GATE_UP_PARTS, (part,)))
      for part, name in enumerate(("gate", "up"))),
    _MLP[-1],
)
# OLMo 2: norms after attention and the MLP only; q/k norms over the whole projection.
_OLMO2_LAYER = (
    *_ATTN[:3],
    Tensor("attn.q_norm", "{p}layers.{i}.self_attn.q_norm.weight", (HD,)),
    Tensor("attn.k_norm", "{p}layers.{i}.self_attn.k_norm.weight", (KD,)),
    _ATTN[-1], *_QKV_BIASES, _O_BIAS,
    Tensor("layers.post_attn_norm", "{p}layers.{i}.post_attention_layernorm.weight", (E,)),
    *_MLP,
    Tensor("layers.post_mlp_norm", "{p}layers.{i}.post_feedforward_layernorm.weight", (E,)),
)
# DeepSeek-V3's latent attention: CL = the latent and the rotated key (kv_a_proj_with_mqa's outputs); kv_b_proj
# holds per head the key's part expanded from the latent (Dn) and then the value (Dv), split into two slots.
QL, CL, C = "q_lora_rank", "latent_width", "kv_lora_rank"
HQ, HDn, HDv = "num_heads*qk_head_dim", "num_heads*qk_nope_head_dim", "num_heads*v_head_dim"
_KV_B_HF = "{p}layers.{i}.self_attn.kv_b_proj.weight"
_KV_B_PARTS = ("num_heads", ("qk_nope_head_dim", "v_head_dim"))
_LATENT_ATTN = (
    Tensor("attn.q_proj", "{p}layers.{i}.self_attn.q_proj.weight", (E, HQ), transpose=True, when="q_direct"),
    Tensor("attn.q_a_proj", "{p}layers.{i}.self_attn.q_a_proj.weight", (E, QL), transpose=True, when="q_lora"),
    Tensor("attn.q_a_norm", "{p}layers.{i}.self_attn.q_a_layernorm.weight", (QL,), when="q_lora"),
    Tensor("attn.q_b_proj", "{p}layers.{i}.self_attn.q_b_proj.weight", (QL, HQ), transpose=True, when="q_lora"),
    Tensor("attn.kv_a_proj", "{p}layers.{i}.self_attn.kv_a_proj_with_mqa.weight", (E, CL), transpose=True),
    Tensor("attn.kv_a_norm", "{p}layers.{i}.self_attn.kv_a_layernorm.weight", (C,)),
    Tensor("attn.k_b_proj", _KV_B_HF, (C, HDn), transpose=True, split=Split(*_KV_B_PARTS, (0,))),
    Tensor("attn.v_b_proj", _KV_B_HF, (C, HDv), transpose=True, split=Split(*_KV_B_PARTS, (1,))),
    Tensor("attn.o_proj", "{p}layers.{i}.self_attn.o_proj.weight", (HDv, E), transpose=True),
)
_DEEPSEEK_LAYER = (
    *_NORMS, *_LATENT_ATTN, *_DENSE_MLP, *_QWEN_EXPERTS,
    Tensor("layers.router_correction", "{p}layers.{i}.mlp.gate.e_score_correction_bias", (X,),
           when="router_correction"),
    *_shared_expert("shared_experts"),
)
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
    Family("qwen3_next", ("qwen3_next",), "model.", _TOP + _QWEN3_NEXT_LAYER, qk_norm=True, parse=parse_hybrid,
           experts=Experts("softmax", "moe_intermediate_size", "norm_topk_prob", True,
                           shared_key="shared_expert_intermediate_size", shared_gated=True)),
    Family("qwen3_moe", ("qwen3_moe",), "model.", _TOP + _QWEN3_MOE_LAYER, qk_norm=True, parse=parse_moe,
           experts=Experts("softmax", "moe_intermediate_size", "norm_topk_prob", False)),
    # Mixtral renormalises the chosen experts' softmax weights always.
    Family("mixtral", ("mixtral",), "model.", _TOP + _MIXTRAL_LAYER, qk_norm=False, parse=parse_moe, sliding=True,
           experts=Experts("softmax", "intermediate_size", normalize_default=True, sparse="all")),
    Family("gpt_oss", ("gpt_oss",), "model.", _TOP + _GPT_OSS_LAYER, qk_norm=False, parse=parse_gpt_oss,
           experts=Experts("topk_softmax", "intermediate_size", activation="swiglu_clamped", biases=True,
                           sparse="all")),
    Family("qwen2", ("qwen2",), "model.", _TOP + _BIASED_LAYER, qk_norm=False, parse=parse_qwen2),
    Family("phi3", ("phi3",), "model.", _TOP + _PHI3_LAYER, qk_norm=False, parse=parse_phi3, sliding=True),
    Family("olmo2", ("olmo2",), "model.", _TOP + _OLMO2_LAYER, qk_norm=True, parse=parse_olmo2),
    Family("granite", ("granite",), "model.", _TOP + _BIASED_LAYER, qk_norm=False, parse=parse_granite),
    # Sigmoid scores; the choice adds the correction bias and keeps topk_group of n_group groups; the weights
    # (the chosen unbiased scores) renormalised with norm_topk_prob (default true), times routed_scaling_factor.
    Family("deepseek_v3", ("deepseek_v3",), "model.", _TOP + _DEEPSEEK_LAYER, qk_norm=False, parse=parse_deepseek,
           experts=Experts("sigmoid", "moe_intermediate_size", "norm_topk_prob", True,
                           shared_key="n_shared_experts*moe_intermediate_size", sparse="after_dense",
                           grouped=True)),
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
