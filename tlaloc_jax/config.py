"""Model configuration: the frozen description of a decoder, built from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A checkpoint's config.json asks for something this project does not build; the message names it."""


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor or holds one of the wrong shape or layout; the message names it. (Here, not in
    tlaloc_jax.checkpoint, so that the pre-quantized readers it calls can raise it.)"""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings.

    rope_type: "default" (plain RoPE), "linear" (positions divided by factor), "llama3" (Llama 3.1
    frequency scaling), "yarn" (YaRN: frequencies blended between interpolated and original by a ramp
    from beta_fast to beta_slow rotations, cos and sin scaled by attention_factor; GPT-OSS) or "longrope"
    (LongRoPE, Phi-3: each frequency divided by its own factor, short_factor or long_factor as long_factors
    says, cos and sin scaled by attention_factor).
    partial_rotary_factor: the fraction of the head that is rotated (1.0 for Llama and Qwen3).
    interleaved: the rotated dims pair up as (0, 1), (2, 3), ... (DeepSeek's rope_interleave) rather than
    (i, i + R / 2) (rotate-half).
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
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # LongRoPE's choice of factor set, made once for every position (with_context): transformers picks it per
    # forward call from the sequence's length, which a KV cache written earlier cannot follow.
    long_factors: bool = False
    interleaved: bool = False


FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
LAYER_TYPES = (FULL, SLIDING, LINEAR)
# A mixture-of-experts MLP's router scorings and expert activations (tlaloc_jax.kernels.moe).
ROUTER_SCORINGS = ("softmax", "topk_softmax", "sigmoid")
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")
# A layer's MLP: the gated MLP ("dense") or a mixture of experts ("sparse").
DENSE, SPARSE = "dense", "sparse"
MLP_TYPES = (DENSE, SPARSE)


@dataclass(frozen=True)
class AttentionConfig:
    """A softmax attention layer's optional steps (every one off by default)."""

    qk_norm: bool = False
    qk_norm_whole: bool = False         # q/k norms over the whole projection [H * D] (OLMo 2), not each head
    query_pre_attn_scalar: float = 0.0  # scores scaled by its -1/2 power; 0: head_dim's
    softcap: float = 0.0                # scores -> cap * tanh(scores / cap); 0: off
    output_gate: bool = False           # attention output * sigmoid(gate_proj x) before o_proj (Qwen3-Next)
    bias: bool = False                  # q, k and v projections add biases (GPT-OSS, Qwen2)
    output_bias: bool = False           # the o projection adds a bias (GPT-OSS)
    sinks: bool = False                 # a learned sink logit per query head joins each softmax (GPT-OSS)
    multiplier: float = 0.0             # the scores' scale itself (Granite, DeepSeek); 0: query_scale's rule


@dataclass(frozen=True)
class ResidualConfig:
    """The residual stream's norms and scalars (Granite's: embeddings times embedding_multiplier, each attention
    and MLP output times multiplier before its residual add, the logits divided by logits_scaling)."""

    norm_offset: float = 0.0            # RMSNorm multiplies by (offset + w): 1 for Gemma
    input_norms: bool = True            # norms before attention and the MLP; False: OLMo 2 norms only their
                                        # outputs (sandwich_norms)
    sandwich_norms: bool = False        # norms after attention and after the MLP too (Gemma 2/3, OLMo 2)
    embed_scale: bool = False           # embeddings times sqrt(hidden) (Gemma)
    embedding_multiplier: float = 1.0
    multiplier: float = 1.0
    logits_scaling: float = 1.0
    final_softcap: float = 0.0          # logits -> cap * tanh(logits / cap); 0: off


@dataclass(frozen=True)
class LatentConfig:
    """Multi-head latent attention (DeepSeek-V3) when kv_lora_rank > 0: each position keeps one latent of
    kv_lora_rank (C) and a rotated key of the decoder's head_dim (R) shared by every head; a head's key is its
    qk_nope_head_dim (Dn) part expanded from the latent beside the rotated one, its value v_head_dim (Dv)
    expanded from the latent. Queries go through a q_lora_rank bottleneck (0: one projection)."""

    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        if self.kv_lora_rank:
            for name in ("qk_nope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"latent attention needs a positive {name}, got {getattr(self, name)}")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """LINEAR layers (Gated DeltaNet): key heads and size (q and k), value heads and size (v, z, one recurrent
    state [key size, value size] per value head), and the causal conv's taps. 0 without linear layers."""

    key_heads: int = 0
    key_dim: int = 0
    value_heads: int = 0
    value_dim: int = 0
    conv_kernel: int = 0

    def check(self) -> None:
        """Refuse sizes that linear layers cannot run with (called when some layer is LINEAR)."""
        for name in ("key_heads", "key_dim", "value_heads", "value_dim", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"linear_attention layers need a positive linear_{name}, got {getattr(self, name)}")
        if self.value_heads % self.key_heads:
            raise ConfigError(f"linear value heads ({self.value_heads}) are not a multiple of linear key "
                              f"heads ({self.key_heads})")

    @property
    def group(self) -> int:
        """Value heads per key head (value head h reads key head h // group)."""
        return self.value_heads // self.key_heads if self.key_heads else 0

    @property
    def conv_channels(self) -> int:
        """C: the channels of the causal conv, q | k | v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts MLPs (used by the layers the decoder's mlp_types names SPARSE): num_experts experts (X)
    of intermediate_size, the router's experts_per_token (J) best kept and weighed by router_scoring
    (renormalised with router_normalize, then times routed_scaling), experts computing activation; a router
    bias and expert biases where the family has them, and a shared expert of shared_intermediate_size (0:
    none), gated by sigmoid(x Ws) with shared_gated. DeepSeek-V3's choice: a correction bias added to the
    sigmoid scores (router_correction), and only the experts of the router_top_groups best of router_groups
    groups (a group scored by its two best experts)."""

    num_experts: int = 0
    experts_per_token: int = 0
    intermediate_size: int = 0
    router_scoring: str = "softmax"
    router_normalize: bool = False
    router_bias: bool = False
    activation: str = "silu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702         # "swiglu_clamped": g * sigmoid(alpha g)
    swiglu_limit: float = 7.0           # "swiglu_clamped": the clamp of g and u
    shared_intermediate_size: int = 0
    shared_gated: bool = False
    router_correction: bool = False
    router_groups: int = 1
    router_top_groups: int = 1
    routed_scaling: float = 1.0

    def __post_init__(self):
        if not self.num_experts:
            return
        if self.num_experts % self.router_groups or not 1 <= self.router_top_groups <= self.router_groups:
            raise ConfigError(f"n_group={self.router_groups} must divide num_experts={self.num_experts}, and "
                              f"topk_group={self.router_top_groups} be between 1 and n_group")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.experts_per_token} must be between 1 and "
                              f"num_experts={self.num_experts}")
        if self.intermediate_size <= 0:
            raise ConfigError(f"mixture-of-experts layers need a positive moe_intermediate_size, got "
                              f"{self.intermediate_size}")
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ConfigError(f"router scoring {self.router_scoring!r} is not supported")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ConfigError(f"expert activation {self.activation!r} is not supported")


