"""LoRA adapters as slots: each target projection's A [N + 1, R, I] and B [O, N + 1, R] per layer (out-major, one
buffer a layer, as the per-layer layout's projections) and a scale per slot,
device buffers every entry takes (roles LORA_A, LORA_B, LORA_SCALE); each row picks a slot (LORA_SLOTS), slot 0
all zeros (no adapter). A projection adds scale[slot] * (x A[slot]) B[slot] to each of its rows' outputs.

`Lora` declares them for `tlaloc_jax.stage`; `decoder_lora` for the built-in decoder. The runtime writes adapters
into the slots (serve/lora_slots.py), so a new adapter needs no compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from tlaloc_jax import artifact as af

from .config import DENSE, LINEAR, ConfigError, DecoderConfig
from .kernels.quantized_matmul import out_major_product

# The projections the built-in decoder takes adapters on, by their Hugging Face module names (PEFT's
# target_modules); the attention ones in self_attn, the MLP ones in mlp.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
DECODER_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
HIGHEST = lax.Precision.HIGHEST


@dataclass(frozen=True)
class Lora:
    """Adapter slots to stage: max_loras adapters at once (slot 0 beside them is "none"), rank at most max_rank,
    on `targets` {name: (layers, inputs, outputs)}; a step reads them as StepInputs.adapters, each row's slot as
    StepInputs.lora_slots."""

    max_loras: int
    max_rank: int
    targets: Mapping[str, tuple[int, int, int]]
    dtype: str = "float32"

    def record(self) -> af.LoraShape:
        return af.LoraShape(max_loras=self.max_loras, max_rank=self.max_rank, dtype=self.dtype,
                            targets=tuple(af.LoraTarget(n, *dims) for n, dims in self.targets.items()))


def decoder_lora(cfg: DecoderConfig, max_loras: int, max_rank: int,
                 targets: tuple[str, ...] = DECODER_TARGETS) -> Lora:
    """The built-in decoder's adapter slots on `targets` (DECODER_TARGETS' names), each stacked over every layer.
    A model whose projections the decoder has no adapter form for (linear or latent attention, a gated query,
    experts, fused-shard meshes) is refused by name."""
    if max_loras < 1 or max_rank < 1:
        raise ConfigError(f"max_loras {max_loras} and max_rank {max_rank} must be >= 1")
    unknown = sorted(set(targets) - set(DECODER_TARGETS))
    if unknown or not targets:
        raise ConfigError(f"lora target modules {unknown or list(targets)} are not ones the decoder stages adapters "
                          f"on ({', '.join(DECODER_TARGETS)})")
    why = ("linear-attention layers" if LINEAR in cfg.layer_types else "latent attention" if cfg.latent else
           "a gated query projection" if cfg.attention.output_gate else
           "mixture-of-experts MLPs" if set(targets) & set(MLP_TARGETS) and set(cfg.mlp_types) != {DENSE} else
           "a tensor-parallel shard" if cfg.shard_axis else "")
    if why:
        raise ConfigError(f"{cfg.model_type} has {why}, which take no LoRA adapters yet; stage it without "
                          "max_loras (--max-loras)")
    E, F, H, K, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dims = {"q_proj": (E, H * D), "k_proj": (E, K * D), "v_proj": (E, K * D), "o_proj": (H * D, E),
            "gate_proj": (E, F), "up_proj": (E, F), "down_proj": (F, E)}
    return Lora(max_loras, max_rank, {n: (cfg.num_layers, *dims[n]) for n in DECODER_TARGETS if n in targets})


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerAdapters:
    """One layer's adapters and the call's token slots: ab {target: (A [S, R, I], B [O, S, R])}, scale [S],
    slots [B, T] (each token's row's slot)."""

    ab: dict
    scale: jax.Array
    slots: jax.Array


def layer_adapters(adapters: Mapping[str, jax.Array], slots: jax.Array, layer) -> LayerAdapters:
    """Layer `layer`'s adapters from the staged buffers (StepInputs.adapters: "<target>.a" and "<target>.b", a tuple of
    each layer's [S, R, I] and [O, S, R]; "scale" [S]). A scan's traced layer index (the stacked layout) reads them
    stacked, a copy per call; the per-layer layout reads each layer's buffer in place."""
    def pick(arrays):
        return arrays[layer] if isinstance(layer, int) else lax.dynamic_index_in_dim(jnp.stack(arrays), layer,
                                                                                      keepdims=False)
    names = sorted({k.rsplit(".", 1)[0] for k in adapters if k != "scale"})
    return LayerAdapters({n: (pick(adapters[f"{n}.a"]), pick(adapters[f"{n}.b"])) for n in names},
                         adapters["scale"], slots)


def delta(la: LayerAdapters | None, name: str, x: jax.Array) -> jax.Array | None:
    """x: [B, T, I] -> the adapters' [B, T, O] f32 for projection `name` (None where it takes none).

    Every token is multiplied by all slots' A at once (the slots' ranks side by side, [S * R, I] out-major: one
    projection of S * R outputs), keeps its own slot's part (scaled; the others zeroed), and that is multiplied by
    all slots' B ([O, S * R]): two projections in the platform's fastest form (the C kernel where the export turned
    it on, kernels/projection_native.py), no gather, for decode rows and prompt tokens alike."""
    if la is None or name not in la.ab:
        return None
    a, b = la.ab[name]
    (B, T, I), (S, R, _), O = x.shape, a.shape, b.shape[0]
    xa = out_major_product(x.reshape(B * T, I), a.reshape(S * R, I), reduce_one_row=a.dtype != jnp.float32)
    keep = jax.nn.one_hot(la.slots.reshape(-1), S, dtype=jnp.float32) * la.scale[la.slots.reshape(-1)][:, None]
    xa = (xa.reshape(B * T, S, R) * keep[:, :, None]).reshape(B * T, S * R)
    y = out_major_product(xa, b.reshape(O, S * R), reduce_one_row=b.dtype != jnp.float32)
    return y.reshape(B, T, O)


def plus(y: jax.Array, d: jax.Array | None) -> jax.Array:
    """A projection's output y with its adapters' delta d added (d None: y as it is)."""
    return y if d is None else y + d


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
