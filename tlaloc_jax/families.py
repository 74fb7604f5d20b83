"""Model families: one table per Hugging Face model type.

A family is data, not code: the HF tensor name and the shape behind each weight slot, whether the tensor
is a linear stored [out, in] that the slot holds [in, out], which optional steps of the decoder are on, and
how to read the config keys (tlaloc_jax/hf_config.py). The decoder never branches on a family's name.
"""

from __future__ import annotations

import dataclasses
import math
from operator import attrgetter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .config import ConfigError, DecoderConfig
from .hf_config import (Experts, parse_deepseek, parse_dense, parse_gemma, parse_gpt_oss, parse_granite, parse_hybrid,
                        parse_moe, parse_olmo2, parse_phi3, parse_qwen2, text_keys)
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
    """A size: a DecoderConfig attribute (a group's as "group.name"), a number, or a product "a*b" of them."""
    return math.prod(int(n) if n.isdigit() else int(attrgetter(n)(cfg)) for n in name.split("*"))


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
    when: a DecoderConfig flag the slot needs ("moe", a group's as "attention.qk_norm"), or "untied_head".
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
    return bool(attrgetter(when)(cfg))


def stack_layers(slot: str, cfg: DecoderConfig) -> tuple[int, ...]:
    """The layers a stacked slot ("group.name") holds, in the decoder's stack order (() for a whole tensor)."""
    if "." not in slot:
        return ()
    # Where the keys and values live (windowed or not) does not move any weight.
    return layer_plan(cfg, windowed=False).slot_layers(slot)


# Slot names: "embed", "final_norm", "head" are whole tensors; "layers.*" are stacked over every layer,
# "attn.*" over the attention layers (full and sliding), "linear.*" over the linear-attention layers, in
# layer order.
# Slot sizes (docs/glossary.md), as the DecoderConfig attributes that hold them ("group.name" inside a group).
E, F, V, D = "hidden_size", "intermediate_size", "vocab_size", "head_dim"
HD, KD = "num_heads*head_dim", "num_kv_heads*head_dim"
# A linear layer's: C conv channels (q | k | v), W conv taps, Hv value heads of Dv.
C, W, Hv, Dv, HvDv = ("linear.conv_channels", "linear.conv_kernel", "linear.value_heads", "linear.value_dim",
                      "linear.value_heads*linear.value_dim")
_ATTN = (
    Tensor("attn.q_proj", "{p}layers.{i}.self_attn.q_proj.weight", (E, HD), transpose=True),
    Tensor("attn.k_proj", "{p}layers.{i}.self_attn.k_proj.weight", (E, KD), transpose=True),
    Tensor("attn.v_proj", "{p}layers.{i}.self_attn.v_proj.weight", (E, KD), transpose=True),
    Tensor("attn.q_norm", "{p}layers.{i}.self_attn.q_norm.weight", (D,), when="attention.qk_norm"),
    Tensor("attn.k_norm", "{p}layers.{i}.self_attn.k_norm.weight", (D,), when="attention.qk_norm"),
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
           split=Split("num_heads", ("head_dim", "head_dim"), (1,)), when="attention.output_gate"),
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
_QKVZ = ("linear.key_dim", "linear.key_dim", "linear.group*linear.value_dim", "linear.group*linear.value_dim")
_BA = ("linear.group", "linear.group")
_QKVZ_HF, _BA_HF = "{p}layers.{i}.linear_attn.in_proj_qkvz.weight", "{p}layers.{i}.linear_attn.in_proj_ba.weight"
_DELTANET_INTERLEAVED = (
    Tensor("linear.in_qkv", _QKVZ_HF, (E, C), transpose=True, split=Split("linear.key_heads", _QKVZ, (0, 1, 2))),
    Tensor("linear.in_z", _QKVZ_HF, (E, HvDv), transpose=True, split=Split("linear.key_heads", _QKVZ, (3,))),
    Tensor("linear.in_b", _BA_HF, (E, Hv), transpose=True, split=Split("linear.key_heads", _BA, (0,))),
    Tensor("linear.in_a", _BA_HF, (E, Hv), transpose=True, split=Split("linear.key_heads", _BA, (1,))),
    *_DELTANET_TAIL,
)
# Mixture-of-experts MLPs: X experts of hidden FX stacked [X, in, out] per layer, a router [E, X].
X, FX, FS = "experts.num_experts", "experts.intermediate_size", "experts.shared_intermediate_size"
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
    Tensor("layers.router_bias", "{p}layers.{i}.mlp.router.bias", (X,), when="experts.router_bias"),
    Tensor("layers.expert_gate", _GATE_UP, (X, E, FX), split=Split(*_ALTERNATE, (0,), axis=2)),
    Tensor("layers.expert_up", _GATE_UP, (X, E, FX), split=Split(*_ALTERNATE, (1,), axis=2)),
    Tensor("layers.expert_down", "{p}layers.{i}.mlp.experts.down_proj", (X, FX, E)),
    Tensor("layers.expert_gate_bias", _GATE_UP_BIAS, (X, FX), split=Split(*_ALTERNATE, (0,), axis=1),
           when="experts.expert_bias"),
    Tensor("layers.expert_up_bias", _GATE_UP_BIAS, (X, FX), split=Split(*_ALTERNATE, (1,), axis=1),
           when="experts.expert_bias"),
    Tensor("layers.expert_down_bias", "{p}layers.{i}.mlp.experts.down_proj_bias", (X, E), when="experts.expert_bias"),
)
# Biases on q, k and v (Qwen2, GPT-OSS; OLMo 2 and Granite with attention_bias), on o (GPT-OSS, OLMo 2, Granite).
_QKV_BIASES = (
    Tensor("attn.q_bias", "{p}layers.{i}.self_attn.q_proj.bias", (HD,), when="attention.bias"),
    Tensor("attn.k_bias", "{p}layers.{i}.self_attn.k_proj.bias", (KD,), when="attention.bias"),
    Tensor("attn.v_bias", "{p}layers.{i}.self_attn.v_proj.bias", (KD,), when="attention.bias"),
)
_O_BIAS = Tensor("attn.o_bias", "{p}layers.{i}.self_attn.o_proj.bias", (E,), when="attention.output_bias")
_ATTN_BIASES_SINKS = (
    *_QKV_BIASES, _O_BIAS,
    Tensor("attn.sinks", "{p}layers.{i}.self_attn.sinks", ("num_heads",), when="attention.sinks"),
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
QL, CL, C = "mla.q_lora_rank", "latent_width", "mla.kv_lora_rank"
HQ, HDn, HDv = "num_heads*qk_head_dim", "num_heads*mla.qk_nope_head_dim", "num_heads*mla.v_head_dim"
_KV_B_HF = "{p}layers.{i}.self_attn.kv_b_proj.weight"
_KV_B_PARTS = ("num_heads", ("mla.qk_nope_head_dim", "mla.v_head_dim"))
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
           when="experts.router_correction"),
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


def config_from_hf(hf: dict[str, Any]) -> tuple[Family, DecoderConfig]:
    fam = family_for(hf.get("model_type"))
    if fam.text_config:
        hf = text_keys(hf)
    try:
        return fam, fam.parse(fam, hf)
    except KeyError as e:
        raise ConfigError(f"{fam.name} config.json is missing the key {e.args[0]!r}") from None
