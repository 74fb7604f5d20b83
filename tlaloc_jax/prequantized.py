"""Pre-quantized Hugging Face checkpoints: the `quantization_config` of config.json, and each quantized linear's
tensors read into the artifact's formats as stored (tlaloc_jax/kernels/quantized_matmul.py; no dequantize and
requantize round trip):

* GPTQ (`quant_method: gptq`, 4 bits, groups of 32, 64 or 128): qweight int32 [I / 8, O], 8 codes an int32 along
  the input, low bits first; qzeros int32 [G, O / 8] packed the same way along the output; scales fp16 [G, O];
  g_idx [I]. `checkpoint_format` "gptq" (v1, AutoGPTQ's) stores zero - 1, "gptq_v2" the zero itself. sym -> int4
  (codes q - 8: every zero point must be 8), else uint4. A g_idx other than i // group (desc_act's permuted
  groups) is refused.
* AWQ (`quant_method: awq`, `version: gemm`, 4 bits): qweight int32 [I, O / 8] packed along the output, nibble j
  of word c holding output 8c + AWQ_ORDER[j]; qzeros int32 [G, O / 8] likewise; scales fp16 [G, O] -> uint4.
* compressed-tensors (`format: pack-quantized`, int weights only): weight_packed int32 [O, I * bits / 32], codes
  stored as q + 2^(bits-1) along the input, low bits first; weight_scale [O, G] (group) or [O, 1] (channel);
  weight_zero_point (asymmetric) int32 [O / 8, G], the signed zero points + 8 packed along the output. 4 bits in
  groups -> int4 (symmetric) or uint4 (code q + 8, zero zp + 8); 8 bits per channel, symmetric -> int8.
* FP8 with block scales (`quant_method: fp8`, `weight_block_size` [bo, bi]): weight float8_e4m3fn [O, I],
  weight_scale_inv f32 [O / bo, I / bi]. The artifact's fp8 has one scale per output channel, which cannot hold a
  scale per input block exactly: the weight is dequantized (W = code * scale in float64, one rounding to the
  export's weight dtype) and served as a float weight (docs/quantization.md).

Anything else (another method, bits, group size, format, version, activation quantization) is refused by the
field's name and value. A linear whose quantized tensors are absent (lm_head, an ignored module) is read as a
float tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np

from .artifact import QUANT_GROUPS, QuantScheme
from .config import CheckpointError
from .hf_config import PREQUANTIZED_METHODS as METHODS
from .kernels.quantized_matmul import QuantizedWeight, pack_int4
# AutoAWQ's packing order: nibble j of an int32 holds output 8c + AWQ_ORDER[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class QuantConfig:
    """What config.json's quantization_config says, checked. marker: the tensor suffix whose presence says a linear
    is stored quantized."""

    method: str
    bits: int = 4
    group: int = 0              # input channels per scale; 0: per output channel
    sym: bool = False
    zero_offset: int = 0        # added to a stored zero point (GPTQ v1: 1)
    block: tuple[int, int] = (0, 0)

    @property
    def marker(self) -> str:
        return {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed",
                "fp8": "weight_scale_inv"}[self.method]

    @property
    def scheme(self) -> QuantScheme | None:
        """The artifact's scheme a linear is read into; None for fp8 (dequantized to a float weight)."""
        if self.method == "fp8":
            return None
        if self.bits == 8:
            return QuantScheme.INT8
        return QuantScheme.INT4 if self.sym else QuantScheme.UINT4

    @property
    def label(self) -> str:
        """How the model's name says it: "gptq-uint4g128", "fp8-block128x128"."""
        if self.method == "fp8":
            return f"fp8-block{self.block[0]}x{self.block[1]}"
        if self.bits == 8:
            return f"{self.method}-int8"
        return f"{self.method}-{'int4' if self.sym else 'uint4'}g{self.group}"


def _refuse(field: str, value: Any, supported: str) -> CheckpointError:
    return CheckpointError(f"config.json quantization_config.{field} = {value!r} is not supported ({supported}); "
                           "export an unquantized checkpoint, or one in a supported layout")


def _group(field: str, value: Any) -> int:
    if value not in QUANT_GROUPS:
        raise _refuse(field, value, f"group sizes {', '.join(map(str, QUANT_GROUPS))}")
    return int(value)


