"""A checkpoint's weights as the artifact stores them: streamed (each weight file read, converted, quantized and
written a layer's tensor at a time) or loaded (the whole model in host memory first).

Both give the same slots, order, dtypes and bytes: the per-layer layout fuses q | k | v and gate | up and stores the
projections [O, I] (tlaloc_jax/layout.py), a quantization replaces the projections by codes and scales
(export/_quant.py), computed from each tensor's values in f32; everything else is cast to the weight dtype. A
pre-quantized checkpoint's linears (tlaloc_jax/prequantized.py) are read as their stored codes, scales and zero
points, a layer's tensor at a time too.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tlaloc_jax import artifact as af
from tlaloc_jax import prequantized
from tlaloc_jax.checkpoint import TensorIndex, load_weights, read_config, read_slot, weight_dtype
from tlaloc_jax.config import DecoderConfig
from tlaloc_jax.families import Family, stack_layers
from tlaloc_jax.kernels.quantized_matmul import (QuantError, QuantizedWeight, check_scheme, quantize, quantize_array,
                                                 to_out_major, unpack_int4)
from tlaloc_jax.layers import OutMajor
from tlaloc_jax.layout import FUSED, LAYER_GROUPS, LINEAR_SLOTS, fuse_projections, out_major, unstack_layers

from ._entries import ExportError
from ._lazy import LazyWeight
from ._quant import QUANTIZED_SLOTS, WEIGHT_QUANT, quantize_weights
from ._timing import timed


def loaded_weights(checkpoint_dir: str | os.PathLike, fam: Family, cfg: DecoderConfig, *, dtype: str,
                   layout: str, quant: str, group: int, head: str = "none") -> dict[str, Any]:
    """Every weight read into host memory, then fused, quantized and laid out: the model's size several times over
    (f32 when quantized, and stacked). Kept for tensor-parallel staging, which splits host arrays, and as the
    reference the streamed weights are tested against."""
    quantized = quant != "none"
    weights = load_weights(checkpoint_dir, fam, cfg, "float32" if quantized else dtype)
    if layout == "per-layer":
        weights = fuse_projections(weights)     # before quantizing: the fused projection gets its own scales
    if quantized:
        weights = quantize_weights(weights, quant, group, compute=dtype, head=head)
    if layout == "per-layer":
        weights = out_major(unstack_layers(weights))
    return weights


class _LastQuantized:
    """Makes one layer's quantized tensor (produce(i): quantized here, or read as a checkpoint stores it) and keeps
    its parts (codes, scales, zero points) until their files take them (a weight's parts are adjacent files): one
    tensor's codes in memory, plus the small scales and zero points of a stacked slot still to be written."""

    def __init__(self, produce: Callable[[int | None], QuantizedWeight], scheme: str):
        self.produce, self.scheme = produce, scheme
        self.pending: dict[tuple[int | None, str], np.ndarray] = {}

    def take(self, part: str, i: int | None) -> np.ndarray:
        if (i, part) not in self.pending:
            self.pending = {k: v for k, v in self.pending.items() if k[0] != i}
            q = self.produce(i)
            self.pending.update({(i, p): getattr(q, p) for p in af.QUANT_PARTS[self.scheme]})
        return self.pending.pop((i, part))


def _quantizer(read: Callable[..., np.ndarray], scheme: str, group: int, compute: str, flip: bool) -> Callable:
    """produce(i) for a float tensor quantized here: layer i read in f32 and quantized (flip: out-major)."""
    def produce(i: int | None) -> QuantizedWeight:
        fast = scheme in _STORED_SCHEMES
        w = read(i, out_major=fast)        # as stored [O, I]: XLA transposes it, faster than numpy
        with timed("quantize"):
            if fast:
                codes, scales = _quantize_stored(w, scheme, group, compute, flip)
                return QuantizedWeight(np.asarray(codes), np.asarray(scales), scheme, group, compute, out_major=flip)
            q = quantize_array(w, scheme, group, compute=compute)
            return to_out_major(q) if flip else q
    return produce


def _stored_reader(slot: str, read: Callable, flip: bool) -> Callable:
    """produce(i) for a linear a pre-quantized checkpoint stores: layer i's codes, scales and zero points as read
    (flip: out-major, as layout.out_major lays the loaded ones out)."""
    def produce(i: int | None) -> QuantizedWeight:
        q = _expect(read(i), True, slot, i)
        with timed("convert"):
            return to_out_major(q) if flip else q
    return produce


def _expect(w, quantized: bool, slot: str, i: int | None):
    """w, a layer's tensor of a slot whose first layer was (quantized) stored quantized or not: refused if it differs,
    as loading refuses a slot's layers in different formats."""
    if isinstance(w, QuantizedWeight) != quantized:
        how = "stored quantized" if quantized else "stored as floats"
        raise ExportError(f"weight {slot!r}: layer {i} is {'not ' if quantized else ''}stored quantized, its first "
                          f"layer {how}; every layer of a slot must be quantized alike")
    return w


def _timed_read(index, fam: Family, spec, cfg: DecoderConfig, i: int | None, *, dtype: np.dtype,
                out_major: bool = False, qc=None):
    with timed("read"):
        return read_slot(index, fam, spec, cfg, i, dtype, out_major, qc)


def _joined(reads: list[Callable], i: int | None, out_major: bool = False) -> np.ndarray:
    """Fused parts of one layer joined along the output axis (the last, or the first of [O, I]); pre-quantized
    parts (in-major QuantizedWeights, as layout.fuse_projections joins them) leaf by leaf along the last."""
    parts = [r(i, out_major=out_major) for r in reads]
    with timed("convert"):
        if isinstance(parts[0], QuantizedWeight):
            return jax.tree.map(lambda *a: np.concatenate(a, axis=-1), *parts)
        return np.concatenate(parts, axis=-2 if out_major else -1)


_STORED_SCHEMES = (af.QuantScheme.INT8, af.QuantScheme.FP8, af.QuantScheme.INT4)


@functools.partial(jax.jit, static_argnames=("scheme", "group", "compute", "flip"))
def _quantize_stored(w_oi, scheme: str, group: int, compute: str, flip: bool):
    """quantize_array of a weight given as stored, [..., O, I], and with flip to_out_major of the result, in one
    XLA program: the same codes and scales, without numpy's slow transposes of a whole tensor."""
    q = quantize(jnp.swapaxes(w_oi, -1, -2), scheme, group, compute=compute)
    if not flip:
        return q.codes, q.scales
    if scheme != af.QuantScheme.INT4:
        return jnp.swapaxes(q.codes, -1, -2), q.scales
    c = jnp.moveaxis(unpack_int4(q.codes, group), -1, -4)                           # [..., O, G, 2, g/2]
    low, high = (lax.bitcast_convert_type(c[..., k, :], jnp.uint8) for k in (0, 1))
    codes = lax.bitcast_convert_type((low & 0x0F) | (high << 4), jnp.int8).reshape(*c.shape[:-3], -1)
    return codes, jnp.swapaxes(q.scales, -1, -2)


def _quantized_shapes(shape: tuple[int, ...], scheme: str, group: int, compute: str, flip: bool):
    """{part: (shape, dtype)} of one tensor's codes, scales (and zero points), from an abstract evaluation."""
    q = jax.eval_shape(functools.partial(quantize, scheme=scheme, group=group, compute=compute),
                       jax.ShapeDtypeStruct(shape, np.float32))
    out = {}
    for part in af.QUANT_PARTS[scheme]:
        a = getattr(q, part)
        s = tuple(a.shape)
        # to_out_major: codes [..., O, I or I/2]; grouped schemes' scales and zero points [..., O, G]
        if flip and (part == "codes" or scheme in af.GROUPED_SCHEMES):
            s = (*s[:-2], s[-1], s[-2])
        out[part] = (s, np.dtype(a.dtype))
    return out


# A leaf maker takes where the weight file comes from: a layer index (one layer's tensor), None (a whole tensor) or a
# tuple of layer indices (a stacked slot, written a layer at a time).
def _float_leaf(slot: str, shape: tuple[int, ...], read: Callable, dtype: np.dtype, flip: bool) -> Callable:
    def load(i):
        a = _expect(read(i, out_major=flip), False, slot, i)   # a linear stored [O, I] is read as the checkpoint holds it
        with timed("convert"):
            return np.ascontiguousarray(a.astype(dtype, copy=False))

    def make(at):
        if isinstance(at, tuple):
            return LazyWeight((len(at), *shape), dtype, parts=lambda: (load(i)[None] for i in at))
        if flip:        # stored [O, I] (tlaloc_jax/layout.py)
            return OutMajor(LazyWeight((*shape[:-2], shape[-1], shape[-2]), dtype, loader=lambda: load(at)))
        return LazyWeight(shape, dtype, loader=lambda: load(at))
    return make


def _quantized_leaf(slot: str, layers: tuple[int, ...], shape: tuple[int, ...], produce: Callable, scheme: str,
                    group: int, compute: str, flip: bool) -> Callable:
    """produce(i): layer i's QuantizedWeight (_quantizer, _stored_reader), its parts' shapes those quantize gives
    `shape` (a pre-quantized checkpoint's are read into the same formats)."""
    try:
        check_scheme(scheme, group, shape[-2])
    except QuantError as e:
        raise ExportError(f"weight {slot!r} {list((len(layers), *shape) if layers else shape)}: {e}") from None
    shapes = _quantized_shapes(shape, scheme, group, compute, flip)
    q = _LastQuantized(produce, scheme)

    def part(name: str, at):
        (s, dt), take = shapes[name], functools.partial(q.take, name)
        if isinstance(at, tuple):
            return LazyWeight((len(at), *s), dt, parts=lambda: (take(i)[None] for i in at))
        return LazyWeight(s, dt, loader=lambda: take(at))

    def make(at):
        parts = {name: part(name, at) for name in shapes}
        return QuantizedWeight(parts["codes"], parts["scales"], scheme, group, compute, out_major=flip,
                               zeros=parts.get("zeros"))
    return make


def streamed_weights(checkpoint_dir: str | os.PathLike, fam: Family, cfg: DecoderConfig, *, dtype: str,
                     layout: str, quant: str, group: int, head: str = "none") -> dict[str, Any]:
    """The same weights as loaded_weights as LazyWeight leaves: each weight file is read from the checkpoint (a
    layer's tensor, or one layer of a stacked slot at a time), converted, quantized and laid out when written, so the
    export holds about one tensor at a time. Shapes come from the family table, dtypes and quantized shapes from an
    abstract evaluation: tracing needs no values. A pre-quantized checkpoint's linears are read as stored (in the
    formats load_weights reads them into) and exported with quant "none". head: the output head's scheme
    (_quant.head_quant_for), with quant only."""
    if quant not in WEIGHT_QUANT:
        raise ExportError(f"weight quantization {quant!r} is not one of {', '.join(WEIGHT_QUANT)}")
    index, np_dtype, per_layer = TensorIndex(Path(checkpoint_dir)), weight_dtype(dtype), layout == "per-layer"
    qc = prequantized.quant_config(read_config(checkpoint_dir))
    quantized = quant != "none"
    q_group = group if quant in af.GROUPED_SCHEMES else 0

    def quantizes(slot: str) -> bool:
        return quantized and (slot in QUANTIZED_SLOTS or (slot == "head" and head != "none"))

    def read_dtype(slot: str) -> np.dtype:
        return np.dtype(np.float32) if quantizes(slot) else np_dtype

    # slot -> (the layers it stacks, or (); one layer's shape; read(layer) in the dtype the slot is read in; whether
    # its first layer is stored quantized)
    sources: dict[str, tuple[tuple[int, ...], tuple[int, ...], Callable, bool]] = {}
    fused_parts = {p for parts in FUSED.values() for p in parts} if per_layer else set()
    for spec in fam.slots(cfg):
        fused = next((f for f, parts in FUSED.items() if spec.slot in parts), spec.slot) if per_layer else spec.slot
        dt = read_dtype(fused if spec.slot in fused_parts else spec.slot)
        read = functools.partial(_timed_read, index, fam, spec, cfg, dtype=dt, qc=qc)
        layers = stack_layers(spec.slot, cfg)
        first = spec.hf.format(p=fam.prefix, i=layers[0] if layers else None, e=0)
        stored = prequantized.is_stored(index.file_of, first, qc) and qc.scheme is not None
        sources[spec.slot] = (layers, spec.layer_shape(cfg), read, stored)
    if per_layer:
        for fused, parts in FUSED.items():
            # parts stored alike are joined (layout.fuse_projections); quantized and float ones stay apart
            if all(p in sources for p in parts) and len({sources[p][3] for p in parts}) == 1:
                srcs = [sources.pop(p) for p in parts]
                shape = (*srcs[0][1][:-1], sum(s[1][-1] for s in srcs))
                sources[fused] = (srcs[0][0], shape, functools.partial(_joined, [s[2] for s in srcs]), srcs[0][3])

    out: dict[str, Any] = {}
    for slot, (layers, shape, read, stored) in sources.items():
        flip = per_layer and slot in LINEAR_SLOTS
        if stored:
            make = _quantized_leaf(slot, layers, shape, _stored_reader(slot, read, flip), qc.scheme, qc.group,
                                   dtype, flip)
        elif quantizes(slot):
            scheme, g = (head, 0) if slot == "head" else (quant, q_group)
            make = _quantized_leaf(slot, layers, shape, _quantizer(read, scheme, g, dtype, flip), scheme, g, dtype,
                                   flip)
        else:
            make = _float_leaf(slot, shape, read, np_dtype, flip)
        unstack = per_layer and layers and slot.split(".", 1)[0] in LAYER_GROUPS
        out[slot] = tuple(make(i) for i in layers) if unstack else make(layers or None)
    return out
