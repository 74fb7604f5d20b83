"""The quality check's wrong-axis control (the seed's): int8 codes rounded against per-input-channel scales, stored
with the per-output-channel scales. Test and bench code only: the library's quantizer has no such mode."""

from __future__ import annotations

import contextlib

import numpy as np

from tlaloc_jax.export import _artifact
from tlaloc_jax.export._quant import quantize_weights
from tlaloc_jax.kernels.quantized_matmul import QuantizedWeight, quantize_array


def wrong_axis(w, right: QuantizedWeight) -> QuantizedWeight:
    """`right` (w's int8 quantization, [..., I, O]) with its codes rounded along the input axis instead."""
    if right.scheme != "int8":
        raise ValueError(f"the wrong-axis control quantizes int8 only, not {right.scheme}")
    along_inputs = quantize_array(np.swapaxes(np.asarray(w, np.float32), -1, -2), "int8", compute=right.compute)
    return QuantizedWeight(np.ascontiguousarray(np.swapaxes(np.asarray(along_inputs.codes), -1, -2)), right.scales,
                           right.scheme, right.group, right.compute)


def wrong_axis_weights(weights, scheme: str, group: int, *, compute: str) -> dict:
    """quantize_weights(weights, ...) with every quantized projection's codes on the wrong axis."""
    out = quantize_weights(weights, scheme, group, compute=compute)
    return {name: wrong_axis(weights[name], q) if isinstance(q, QuantizedWeight) else q for name, q in out.items()}


@contextlib.contextmanager
def wrong_axis_export():
    """export_checkpoint quantizes with wrong_axis_weights inside the block."""
    saved = _artifact.quantize_weights
    _artifact.quantize_weights = wrong_axis_weights
    try:
        yield
    finally:
        _artifact.quantize_weights = saved
