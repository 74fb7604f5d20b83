"""LoRA adapters as slots: each target projection's A [N + 1, R, I] and B [O, N + 1, R] per layer (out-major, one
buffer a layer, as the per-layer layout's projections) and a scale per slot,
device buffers every entry takes (roles LORA_A, LORA_B, LORA_SCALE); each row picks a slot (LORA_SLOTS), slot 0
all zeros (no adapter). A projection adds scale[slot] * (x A[slot]) B[slot] to each of its rows' outputs.

`Lora` declares them for `tlaloc_jax.stage`; `decoder_lora` for the built-in decoder. The runtime writes adapters
into the slots (serve/lora_slots.py), so a new adapter needs no compile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from tlaloc_jax import artifact as af

from .config import DENSE, LINEAR, ConfigError, DecoderConfig
from .inputs import StepInputs
from .plan import layer_plan
from .kernels.quantized_matmul import out_major_product

# The projections the built-in decoder takes adapters on, by their Hugging Face module names (PEFT's
# target_modules): the attention ones in self_attn, the MLP ones in mlp, the Gated DeltaNet ones in linear_attn
# (Qwen3.5's, one projection per input).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LINEAR_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
DECODER_TARGETS = ATTENTION_TARGETS + MLP_TARGETS + LINEAR_TARGETS
# The layers whose buffers hold a target, as the decoder's layer plan groups them: an attention layer's ("attn"),
# a linear-attention layer's ("linear"), a dense MLP's ("mlp").
TARGET_GROUPS = {**dict.fromkeys(ATTENTION_TARGETS, "attn"), **dict.fromkeys(LINEAR_TARGETS, "linear"),
                 **dict.fromkeys(MLP_TARGETS, "mlp")}
HIGHEST = lax.Precision.HIGHEST
# The dtypes adapter buffers are staged in, bf16 by default: a step with an adapter row reads every slot's A and B,
# and bf16 halves those bytes (the products widen them exactly and sum in f32; an adapter is rounded to bf16 once,
# as it is written into a slot; docs/lora.md "Cost").
LORA_DTYPES = ("float32", "bfloat16")
LORA_DTYPE = "bfloat16"


@dataclass(frozen=True)
class Lora:
    """Adapter slots to stage: max_loras adapters at once (slot 0 beside them is "none"), rank at most max_rank,
    on `targets` {name: (layers, inputs, outputs)}; a step reads them as StepInputs.adapters, each row's slot as
    StepInputs.lora_slots. model_layers {name: the model's layers its buffers hold, in order}: for a target
    that only some layers have (none given: layers 0..layers-1)."""

    max_loras: int
    max_rank: int
    targets: Mapping[str, tuple[int, int, int]]
    dtype: str = "float32"
    model_layers: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def record(self) -> af.LoraShape:
        return af.LoraShape(max_loras=self.max_loras, max_rank=self.max_rank, dtype=self.dtype,
                            targets=tuple(af.LoraTarget(n, *dims, model_layers=tuple(self.model_layers.get(n, ())))
                                          for n, dims in self.targets.items()))


def decoder_lora(cfg: DecoderConfig, max_loras: int, max_rank: int, targets: tuple[str, ...] | None = None,
                 dtype: str = "float32") -> Lora:
    """The built-in decoder's adapter slots on `targets` (DECODER_TARGETS' names; None: every one the model has),
    each stacked over the layers that have it, A and B held in `dtype` (LORA_DTYPES). A model whose projections the decoder has no adapter form for
    (latent attention, experts' MLPs, interleaved linear-attention projections, fused-shard meshes) is refused by
    name."""
    if max_loras < 1 or max_rank < 1:
        raise ConfigError(f"max_loras {max_loras} and max_rank {max_rank} must be >= 1")
    if dtype not in LORA_DTYPES:
        raise ConfigError(f"lora dtype {dtype!r} is not one of {', '.join(LORA_DTYPES)} (--lora-dtype f32 or bf16)")
    plan = layer_plan(cfg, windowed=False)
    held = {"attn": plan.group_layers("attn"), "linear": plan.group_layers("linear"),
            "mlp": plan.slot_layers("layers.gate_proj") if DENSE in cfg.mlp_types else ()}
    if targets is None:
        targets = tuple(n for n in DECODER_TARGETS if held[TARGET_GROUPS[n]] and
                        not (TARGET_GROUPS[n] == "mlp" and set(cfg.mlp_types) != {DENSE}))
    unknown = sorted(set(targets) - set(DECODER_TARGETS))
    if unknown or not targets:
        raise ConfigError(f"lora target modules {unknown or list(targets)} are not ones the decoder stages adapters "
                          f"on ({', '.join(DECODER_TARGETS)})")
    groups = {TARGET_GROUPS[n] for n in targets}
    why = ("latent attention (its kv_b_proj is absorbed into the queries and outputs)" if cfg.latent else
           "mixture-of-experts MLPs" if "mlp" in groups and set(cfg.mlp_types) != {DENSE} else
           # Qwen3-Next's in_proj_qkvz and in_proj_ba interleave their parts per key head (families.py).
           "interleaved linear-attention projections" if "linear" in groups and cfg.model_type == "qwen3_next" else
           "a tensor-parallel shard" if cfg.shard_axis else "")
    if why:
        raise ConfigError(f"{cfg.model_type} has {why}, which take no LoRA adapters yet; stage it without "
                          "max_loras (--max-loras)")
    missing = sorted(n for n in targets if not held[TARGET_GROUPS[n]])
    if missing:
        raise ConfigError(f"lora target modules {missing} name projections {cfg.model_type} has in no layer; drop "
                          "them from --lora-target-modules")
    E, F, H, K, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lin = cfg.linear
    # A gated query's q_proj holds, per head, the query then the gate (as the checkpoint's): its B is [2 H D, r].
    dims = {"q_proj": (E, H * D * (2 if cfg.attention.output_gate else 1)), "k_proj": (E, K * D),
            "v_proj": (E, K * D), "o_proj": (H * D, E), "gate_proj": (E, F), "up_proj": (E, F), "down_proj": (F, E)}
    if LINEAR in cfg.layer_types:
        HvDv = lin.value_heads * lin.value_dim
        dims.update(in_proj_qkv=(E, lin.conv_channels), in_proj_z=(E, HvDv), in_proj_b=(E, lin.value_heads),
                    in_proj_a=(E, lin.value_heads), out_proj=(HvDv, E))
    chosen = [n for n in DECODER_TARGETS if n in targets]
    layers = {n: held[TARGET_GROUPS[n]] for n in chosen}
    return Lora(max_loras, max_rank, {n: (len(layers[n]), *dims[n]) for n in chosen}, dtype,
                model_layers={n: ids for n, ids in layers.items() if ids != tuple(range(cfg.num_layers))})


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerAdapters:
    """One layer's adapters and the call's token slots: ab {target: (A [S, R, I], B [O, S, R])}, scale [S],
    slots [B, T] (each token's row's slot)."""

    ab: dict
    scale: jax.Array
    slots: jax.Array


def layer_adapters(adapters: Mapping[str, jax.Array], slots: jax.Array, index: Mapping[str, object]) -> LayerAdapters:
    """A layer's adapters from the staged buffers (StepInputs.adapters: "<target>.a" and "<target>.b", a tuple of
    each held layer's [S, R, I] and [O, S, R]; "scale" [S]): index {group: the layer's place among the layers of
    that TARGET_GROUPS group}, for the groups the layer has. A scan's traced index (the stacked layout) reads
    them stacked, a copy per call; the per-layer layout reads each layer's buffer in place."""
    def pick(arrays, at):
        return arrays[at] if isinstance(at, int) else lax.dynamic_index_in_dim(jnp.stack(arrays), at, keepdims=False)
    names = sorted({k.rsplit(".", 1)[0] for k in adapters if k != "scale"})
    return LayerAdapters({n: (pick(adapters[f"{n}.a"], index[TARGET_GROUPS[n]]),
                              pick(adapters[f"{n}.b"], index[TARGET_GROUPS[n]]))
                          for n in names if TARGET_GROUPS[n] in index}, adapters["scale"], slots)


