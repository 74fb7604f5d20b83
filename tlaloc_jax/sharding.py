"""Tensor parallelism: how the built-in decoder's weights and pools are split over a 1-D mesh of N devices.

A body staged with a mesh runs the step inside `jax.shard_map`: every device holds its shard of each weight and
pool and runs the decoder on its share of the heads, with one all-reduce (`lax.psum`) after each row-parallel
projection. The split, by role (Megatron-LM's, as vLLM's tensor parallelism does it):

    column-parallel (split over output features, i.e. heads): q | k | v, the attention output gate, gate | up,
        the shared expert's gate and up, the linear layers' q | k | v, z, b and a projections; their biases,
        the attention sinks, a_log and dt_bias (one per head) and the causal conv's channels alike
    row-parallel (split over input features, then one all-reduce): o, down, the shared expert's down, the
        linear layers' out projection; their biases are added once, after the all-reduce
    expert-parallel: a mixture of experts' X experts, X / N on each device (the router replicated, every
        device routes every token and runs the chosen experts it holds; the MLP's one all-reduce sums them)
    replicated: the embedding, the head, the norms, the router, q/k norms, the shared expert's gate
    pools: KV pools over their KV heads, the conv state over its channels, the recurrent state over its heads

A fused projection (q | k | v, gate | up) is stored shard-major: device d's rows are its q heads, then its k
heads, then its v heads, so that each device's contiguous shard is the fused projection of its own heads.
The embedding and head stay replicated: each device computes the whole logits vector, so argmax and the
sampler run unchanged (and identically) on every device and nothing crosses devices after the last layer.

A model whose heads, KV heads, MLP width or experts do not divide N is refused by name (`check_divisible`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from .config import LINEAR, DecoderConfig
from .layers import OutMajor

# The mesh axis a tensor-parallel body is split over.
TP_AXIS = "tp"

COLUMN, ROW, HEADS, CHANNELS, EXPERTS, REPLICATED = "column", "row", "heads", "channels", "experts", "replicated"

# What each decoder slot is (stacked names; per-layer slots have the same names). Slots not listed are replicated.
SLOT_ROLES = {
    "attn.qkv_proj": COLUMN, "attn.q_proj": COLUMN, "attn.k_proj": COLUMN, "attn.v_proj": COLUMN,
    "attn.qkv_bias": HEADS, "attn.q_bias": HEADS, "attn.k_bias": HEADS, "attn.v_bias": HEADS,
    "attn.gate_proj": COLUMN, "attn.sinks": HEADS, "attn.o_proj": ROW,
    "layers.gate_up_proj": COLUMN, "layers.gate_proj": COLUMN, "layers.up_proj": COLUMN, "layers.down_proj": ROW,
    "layers.shared_gate": COLUMN, "layers.shared_up": COLUMN, "layers.shared_down": ROW,
    "layers.expert_gate": EXPERTS, "layers.expert_up": EXPERTS, "layers.expert_down": EXPERTS,
    "layers.expert_gate_bias": EXPERTS, "layers.expert_up_bias": EXPERTS, "layers.expert_down_bias": EXPERTS,
    "linear.in_qkv": COLUMN, "linear.in_z": COLUMN, "linear.in_b": COLUMN, "linear.in_a": COLUMN,
    "linear.a_log": HEADS, "linear.dt_bias": HEADS, "linear.conv": CHANNELS, "linear.out_proj": ROW,
}
# An expert slot's dims per layer ([X, E, F] weights, [X, F] biases): the experts' axis counted from the end.
_EXPERT_DIMS = {"layers.expert_gate": 3, "layers.expert_up": 3, "layers.expert_down": 3}


class ShardingError(ValueError):
    """A model cannot be split over the asked devices; the message names the count that does not divide."""


def fused_parts(cfg: DecoderConfig, slot: str) -> tuple[int, ...] | None:
    """The parts a fused slot joins along its split axis (each split over the devices on its own), or None."""
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if slot in ("attn.qkv_proj", "attn.qkv_bias"):
        return (H * D, K * D, K * D)
    if slot == "layers.gate_up_proj":
        return (cfg.intermediate_size, cfg.intermediate_size)
    if slot in ("linear.in_qkv", "linear.conv"):
        q = cfg.linear.key_heads * cfg.linear.key_dim
        return (q, q, cfg.linear.value_heads * cfg.linear.value_dim)
    return None


def check_divisible(cfg: DecoderConfig, n: int) -> None:
    """Refuse, naming the count, a model whose heads, KV heads, MLP width or experts do not divide over n devices."""
    if n < 1:
        raise ShardingError(f"tensor parallelism needs at least one device, got {n}")
    if cfg.latent:
        raise ShardingError(f"{cfg.model_type}: latent attention (one latent KV row shared by every head) is not "
                            "split over devices; serve it on one device")
    counts = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    if cfg.dense_mlp:
        counts["intermediate_size"] = cfg.intermediate_size
    if cfg.moe:
        counts["num_experts"] = cfg.experts.num_experts
        if cfg.shared_expert:
            counts["shared_expert_intermediate_size"] = cfg.experts.shared_intermediate_size
    if LINEAR in cfg.layer_types:
        counts["linear_num_key_heads"] = cfg.linear.key_heads
        counts["linear_num_value_heads"] = cfg.linear.value_heads
    for key, count in counts.items():
        if count % n:
            raise ShardingError(f"{cfg.model_type}: {key}={count} is not a multiple of the {n} tensor-parallel "
                                f"devices, so its shards would not hold whole heads (or features, or experts)")


def local_config(cfg: DecoderConfig, n: int, axis: str = TP_AXIS) -> DecoderConfig:
    """The config one device's shard runs: 1/n of the heads, KV heads and MLP width (the experts are found from
    the weights' shapes), its row-parallel projections all-reduced over `axis`."""
    check_divisible(cfg, n)
    return cfg.replace(
        num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
        intermediate_size=cfg.intermediate_size // n if cfg.dense_mlp else cfg.intermediate_size,
        experts=dict(shared_intermediate_size=cfg.experts.shared_intermediate_size // n),
        linear=dict(key_heads=cfg.linear.key_heads // n, value_heads=cfg.linear.value_heads // n),
        shard_axis=axis)


def split_axis(slot: str, leaf: Any) -> int | None:
    """The axis of a slot's stored array that is split over the devices (negative, from the end, so stacked and
    per-layer arrays agree), or None when it is replicated. `leaf`: the stored weight (an OutMajor [O, I] or a
    plain array, [I, O] for a projection)."""
    role = SLOT_ROLES.get(slot, REPLICATED)
    out_major = isinstance(leaf, OutMajor)
    if role == COLUMN:
        return -2 if out_major else -1
    if role == ROW:
        return -1 if out_major else -2
    if role == HEADS:
        return -1
    if role == CHANNELS:
        return -2
    if role == EXPERTS:
        return -_EXPERT_DIMS.get(slot, 2)
    return None


def shard_major(a: np.ndarray, axis: int, parts: tuple[int, ...] | None, n: int) -> np.ndarray:
    """a with its `parts` (sizes along `axis`, summing to its length) reordered so that each of the n contiguous
    shards holds its 1/n of every part, in part order. parts None: a as it is."""
    if parts is None or n == 1:
        return a
    if sum(parts) != a.shape[axis]:
        raise ShardingError(f"fused parts {parts} do not add up to the axis of length {a.shape[axis]}")
    pieces = np.split(a, np.cumsum(parts)[:-1], axis=axis)
    return np.concatenate([s for d in range(n) for s in (np.array_split(p, n, axis=axis)[d] for p in pieces)],
                          axis=axis)


def _map_leaves(slot: str, w: Any, fn):
    """fn(stored array, split axis) over a slot's arrays (a tuple of per-layer ones, OutMajor's inner array)."""
    if isinstance(w, (tuple, list)):
        return tuple(_map_leaves(slot, a, fn) for a in w)
    axis = split_axis(slot, w)
    if isinstance(w, OutMajor):
        return OutMajor(fn(w.out_in, axis))
    if not hasattr(w, "shape"):
        raise ShardingError(f"weight {slot!r} is a {type(w).__name__}: tensor-parallel staging splits plain and "
                            f"[out, in] arrays (quantized weights are not split yet)")
    return fn(w, axis)


def shard_decoder_weights(cfg: DecoderConfig, weights: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The decoder's weights for n devices: each fused slot stored shard-major (`split_axis` says which axis of
    each is split). Refuses (ShardingError) a model whose counts do not divide."""
    check_divisible(cfg, n)
    out = {}
    for slot, w in weights.items():
        parts = fused_parts(cfg, slot)
        out[slot] = _map_leaves(slot, w, lambda a, axis: shard_major(np.asarray(a), axis, parts, n)
                                if axis is not None else a)
    return out


def shard_shape(shape: tuple[int, ...], axis: int | None, n: int) -> tuple[int, ...]:
    """One device's shard of an array of `shape` split over n devices along `axis` (None: the whole array)."""
    if axis is None:
        return tuple(shape)
    axis %= len(shape)
    if shape[axis] % n:
        raise ShardingError(f"axis {axis} of shape {list(shape)} does not split over {n} devices")
    return tuple(d // n if i == axis else d for i, d in enumerate(shape))