@dataclass(frozen=True)
class DecoderConfig:
    """Everything the decoder functions need to know about a model's shape and its optional steps: the core
    shape at the top level, each optional part in its own group (attention, residual, mla, linear, experts).

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
    hidden_act: str = "silu"                   # MLP gate activation: "silu" or "gelu_tanh"
    # Per layer: DENSE (the gated MLP of intermediate_size) or SPARSE (`experts`). Empty: every layer SPARSE
    # when experts.num_experts > 0, else DENSE.
    mlp_types: tuple[str, ...] = ()
    attention: AttentionConfig = AttentionConfig()
    residual: ResidualConfig = ResidualConfig()
    mla: LatentConfig = LatentConfig()
    linear: LinearAttentionConfig = LinearAttentionConfig()
    experts: MoeConfig = MoeConfig()
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
            self.linear.check()
        num_experts = self.experts.num_experts
        mlp = self.mlp_types or ((SPARSE if num_experts else DENSE),) * self.num_layers
        if len(mlp) != self.num_layers or any(t not in MLP_TYPES for t in mlp):
            raise ConfigError(f"mlp_types {list(mlp)} is not one of {MLP_TYPES} for each of {self.num_layers} layers")
        if SPARSE in mlp and not num_experts:
            raise ConfigError("sparse MLP layers need num_experts > 0")
        object.__setattr__(self, "mlp_types", tuple(mlp))
        if self.mla.kv_lora_rank and self.head_dim <= 0:
            raise ConfigError(f"latent attention needs a positive head_dim, got {self.head_dim}")
        object.__setattr__(self, "layer_types", tuple(types))

    @property
    def query_scale(self) -> float:
        if self.attention.multiplier:
            return self.attention.multiplier
        return (self.attention.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def latent(self) -> bool:
        """Whether the attention is multi-head latent attention (kv_lora_rank > 0)."""
        return self.mla.kv_lora_rank > 0

    @property
    def latent_width(self) -> int:
        """What a latent-attention layer keeps per position: the latent and the rotated key (C + R)."""
        return self.mla.kv_lora_rank + self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """A latent-attention head's query and key size: the part expanded from the latent and the rotated one."""
        return self.mla.qk_nope_head_dim + self.head_dim

    @property
    def q_lora(self) -> bool:
        """Latent attention's queries go through the q_lora_rank bottleneck (q_a_proj, its norm, q_b_proj)."""
        return self.latent and self.mla.q_lora_rank > 0

    @property
    def q_direct(self) -> bool:
        """Latent attention's queries come from one projection (q_lora_rank null)."""
        return self.latent and not self.mla.q_lora_rank

    @property
    def moe(self) -> bool:
        """Whether some layer's MLP is a mixture of experts."""
        return SPARSE in self.mlp_types

    @property
    def dense_mlp(self) -> bool:
        """Whether some layer's MLP is the gated MLP."""
        return DENSE in self.mlp_types

    @property
    def shared_expert(self) -> bool:
        return self.moe and self.experts.shared_intermediate_size > 0

    @property
    def shared_expert_gate(self) -> bool:
        return self.shared_expert and self.experts.shared_gated

    def with_context(self, context: int) -> "DecoderConfig":
        """The config for calls that reach `context` positions: LongRoPE rotates every position with its long
        factors when the context passes original_max_position_embeddings (as vLLM does for max_model_len), with
        its short ones otherwise. Other configs are returned as they are."""
        if self.rope.rope_type != "longrope":
            return self
        long = context > self.rope.original_max_position_embeddings
        return dataclasses.replace(self, rope=dataclasses.replace(self.rope, long_factors=long))

    def layer_window(self, layer: int) -> int:
        """The window of a layer's attention (0: full history)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else 0

    def replace(self, **changes) -> "DecoderConfig":
        """A copy with `changes`; a group given as a dict changes only those fields of the current group."""
        for key in GROUPS:
            if isinstance(changes.get(key), dict):
                changes[key] = dataclasses.replace(getattr(self, key), **changes[key])
        return dataclasses.replace(self, **changes)


# DecoderConfig's groups: the field that holds each.
GROUPS = ("attention", "residual", "mla", "linear", "experts")