def plan_index(lp, i) -> dict:
    """layer_adapters' index of plan layer lp (tlaloc_jax.plan.LayerPlan) at scan step i: its place among its
    attention group's layers, and among the dense-MLP layers where its MLP is dense."""
    return {lp.group: lp.weights.index(i), **({"mlp": lp.mlp_weights.index(i)} if lp.mlp == DENSE else {})}


def delta(la: LayerAdapters | None, name: str, x: jax.Array) -> jax.Array | None:
    """x: [B, T, I] -> the adapters' [B, T, O] f32 for projection `name` (None where it takes none).

    Every token is multiplied by all slots' A at once (the slots' ranks side by side, [S * R, I] out-major: one
    projection of S * R outputs), keeps its own slot's part (scaled; the others zeroed), and that is multiplied by
    all slots' B ([O, S * R]): two projections in the platform's fastest form (the C kernel where the export turned
    it on, kernels/projection_native.py), for decode rows and prompt tokens alike. A call none of whose rows has an
    adapter skips both (lax.cond): it pays the check of its slots alone."""
    if la is None or name not in la.ab:
        return None
    a, b = la.ab[name]
    (B, T, I), (S, R, _), O = x.shape, a.shape, b.shape[0]
    flat, slots = x.reshape(B * T, I), la.slots.reshape(-1)

    def products(flat, a, b):
        xa = out_major_product(flat, a.reshape(S * R, I), reduce_one_row=a.dtype != jnp.float32)
        keep = jax.nn.one_hot(slots, S, dtype=jnp.float32) * la.scale[slots][:, None]
        xa = (xa.reshape(B * T, S, R) * keep[:, :, None]).reshape(B * T, S * R)
        return out_major_product(xa, b.reshape(O, S * R), reduce_one_row=b.dtype != jnp.float32)

    y = lax.cond(jnp.any(slots > 0), products, lambda *_: jnp.zeros((B * T, O), jnp.float32), flat, a, b)
    return y.reshape(B, T, O)


