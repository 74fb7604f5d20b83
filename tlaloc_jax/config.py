"""Model configuration: the frozen description of a decoder, built from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A checkpoint's config.json asks for something this project does not build; the message names it."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings.

    rope_type: "default" (plain RoPE), "linear" (positions divided by factor), "llama3" (Llama 3.1
    frequency scaling) or "yarn" (YaRN: frequencies blended between interpolated and original by a ramp
    from beta_fast to beta_slow rotations, cos and sin scaled by attention_factor; GPT-OSS).
    partial_rotary_factor: the fraction of the head that is rotated (1.0 for Llama and Qwen3).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
LAYER_TYPES = (FULL, SLIDING, LINEAR)
# A mixture-of-experts MLP's router scorings and expert activations (tlaloc_jax.kernels.moe).
ROUTER_SCORINGS = ("softmax", "topk_softmax", "sigmoid")
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class DecoderConfig:
    """Everything the decoder functions need to know about a model's shape and its optional steps.

    Built by a family (tlaloc_jax.families) from an HF config.json; frozen and hashable so it can be a
    static argument of jax.jit.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    name: str = ""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # (token id, config key) pairs that a server refuses: multimodal placeholders of the checkpoint.
    refused_tokens: tuple[tuple[int, str], ...] = field(default=())
    # Per layer: FULL, SLIDING (window `sliding_window`) or LINEAR. Empty means every layer FULL.
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    rope_sliding: RopeConfig | None = None     # a sliding layer's own RoPE (Gemma 3); None: `rope`
    query_pre_attn_scalar: float = 0.0         # scores scaled by its -1/2 power; 0: head_dim's
    attn_softcap: float = 0.0                  # scores -> cap * tanh(scores / cap); 0: off
    final_softcap: float = 0.0                 # the same on the logits
    norm_offset: float = 0.0                   # RMSNorm multiplies by (offset + w): 1 for Gemma
    hidden_act: str = "silu"                   # MLP gate activation: "silu" or "gelu_tanh"
    embed_scale: bool = False                  # embeddings times sqrt(hidden) (Gemma)
    sandwich_norms: bool = False               # norms after attention and after the MLP too (Gemma 2/3)
    attn_output_gate: bool = False             # attention output * sigmoid(gate_proj x) before o_proj (Qwen3-Next)
    # LINEAR layers (Gated DeltaNet): key heads and size (q and k), value heads and size (v, z, one recurrent
    # state [key size, value size] per value head), and the causal conv's taps. 0 without linear layers.
    linear_key_heads: int = 0
    linear_key_dim: int = 0
    linear_value_heads: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    attention_bias: bool = False               # q, k, v and o projections add biases (GPT-OSS)
    attn_sinks: bool = False                   # a learned sink logit per query head joins each softmax (GPT-OSS)
    # Mixture-of-experts MLPs, in every layer when num_experts > 0: num_experts experts (X) of
    # moe_intermediate_size, the router's experts_per_token (J) best kept and weighed by router_scoring
    # (renormalised with router_normalize), experts computing expert_activation; a router bias and expert
    # biases where the family has them, and a shared expert of shared_expert_intermediate_size (0: none).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    router_scoring: str = "softmax"
    router_normalize: bool = False
    router_bias: bool = False
    expert_activation: str = "silu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702                # "swiglu_clamped": g * sigmoid(alpha g)
    swiglu_limit: float = 7.0                  # "swiglu_clamped": the clamp of g and u
    shared_expert_intermediate_size: int = 0
    # One tensor-parallel shard's config (tlaloc_jax.sharding.local_config): the mesh axis its row-parallel
    # projections all-reduce over. "": the whole model on one device.
    shard_axis: str = ""

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        types = self.layer_types or (FULL,) * self.num_layers
        if len(types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(types)} entries for num_hidden_layers={self.num_layers}")
        for t in types:
            if t not in LAYER_TYPES:
                raise ConfigError(f"layer type {t!r} (config key layer_types) is not supported")
        if SLIDING in types and self.sliding_window <= 0:
            raise ConfigError("sliding_attention layers need a positive sliding_window")
        if LINEAR in types:
            dims = dict(linear_key_heads=self.linear_key_heads, linear_key_dim=self.linear_key_dim,
                        linear_value_heads=self.linear_value_heads, linear_value_dim=self.linear_value_dim,
                        linear_conv_kernel=self.linear_conv_kernel)
            for name, value in dims.items():
                if value <= 0:
                    raise ConfigError(f"linear_attention layers need a positive {name}, got {value}")
            if self.linear_value_heads % self.linear_key_heads:
                raise ConfigError(f"linear value heads ({self.linear_value_heads}) are not a multiple of linear key "
                                  f"heads ({self.linear_key_heads})")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok={self.experts_per_token} must be between 1 and "
                                  f"num_experts={self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise ConfigError(f"mixture-of-experts layers need a positive moe_intermediate_size, got "
                                  f"{self.moe_intermediate_size}")
            if self.router_scoring not in ROUTER_SCORINGS:
                raise ConfigError(f"router scoring {self.router_scoring!r} is not supported")
            if self.expert_activation not in EXPERT_ACTIVATIONS:
                raise ConfigError(f"expert activation {self.expert_activation!r} is not supported")
        object.__setattr__(self, "layer_types", tuple(types))

    @property
    def query_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def linear_group(self) -> int:
        """Value heads per key head of a linear layer (value head h reads key head h // linear_group)."""
        return self.linear_value_heads // self.linear_key_heads if self.linear_key_heads else 0

    @property
    def conv_channels(self) -> int:
        """C: the channels of a linear layer's causal conv, q | k | v."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    @property
    def moe(self) -> bool:
        """Whether the layers' MLPs are mixtures of experts (every layer's: a mix is refused by the families)."""
        return self.num_experts > 0

    @property
    def dense_mlp(self) -> bool:
        return not self.moe

    @property
    def shared_expert(self) -> bool:
        return self.moe and self.shared_expert_intermediate_size > 0

    def layer_window(self, layer: int) -> int:
        """The window of a layer's attention (0: full history)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else 0

    def replace(self, **changes) -> "DecoderConfig":
        return dataclasses.replace(self, **changes)