def quant_config(hf_config: dict) -> QuantConfig | None:
    """The checkpoint's quantization_config, checked; None for an unquantized checkpoint."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in METHODS:
        raise _refuse("quant_method", method, f"one of {', '.join(METHODS)}")
    if method == "gptq":
        return _gptq_config(qc)
    if method == "awq":
        return _awq_config(qc)
    if method == "compressed-tensors":
        return _compressed_config(qc)
    return _fp8_config(qc)


def _gptq_config(qc: dict) -> QuantConfig:
    if qc.get("bits") != 4:
        raise _refuse("bits", qc.get("bits"), "GPTQ at 4 bits")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "gptq (v1: zero points stored less 1) or gptq_v2")
    return QuantConfig("gptq", 4, _group("group_size", qc.get("group_size")), bool(qc.get("sym", True)),
                       1 if fmt == "gptq" else 0)


def _awq_config(qc: dict) -> QuantConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", qc.get("version"), "gemm packing only")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse("bits", bits, "AWQ at 4 bits")
    if not qc.get("zero_point", True):
        raise _refuse("zero_point", qc.get("zero_point"), "AWQ with zero points")
    return QuantConfig("awq", 4, _group("group_size", qc.get("group_size", qc.get("q_group_size"))))


def _compressed_config(qc: dict) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "exactly one config group")
    (name, group), = groups.items()
    fmt = group.get("format") or qc.get("format")
    if fmt != "pack-quantized":
        raise _refuse("format", fmt, "pack-quantized")
    if group.get("input_activations") or group.get("output_activations"):
        raise _refuse(f"config_groups.{name}.input_activations", group.get("input_activations"),
                      "weight-only quantization (null activations)")
    w = group.get("weights") or {}
    field = f"config_groups.{name}.weights"
    if w.get("type", "int") != "int":
        raise _refuse(f"{field}.type", w.get("type"), "int")
    if w.get("actorder") not in (None, "weight"):
        raise _refuse(f"{field}.actorder", w.get("actorder"), "null or weight (no g_idx)")
    bits, strategy, sym = w.get("num_bits"), w.get("strategy"), bool(w.get("symmetric", True))
    if bits == 4:
        if strategy != "group":
            raise _refuse(f"{field}.strategy", strategy, "group at 4 bits")
        return QuantConfig("compressed-tensors", 4, _group(f"{field}.group_size", w.get("group_size")), sym)
    if bits == 8:
        if strategy != "channel" or not sym:
            raise _refuse(f"{field}.strategy", f"{strategy}, symmetric={sym}", "channel and symmetric at 8 bits")
        return QuantConfig("compressed-tensors", 8, 0, True)
    raise _refuse(f"{field}.num_bits", bits, "4 or 8")


def _fp8_config(qc: dict) -> QuantConfig:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", qc.get("fmt"), "e4m3")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("activation_scheme", qc.get("activation_scheme"), "dynamic")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("weight_block_size", block, "two positive block sizes, e.g. [128, 128]")
    return QuantConfig("fp8", 8, 0, True, block=(int(block[0]), int(block[1])))


# --- reading one linear ------------------------------------------------------------------------------


def _nibbles(words: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    """int32 words -> their 8 nibbles (0..15, int8) spread along `axis` (8x longer): nibble j of a word (bits 4j..4j+3)
    lands at 8 * word + order[j]."""
    u = np.moveaxis(np.asarray(words).view(np.uint32), axis, -1)
    nib = (u[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF          # [..., W, 8] by bit position
    out = np.empty_like(nib)
    out[..., list(order)] = nib
    return np.moveaxis(out.reshape(*u.shape[:-1], -1).astype(np.int8), -1, axis)


def _bytes_of(words: np.ndarray) -> np.ndarray:
    """int32 words [..., W] -> their 4 bytes (0..255, int16) [..., 4W], low byte first."""
    u = np.asarray(words).view(np.uint32)
    return ((u[..., None] >> (8 * np.arange(4, dtype=np.uint32))) & 0xFF).reshape(*u.shape[:-1], -1).astype(np.int16)


def _grouped(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, qc: QuantConfig, compute: str,
             what: str):
    """codes [I, O] (int4: -8..7; uint4: 0..15), scales [G, O], zeros [G, O] or None -> the QuantizedWeight."""
    I, O = codes.shape
    if scales.shape != (I // qc.group, O) or (zeros is not None and zeros.shape != scales.shape):
        zshape = None if zeros is None else list(zeros.shape)
        raise CheckpointError(f"{what}: scales {list(scales.shape)} (zeros {zshape}) do not fit {I} inputs in "
                              f"groups of {qc.group} and {O} outputs")
    scheme = QuantScheme.INT4 if zeros is None else QuantScheme.UINT4
    packed = np.asarray(pack_int4(codes, qc.group))
    z = None if zeros is None else np.ascontiguousarray(zeros.astype(np.int8))
    return QuantizedWeight(packed, np.ascontiguousarray(scales.astype(np.float32)), scheme, qc.group, compute, zeros=z)


def read_linear(get: Callable[[str], np.ndarray], has: Callable[[str], bool], prefix: str, qc: QuantConfig,
                compute: str, shape: tuple[int, int]):
    """One linear stored quantized under `prefix` (e.g. "model.layers.0.self_attn.q_proj"), `shape` [O, I] as the
    float weight would be: a QuantizedWeight [I, O] (in-major), or (fp8) the dequantized float32 weight [O, I]."""
    O, I = shape
    if qc.method == "fp8":
        return _read_fp8(get, prefix, qc, shape)
    if qc.method == "gptq":
        return _read_gptq(get, has, prefix, qc, compute, O, I)
    if qc.method == "awq":
        return _read_awq(get, prefix, qc, compute, O, I)
    return _read_compressed(get, prefix, qc, compute, O, I)


def _check(get, name: str, shape: tuple[int, ...], dtype=None) -> np.ndarray:
    arr = np.asarray(get(name))
    if tuple(arr.shape) != tuple(shape) or (dtype is not None and arr.dtype != dtype):
        raise CheckpointError(f"tensor {name!r} is {arr.dtype} {list(arr.shape)}, expected "
                              f"{np.dtype(dtype) if dtype is not None else 'any dtype'} {list(shape)}")
    return arr


def _read_gptq(get, has, prefix, qc, compute, O, I):
    G = I // qc.group
    qweight = _check(get, f"{prefix}.qweight", (I // 8, O), np.int32)
    qzeros = _check(get, f"{prefix}.qzeros", (G, O // 8), np.int32)
    scales = _check(get, f"{prefix}.scales", (G, O)).astype(np.float32)
    g_idx = get(f"{prefix}.g_idx") if has(f"{prefix}.g_idx") else None
    if g_idx is not None and not np.array_equal(np.asarray(g_idx), np.arange(I) // qc.group):
        raise CheckpointError(f"tensor {prefix}.g_idx is not i // group_size: desc_act's permuted groups "
                              "(quantization_config.desc_act = true) are not supported; quantize with desc_act false")
    codes = _nibbles(qweight, 0)                                               # [I, O], 0..15
    zeros = _nibbles(qzeros, 1).astype(np.int16) + qc.zero_offset             # [G, O]
    if zeros.max() > 15:
        raise CheckpointError(f"tensor {prefix}.qzeros holds a zero point of 16 (v1's stored -1): it cannot be read "
                              "as 4 bits; re-save the checkpoint with checkpoint_format gptq_v2")
    if qc.sym:
        if (zeros != 8).any():
            raise CheckpointError(f"tensor {prefix}.qzeros: quantization_config.sym = true but a zero point is "
                                  f"{int(zeros[zeros != 8][0])}, not 8 (is checkpoint_format right?)")
        return _grouped(codes - 8, scales, None, qc, compute, prefix)
    return _grouped(codes, scales, zeros, qc, compute, prefix)


def _read_awq(get, prefix, qc, compute, O, I):
    G = I // qc.group
    qweight = _check(get, f"{prefix}.qweight", (I, O // 8), np.int32)
    qzeros = _check(get, f"{prefix}.qzeros", (G, O // 8), np.int32)
    scales = _check(get, f"{prefix}.scales", (G, O)).astype(np.float32)
    return _grouped(_nibbles(qweight, 1, AWQ_ORDER), scales, _nibbles(qzeros, 1, AWQ_ORDER), qc, compute, prefix)


def _read_compressed(get, prefix, qc, compute, O, I):
    stored = [int(d) for d in np.asarray(get(f"{prefix}.weight_shape")).reshape(-1)]
    if stored != [O, I]:
        raise CheckpointError(f"tensor {prefix}.weight_shape is {stored}, expected {[O, I]}")
    packed = _check(get, f"{prefix}.weight_packed", (O, I * qc.bits // 32), np.int32)
    if qc.bits == 8:
        scale = _check(get, f"{prefix}.weight_scale", (O, 1)).astype(np.float32)[:, 0]
        codes = (_bytes_of(packed) - 128).astype(np.int8)                      # [O, I]
        return QuantizedWeight(np.ascontiguousarray(codes.T), scale, QuantScheme.INT8, 0, compute)
    scales = _check(get, f"{prefix}.weight_scale", (O, I // qc.group)).astype(np.float32).T    # [G, O]
    codes = _nibbles(packed, 1).T                                              # [I, O], q + 8
    if qc.sym:
        return _grouped(codes - 8, np.ascontiguousarray(scales), None, qc, compute, prefix)
    zp = _check(get, f"{prefix}.weight_zero_point", (-(-O // 8), I // qc.group), np.int32)
    zeros = _nibbles(zp, 0)[:O].T                                              # [G, O], zp + 8
    return _grouped(codes, np.ascontiguousarray(scales), zeros, qc, compute, prefix)


def _read_fp8(get, prefix, qc, shape):
    O, I = shape
    bo, bi = qc.block
    w = _check(get, f"{prefix}.weight", (O, I))
    if w.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise CheckpointError(f"tensor {prefix}.weight is {w.dtype}; quant_method fp8 stores float8_e4m3fn")
    s = _check(get, f"{prefix}.weight_scale_inv", (-(-O // bo), -(-I // bi))).astype(np.float64)
    full = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:O, :I]
    return (w.astype(np.float64) * full).astype(np.float32)


# --- the checkpoint loader's hook ----------------------------------------------------------------------


def is_stored(file_of, name: str, qc: QuantConfig | None) -> bool:
    """Whether checkpoint tensor `name` (a linear's ".weight") is stored quantized: its marker tensor is present."""
    return qc is not None and name.endswith(".weight") and f"{name[: -len('.weight')]}.{qc.marker}" in file_of


def read_tensor(index, name: str, hf_shape: tuple[int, ...], spec, compute: str, qc: QuantConfig | None):
    """The loader's hook for checkpoint tensor `name` of slot `spec` (tlaloc_jax.families.Tensor): None where it is
    not stored quantized (read it as usual); else a QuantizedWeight [I, O] (the slot's value), or (fp8) the float
    tensor, to be split and transposed as a stored one. index: the loader's (get(name), file_of)."""
    if not is_stored(index.file_of, name, qc):
        return None
    prefix = name[: -len(".weight")]
    if len(hf_shape) != 2 or not spec.transpose or spec.squeeze is not None:
        raise CheckpointError(f"tensor {name!r} (slot {spec.slot!r}) is stored quantized ({qc.method}), but the slot "
                              "is not a linear [out, in] that can be read quantized")
    if qc.method != "fp8" and spec.split is not None:
        raise CheckpointError(f"tensor {name!r} holds several slots ({spec.slot!r} among them), and is stored "
                              f"quantized ({qc.method}): its codes cannot be split yet")
    return read_linear(index.get, lambda n: n in index.file_of, prefix, qc, compute, tuple(hf_shape))


def stack(parts: list):
    """np.stack for a slot's layers or experts, QuantizedWeights leaf by leaf (all of one scheme and group)."""
    kinds = {(p.scheme, p.group) if isinstance(p, QuantizedWeight) else None for p in parts}
    if len(kinds) > 1:
        raise CheckpointError(f"a slot's layers are stored in different formats ({sorted(map(str, kinds))}); "
                              "every layer of a slot must be quantized alike")
    if isinstance(parts[0], QuantizedWeight):
        return jax.tree.map(lambda *a: np.stack(a), *parts)
    return np.stack(parts)
