"""Reading a Hugging Face config.json into a DecoderConfig: each family's `parse` (tlaloc_jax/families.py names
it in the family's row) and the keys the families share (RoPE, the mixture-of-experts keys, refusals by name).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Protocol

from .config import (DENSE, FULL, LINEAR, SLIDING, SPARSE, AttentionConfig, ConfigError, DecoderConfig,
                     LatentConfig, LinearAttentionConfig, MoeConfig, ResidualConfig, RopeConfig)


# The HF config keys that name a multimodal checkpoint's placeholder ids; the text decoder cannot
# embed them, so a server refuses them by name.
PLACEHOLDER_KEYS = ("image_token_id", "video_token_id", "image_token_index", "video_token_index", "audio_token_id")


class Family(Protocol):
    """What a parser reads of its family's row (families.Family): this module does not import the table."""

    name: str
    qk_norm: bool
    sliding: bool
    tied_default: bool
    experts: "Experts | None"


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
        for key in ("short_mscale", "long_mscale"):     # a scale per factor set, which transformers does not read
            if params.get(key) is not None:
                raise ConfigError(f"longrope {key}={params[key]!r} (config key rope_parameters/rope_scaling) is not "
                                  "supported")
        kw["attention_factor"] = _longrope_attention_factor(hf, params, kw["original_max_position_embeddings"])
    prf = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return RopeConfig(partial_rotary_factor=prf, **kw)


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# quantization_config's methods whose checkpoints the loader reads (tlaloc_jax/prequantized.py).
PREQUANTIZED_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")


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


def _common(family: Family, hf: dict[str, Any]) -> dict[str, Any]:
    """The keys every decoder family shares."""
    quant = hf.get("quantization_config")
    method = (quant.get("quant_method") if isinstance(quant, dict) else quant) if quant else None
    if quant and method not in PREQUANTIZED_METHODS:     # the loader reads these (tlaloc_jax/prequantized.py)
        raise ConfigError(f"{family.name} config key quantization_config (quant_method {method!r}) is not "
                          f"supported: the weights must be stored unquantized (float32 or bfloat16) or as "
                          f"{', '.join(PREQUANTIZED_METHODS)}")
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
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        name=str(hf.get("_name_or_path", "") or ""),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos(hf),
        refused_tokens=tuple((int(hf[k]), k) for k in PLACEHOLDER_KEYS if hf.get(k) is not None),
    )


def _attention(family: Family, **kw) -> AttentionConfig:
    """The family's attention group: its q/k norms and the parser's other steps."""
    return AttentionConfig(qk_norm=family.qk_norm, **kw)


def _activation(hf: dict[str, Any], family: str, key: str) -> str:
    act = hf.get(key, "silu")
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in names:
        raise ConfigError(f"{family} config key {key}={act!r} is not supported (supported: {', '.join(names)})")
    return names[act]


def parse_dense(family: Family, hf: dict[str, Any]) -> DecoderConfig:
    """Llama-style dense decoders (llama, qwen3, mistral): SwiGLU MLP, RMSNorm, RoPE, GQA."""
    for key in ("attention_bias", "mlp_bias"):
        _refuse_flag(hf, key, family.name)
    kw = _common(family, hf)
    window = hf.get("sliding_window") if family.sliding else None
    if family.name == "qwen3" and hf.get("use_sliding_window"):
        raise ConfigError("qwen3 config key use_sliding_window=true is not supported")
    if window:
        kw.update(layer_types=(SLIDING,) * kw["num_layers"], sliding_window=int(window))
    return DecoderConfig(rope=read_rope(hf), hidden_act=_activation(hf, family.name, "hidden_act"),
                         attention=_attention(family), **kw)


def parse_qwen2(family: Family, hf: dict[str, Any]) -> DecoderConfig:
    """Qwen2 / Qwen2.5: Llama's layers with biases on q, k and v; with use_sliding_window, the layers from
    max_window_layers on (or as `layer_types` says) slide."""
    kw = _common(family, hf)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    types = hf.get("layer_types") or [SLIDING if window and i >= int(hf.get("max_window_layers", 0)) else FULL
                                      for i in range(kw["num_layers"])]
    # A sliding layer without a window (use_sliding_window false) attends to everything, as in transformers.
    types = tuple(t if window else FULL for t in types)
    return DecoderConfig(rope=read_rope(hf), hidden_act=_activation(hf, family.name, "hidden_act"), layer_types=types,
                         sliding_window=int(window or 0), attention=_attention(family, bias=True), **kw)


def parse_phi3(family: Family, hf: dict[str, Any]) -> DecoderConfig:
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


def parse_olmo2(family: Family, hf: dict[str, Any]) -> DecoderConfig:
    """OLMo 2: no norms before attention and the MLP, a norm after each (before its residual add), and q/k norms
    over the whole q and k projections; attention_bias puts biases on q, k, v and o."""
    kw = _common(family, hf)
    bias = bool(hf.get("attention_bias"))
    return DecoderConfig(rope=read_rope(hf), hidden_act=_activation(hf, family.name, "hidden_act"),
                         residual=ResidualConfig(input_norms=False, sandwich_norms=True),
                         attention=_attention(family, qk_norm_whole=True, bias=bias, output_bias=bias), **kw)