def query_deltas(cfg: DecoderConfig, la: LayerAdapters | None,
                 x: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
    """q_proj's adapters' delta for the query [B, T, H D] and for the output gate (None without one): a gated
    query's q_proj holds, per head, the query then the gate, and so does its adapter's B (PEFT's [2 H D, r])."""
    d = delta(la, "q_proj", x)
    if d is None or not cfg.attention.output_gate:
        return d, None
    B, T, _ = x.shape
    d = d.reshape(B, T, cfg.num_heads, 2, cfg.head_dim)
    return d[..., 0, :].reshape(B, T, -1), d[..., 1, :].reshape(B, T, -1)


def plus(y: jax.Array, d: jax.Array | None) -> jax.Array:
    """A projection's output y with its adapters' delta d added (d None: y as it is)."""
    return y if d is None else y + d


def call_adapters(inputs: StepInputs | tuple[StepInputs, ...]) -> tuple[dict | None, jax.Array | None]:
    """A call's adapter buffers and each token's slot, laid out as the call's tokens (mixed: [1, N]); (None, None)
    without adapters."""
    gs = (inputs,) if isinstance(inputs, StepInputs) else inputs
    if gs[0].adapters is None:
        return None, None
    slots = [token_slots(g.lora_slots, g.token_ids, g.pack_index) for g in gs]
    return gs[0].adapters, slots[0] if len(gs) == 1 else jnp.concatenate([s.reshape(1, -1) for s in slots], 1)


def token_slots(lora_slots: jax.Array, token_ids: jax.Array, pack_index: jax.Array | None) -> jax.Array:
    """Each token's slot [B, T] (a packed call's [1, N]) from each row's lora_slots [B]: a packed call's tokens
    take their row's through PACK_INDEX (padding tokens slot 0)."""
    if pack_index is None:
        return jnp.broadcast_to(lora_slots[:, None], token_ids.shape)
    n = token_ids.shape[1]
    rows = jnp.broadcast_to(lora_slots[:, None], pack_index.shape)
    return jnp.zeros((n,), jnp.int32).at[pack_index].set(rows, mode="drop")[None]


def signature(shape: af.LoraShape, rows: int) -> tuple[list[af.TensorSig], list[af.TensorSig]]:
    """An entry's LoRA inputs: (LORA_SLOTS [rows], after the step's other inputs; each target's LORA_A and LORA_B,
    then LORA_SCALE, after the weights)."""
    adapters = [af.TensorSig(role, "float32" if role == af.Role.LORA_SCALE else shape.dtype, dims, slot)
                for role, slot, dims in shape.buffers()]
    return [af.TensorSig(af.Role.LORA_SLOTS, "int32", (rows,))], adapters


def step_fields(args: Mapping[tuple[af.Role, str], jax.Array]) -> dict:
    """An entry's LoRA arguments {(role, slot): array} -> StepInputs' lora_slots and adapters ({} without):
    {"<target>.a": (each layer's A, ...), "<target>.b": (...), "scale": [S]}."""
    if not args:
        return {}
    layers: dict[str, dict[int, jax.Array]] = {}
    for (role, slot), a in args.items():
        if role in (af.Role.LORA_A, af.Role.LORA_B):
            name, _, layer = slot.rpartition(".")
            layers.setdefault(f"{name}.{'a' if role == af.Role.LORA_A else 'b'}", {})[int(layer)] = a
    adapters = {key: tuple(by[i] for i in range(len(by))) for key, by in layers.items()}
    adapters["scale"] = args[(af.Role.LORA_SCALE, "")]
    return {"lora_slots": args[(af.Role.LORA_SLOTS, "")], "adapters": adapters}
