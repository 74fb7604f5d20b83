"""Tiny pre-quantized checkpoints for the readers' tests, packed from the documented layouts (AutoGPTQ's pack, AutoAWQ's
WQLinear_GEMM.from_linear, compressed-tensors' pack_to_int32, DeepSeek-V3's fp8 block scales), one bit loop at a
time and independent of tlaloc_jax/prequantized.py; and beside each, the float checkpoint of the weights its codes
stand for (what transformers runs as the oracle). Test code only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_words(vals: np.ndarray, per_word: int, bits: int, order=None) -> np.ndarray:
    """vals [..., N] unsigned -> int32 [..., N / per_word]: element per_word * w + order[j] at bits j*bits."""
    order = order or tuple(range(per_word))
    v = vals.astype(np.uint64).reshape(*vals.shape[:-1], -1, per_word)
    word = np.zeros(v.shape[:-1], np.uint64)
    for j in range(per_word):
        word |= (v[..., order[j]] & ((1 << bits) - 1)) << np.uint64(bits * j)
    return word.astype(np.uint32).view(np.int32)


def asym_codes(w_oi: np.ndarray, group: int):
    """A float [O, I] weight -> (codes 0..15 [O, I], fp16 scales [O, G], zeros 1..15 [O, G]): min/max per group,
    range widened to hold 0 (zero points of 0 avoided: GPTQ v1 cannot store them)."""
    O, I = w_oi.shape
    wg = w_oi.reshape(O, I // group, group).astype(np.float64)
    lo, hi = np.minimum(wg.min(-1), 0), np.maximum(wg.max(-1), 0)
    scales = ((hi - lo) / 15).astype(np.float16)
    s = scales.astype(np.float64)
    zeros = np.clip(np.round(-lo / s), 1, 15)
    codes = np.clip(np.round(wg / s[..., None]) + zeros[..., None], 0, 15).reshape(O, I)
    return codes.astype(np.int64), scales, zeros.astype(np.int64)


def sym_codes(w_oi: np.ndarray, group: int):
    """(signed codes -8..7 [O, I], fp16 scales [O, G]): s = max|W| / 7.5 per group."""
    O, I = w_oi.shape
    wg = w_oi.reshape(O, I // group, group).astype(np.float64)
    scales = (np.abs(wg).max(-1) / 7.5).astype(np.float16)
    codes = np.clip(np.round(wg / scales.astype(np.float64)[..., None]), -8, 7).reshape(O, I)
    return codes.astype(np.int64), scales


def _deq(codes, scales, zeros, group):
    O, I = codes.shape
    z = 0 if zeros is None else np.repeat(zeros, group, axis=1)
    return ((codes - z) * np.repeat(scales.astype(np.float64), group, axis=1)).astype(np.float32)


def gptq_tensors(w_oi, group, *, sym: bool, v1: bool):
    """AutoGPTQ's layout: qweight [I/8, O] along the input, qzeros [G, O/8] along the output (v1: zero - 1)."""
    O, I = w_oi.shape
    if sym:
        signed, scales = sym_codes(w_oi, group)
        codes, zeros = signed + 8, np.full(scales.shape, 8)
    else:
        codes, scales, zeros = asym_codes(w_oi, group)
    t = {"qweight": np.ascontiguousarray(_pack_words(codes, 8, 4).T)}               # [I/8, O]
    t["qzeros"] = _pack_words((zeros - (1 if v1 else 0)).T % 16, 8, 4)            # [G, O/8]
    t["scales"] = np.ascontiguousarray(scales.T)                                      # [G, O]
    t["g_idx"] = (np.arange(I) // group).astype(np.int32)
    return t, _deq(codes, scales, zeros, group)


def awq_tensors(w_oi, group, order=AWQ_ORDER):
    """AutoAWQ's GEMM layout: qweight [I, O/8] along the output in AWQ_ORDER, qzeros [G, O/8] likewise."""
    codes, scales, zeros = asym_codes(w_oi, group)
    t = {"qweight": _pack_words(np.ascontiguousarray(codes.T), 8, 4, order),
         "qzeros": _pack_words(np.ascontiguousarray(zeros.T), 8, 4, order),
         "scales": np.ascontiguousarray(scales.T)}
    return t, _deq(codes, scales, zeros, group)


def compressed_tensors_tensors(w_oi, group, *, sym: bool, bits: int = 4):
    """compressed-tensors pack-quantized: signed q + 2^(bits-1) packed along the input ([O, I*bits/32]); weight_scale
    [O, G] ([O, 1] per channel); asymmetric zero points (signed, + 8) packed along the output ([O/8, G])."""
    O, I = w_oi.shape
    if bits == 8:
        scale = (np.abs(w_oi).max(1, keepdims=True) / 127.5).astype(np.float16)
        q = np.clip(np.round(w_oi / scale.astype(np.float64)), -128, 127).astype(np.int64)
        t = {"weight_packed": _pack_words(q + 128, 4, 8), "weight_scale": scale,
             "weight_shape": np.array([O, I], np.int64)}
        return t, (q * scale.astype(np.float64)).astype(np.float32)
    if sym:
        q, scales = sym_codes(w_oi, group)
        zp = None
    else:
        codes, scales, zeros = asym_codes(w_oi, group)
        q, zp = codes - 8, zeros - 8
    t = {"weight_packed": _pack_words(q + 8, 8, 4), "weight_scale": scales,
         "weight_shape": np.array([O, I], np.int64)}
    if zp is not None:
        t["weight_zero_point"] = np.ascontiguousarray(_pack_words(np.ascontiguousarray((zp + 8).T), 8, 4).T)
    return t, _deq(q, scales, zp, group)


def fp8_tensors(w_oi, block):
    """DeepSeek-V3's layout: e4m3fn codes [O, I] and f32 weight_scale_inv per [bo, bi] block."""
    O, I = w_oi.shape
    bo, bi = block
    s = np.zeros((-(-O // bo), -(-I // bi)), np.float32)
    for r in range(s.shape[0]):
        for c in range(s.shape[1]):
            s[r, c] = np.abs(w_oi[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]).max() / 448
    full = np.repeat(np.repeat(s, bo, 0), bi, 1)[:O, :I]
    codes = (w_oi / full).astype(ml_dtypes.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": s}, (codes.astype(np.float64) * full).astype(np.float32)


def _save(tensors: dict, path: Path) -> None:
    """save_file through torch (safetensors' numpy writer has no float8)."""
    import torch
    from safetensors.torch import save_file as save_torch

    def to_torch(a):
        if a.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        return torch.from_numpy(np.ascontiguousarray(a))
    save_torch({k: to_torch(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def write_prequantized(src: Path, out: Path, deq_out: Path, quantization_config: dict, pack, layers: int) -> None:
    """src's checkpoint with every decoder linear replaced by pack(weight [O, I]) -> (tensors by suffix, the float
    weight they stand for): `out` holds the packed tensors and quantization_config, `deq_out` the float weights."""
    tensors = load_file(src / "model.safetensors")
    quant, deq = dict(tensors), dict(tensors)
    for i in range(layers):
        for lin in LINEARS:
            prefix = f"model.layers.{i}.{lin}"
            packed, w = pack(tensors.pop(f"{prefix}.weight"))
            del quant[f"{prefix}.weight"]
            quant.update({f"{prefix}.{k}": v for k, v in packed.items()})
            deq[f"{prefix}.weight"] = w
    for path, ts in ((out, quant), (deq_out, deq)):
        shutil.copytree(src, path)
        _save(ts, path / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