def parse_granite(family: Family, hf: dict[str, Any]) -> DecoderConfig:
    """Granite: Llama's layers with scalars on the residual stream (embedding_multiplier, residual_multiplier,
    logits_scaling) and the scores' scale given (attention_multiplier); attention_bias puts biases on q, k, v
    and o."""
    _refuse_flag(hf, "mlp_bias", family.name)
    kw = _common(family, hf)
    bias = bool(hf.get("attention_bias"))
    return DecoderConfig(rope=read_rope(hf), hidden_act=_activation(hf, family.name, "hidden_act"),
                         attention=_attention(family, bias=bias, output_bias=bias,
                                              multiplier=float(hf.get("attention_multiplier", 1.0))),
                         residual=ResidualConfig(embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                                                 multiplier=float(hf.get("residual_multiplier", 1.0)),
                                                 logits_scaling=float(hf.get("logits_scaling", 1.0))), **kw)


def parse_gemma(family: Family, hf: dict[str, Any]) -> DecoderConfig:
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
        attention=_attention(family, query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0),
                             softcap=float(hf.get("attn_logit_softcapping") or 0.0)),
        residual=ResidualConfig(norm_offset=1.0, embed_scale=True, sandwich_norms=True,
                                final_softcap=float(hf.get("final_logit_softcapping") or 0.0)),
        hidden_act=_activation(hf, family.name, "hidden_activation"), **kw)


@dataclass(frozen=True)
class Experts:
    """How a family's config describes its mixture-of-experts MLPs (tlaloc_jax/kernels/moe.py names the scorings and
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


def _moe_keys(family: Family, hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """The DecoderConfig keys of a family's mixture-of-experts MLPs, `experts` and `mlp_types` ({} when every MLP
    is dense)."""
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
              intermediate_size=int(hf[spec.hidden_key]), router_scoring=spec.scoring,
              router_normalize=normalize, router_bias=spec.biases, expert_bias=spec.biases,
              activation=spec.activation)
    if spec.activation == "swiglu_clamped":
        kw.update(swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)))
    if spec.shared_key:
        kw["shared_intermediate_size"] = math.prod(int(hf.get(k) or 0) for k in spec.shared_key.split("*"))
        kw["shared_gated"] = spec.shared_gated
    if spec.grouped:
        kw.update(router_correction=True, router_groups=int(hf.get("n_group") or 1),
                  router_top_groups=int(hf.get("topk_group") or 1),
                  routed_scaling=float(hf.get("routed_scaling_factor", 1.0)))
    return dict(experts=MoeConfig(**kw), mlp_types=tuple(SPARSE if i in sparse else DENSE for i in range(layers)))


def parse_moe(family: Family, hf: dict[str, Any]) -> DecoderConfig:
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
    return DecoderConfig(rope=read_rope(hf), attention=_attention(family), **moe, **kw)


def parse_gpt_oss(family: Family, hf: dict[str, Any]) -> DecoderConfig:
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
                         attention=_attention(family, bias=bool(hf.get("attention_bias", True)),
                                              output_bias=bool(hf.get("attention_bias", True)), sinks=True),
                         **moe, **kw)


def parse_deepseek(family: Family, hf: dict[str, Any]) -> DecoderConfig:
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
                         mla=LatentConfig(kv_lora_rank=int(hf["kv_lora_rank"]),
                                          q_lora_rank=int(hf.get("q_lora_rank") or 0),
                                          qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                                          v_head_dim=int(hf["v_head_dim"])),
                         attention=_attention(family, multiplier=scale), **moe, **kw)


def parse_hybrid(family: Family, hf: dict[str, Any]) -> DecoderConfig:
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
        rope=rope, layer_types=tuple(types), hidden_act=act, residual=ResidualConfig(norm_offset=1.0),
        attention=_attention(family, output_gate=True),
        linear=LinearAttentionConfig(key_heads=int(hf["linear_num_key_heads"]), key_dim=int(hf["linear_key_head_dim"]),
                                     value_heads=int(hf["linear_num_value_heads"]),
                                     value_dim=int(hf["linear_value_head_dim"]),
                                     conv_kernel=int(hf.get("linear_conv_kernel_dim", 4))), **moe, **kw)


def text_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's decoder keys: `text_config`, under the keys of the top level (model_type,
    tie_word_embeddings, the placeholder token ids) except the other towers' configs."""
    if not isinstance(hf.get("text_config"), dict):
        raise ConfigError(f"{hf.get('model_type')} config.json has no text_config")
    top = {k: v for k, v in hf.items() if not k.endswith("_config")}
    return {**hf["text_config"], **top}
