"""How a decoder's layer weights are laid out for a body: stacked (scanned) or one array per layer (unrolled).

The decoder reads either form (`decoder.final_hidden`):

- "stacked": one [L', ...] array per slot of a weight group ("layers", "attn", "linear"), and a `lax.scan` over
  the layer periods that indexes each stack with the scan's counter. One period's layers are in the graph, so
  compiles are short; it is the form training uses.
- "per-layer": a tuple of L' arrays per slot, and the layer loop unrolled with static indices. On XLA's CPU
  backend a dot cannot read a dynamic slice of its operand in place: the scanned form copies every layer's
  weights into a temporary before each dot (a `dynamic-slice` loop fusion as large as the weight), so a decode
  step reads each weight byte twice and writes it once. Separate arrays are read by the dot directly
  (bench/decode.py --weight-layout measures both). The per-layer form also fuses q | k | v into one
  [E, (H + 2K) * D] projection and gate | up into one [E, 2F] (split in the body): one matrix-vector kernel
  where there were three, or two. And it stores the projections that `layers.linear` reads (LINEAR_SLOTS,
  the output head too) [O, I], as torch does (layers.OutMajor; quantized codes likewise): on XLA's CPU backend a
  projection of a few rows then runs as a multiply-reduce that streams the weight once (bench/dot_forms.py, deleted in 82403e3), and
  a bf16 or quantized one widens its values in registers instead of into a weight-sized f32 copy.
"""

from __future__ import annotations

import re
from typing import Mapping

import jax
import numpy as np

from tlaloc_jax.kernels.quantized_matmul import QuantizedWeight, to_out_major

from .layers import OutMajor

LAYOUTS = ("per-layer", "stacked")
# The weight groups whose slots stack the layers (decoder._layer_slice reads them by layer).
LAYER_GROUPS = ("layers", "attn", "linear")
# Fused slot <- the slots it joins along the output axis, in order; within the group of the first name's prefix.
FUSED = {
    "attn.qkv_proj": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    "attn.qkv_bias": ("attn.q_bias", "attn.k_bias", "attn.v_bias"),
    "layers.gate_up_proj": ("layers.gate_proj", "layers.up_proj"),
}


# The slots `layers.linear` reads (stacked names, fused ones included): the per-layer layout stores them [O, I].
# Not the router and the experts, which kernels.moe reads itself.
LINEAR_SLOTS = ("attn.qkv_proj", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.gate_proj", "attn.o_proj",
                "attn.q_a_proj", "attn.q_b_proj", "attn.kv_a_proj",
                "layers.gate_up_proj", "layers.gate_proj", "layers.up_proj", "layers.down_proj",
                "linear.in_qkv", "linear.in_z", "linear.in_b", "linear.in_a", "linear.out_proj", "head")


def fuse_projections(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stacked weights with q | k | v and gate | up joined along their last (output) axis where all the parts
    are present; every other slot as it was. Quantized in-major parts (a pre-quantized checkpoint's) of one scheme
    and group are joined leaf by leaf (codes, scales and zeros all end in the output axis); others stay apart."""
    out = dict(weights)
    for fused, parts in FUSED.items():
        if not all(p in out for p in parts):
            continue
        ws = [out[p] for p in parts]
        quant = {(w.scheme, w.group, w.compute, w.out_major) if isinstance(w, QuantizedWeight) else None for w in ws}
        if quant == {None}:
            out[fused] = np.concatenate([np.asarray(out.pop(p)) for p in parts], axis=-1)
        elif len(quant) == 1 and not next(iter(quant))[3]:
            out[fused] = jax.tree.map(lambda *a: np.concatenate(a, axis=-1), *ws)
            for p in parts:
                del out[p]
    return out


def unstack_layers(weights: Mapping[str, object]) -> dict[str, object]:
    """Stacked weights -> the per-layer form: each layer group's [L', ...] slot becomes a tuple of its L'
    layers' arrays (contiguous copies, so each is a weight file of its own; a quantized weight's codes and
    scales alike); other slots are unchanged."""
    out: dict[str, object] = {}
    for name, w in weights.items():
        if name.split(".", 1)[0] in LAYER_GROUPS:
            leaves = jax.tree.leaves(w)
            out[name] = tuple(jax.tree.map(lambda a, i=i: np.ascontiguousarray(np.asarray(a)[i]), w)
                              for i in range(np.shape(leaves[0])[0]))
        else:
            out[name] = w
    return out


def out_major(weights: Mapping[str, object]) -> dict[str, object]:
    """The LINEAR_SLOTS' weights (each layer's, in the per-layer form) stored [O, I]: float arrays as
    layers.OutMajor, quantized ones with out-major codes (kernels.quantized_matmul.to_out_major); every other slot
    as it was."""
    def flip(w):
        if isinstance(w, (tuple, list)):
            return tuple(flip(a) for a in w)
        if isinstance(w, (np.ndarray, jax.Array)):
            return OutMajor(np.ascontiguousarray(np.swapaxes(np.asarray(w), -1, -2)))
        if isinstance(w, QuantizedWeight):
            return to_out_major(w)
        return w
    return {name: flip(w) if name in LINEAR_SLOTS else w for name, w in weights.items()}


def per_layer(weights: Mapping[str, np.ndarray]) -> dict[str, object]:
    """The per-layer form of stacked weights: fused projections, one array per layer, projections [O, I]."""
    return out_major(unstack_layers(fuse_projections(weights)))


def in_layout(weights: Mapping[str, np.ndarray], layout: str) -> Mapping[str, object]:
    """Stacked weights in `layout` (one of LAYOUTS)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}: one of {', '.join(LAYOUTS)}")
    return per_layer(weights) if layout == "per-layer" else weights


def is_per_layer(weights: Mapping[str, object]) -> bool:
    """Whether the decoder's layer weights come one array per layer (tuples) rather than stacked."""
    return any(isinstance(w, (tuple, list)) for name, w in weights.items()
               if name.split(".", 1)[0] in LAYER_GROUPS)


_SLICE_FUSION = re.compile(r"%(\S*dynamic-slice\S*fusion\S*) = (\w+)\[([\d,]*)\]")
_ITEM_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "f8e4m3fn": 1, "s32": 4}


def weight_slice_copies(hlo_text: str, min_bytes: int) -> list[int]:
    """The byte sizes of the dynamic-slice fusions in an optimized HLO module whose result holds at least
    min_bytes: on XLA's CPU backend, the layer weights a scanned body copies out of their stacks before each dot
    (none in a per-layer body)."""
    sizes = []
    for m in _SLICE_FUSION.finditer(hlo_text):
        n = _ITEM_BYTES.get(m.group(2), 4)
        for d in m.group(3).split(","):
            n *= int(d) if d else 1
        if n >= min_bytes:
            sizes.append(n)
    return sizes
