"""Reading a Hugging Face checkpoint directory into a DecoderConfig and a flat Weights dict."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from . import artifact as af
from . import prequantized
from .config import CheckpointError, ConfigError, DecoderConfig
from .families import Family, Tensor, config_from_hf, split_rows, stack_layers

# The embedded demo model (a checkpoint shipped as package data): what `export --demo` and the tools read.
DEMO_MODEL = Path(__file__).resolve().parent / "demo_model"

# The dtypes a checkpoint is read into (weights and KV pools); their names and numpy types come from the
# project's one dtype table (tlaloc_jax.artifact.DTYPES).
WEIGHT_DTYPES = ("float32", "bfloat16")


def read_config(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in checkpoint directory {str(checkpoint_dir)!r}")
    return json.loads(path.read_text())


def weight_dtype(name: str) -> np.dtype:
    if name not in WEIGHT_DTYPES:
        raise ConfigError(f"weight dtype {name!r} is not supported (choose from {', '.join(WEIGHT_DTYPES)})")
    return af.numpy_dtype(name)


# safetensors' dtype names -> numpy's (ml_dtypes' for bf16 and fp8, which safetensors' numpy reader cannot read).
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
                      "U16": "uint16", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
                      "F8_E5M2": "float8_e5m2"}


def safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """A safetensors file's tensors {name: {dtype, shape, data_offsets}} and the offset where their data starts."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def read_tensor(path: Path, name: str, entry: dict, data_start: int) -> np.ndarray:
    """One tensor of a safetensors file, read into a host array of its own (no mapping kept: the export's resident
    set holds this tensor, not the file's pages)."""
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"tensor {name!r} in {path.name!r} has dtype {entry['dtype']}, which the reader does "
                              f"not take (known: {', '.join(SAFETENSORS_DTYPES)})")
    name_np = SAFETENSORS_DTYPES[entry["dtype"]]
    dtype = np.dtype(getattr(ml_dtypes, name_np) if name_np in ("bfloat16", "float8_e4m3fn", "float8_e5m2") else name_np)
    arr = np.empty(entry["shape"], dtype)
    start, end = entry["data_offsets"]
    if end - start != arr.nbytes:
        raise CheckpointError(f"tensor {name!r} in {path.name!r} spans {end - start} bytes, its dtype and shape "
                              f"{arr.nbytes}: the file is damaged")
    with open(path, "rb") as f:
        f.seek(data_start + start)
        if f.readinto(arr.reshape(-1).view(np.uint8)) != arr.nbytes:
            raise CheckpointError(f"tensor {name!r}: {path.name!r} ends before its data does (a truncated file)")
    return arr


class TensorIndex:
    """Where each tensor of a (possibly sharded) safetensors checkpoint lives; reads one tensor at a time."""

    def __init__(self, checkpoint_dir: Path):
        index = checkpoint_dir / "model.safetensors.index.json"
        single = checkpoint_dir / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: checkpoint_dir / fname for name, fname in weight_map.items()}
        elif single.is_file():
            self.file_of = {name: single for name in safetensors_header(single)[0]}
        else:
            raise CheckpointError(
                f"no model.safetensors or model.safetensors.index.json in {str(checkpoint_dir)!r}")
        self._headers: dict[Path, tuple[dict[str, dict], int]] = {}

    def get(self, name: str) -> np.ndarray:
        path = self.file_of.get(name)
        if path is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        if path not in self._headers:
            if not path.is_file():
                raise CheckpointError(f"tensor {name!r} is mapped to {path.name!r}, which does not exist")
            self._headers[path] = safetensors_header(path)
        header, data_start = self._headers[path]
        if name not in header:
            raise CheckpointError(f"tensor {name!r} is mapped to {path.name!r}, which does not hold it")
        return read_tensor(path, name, header[name], data_start)

    def close(self) -> None:
        self._headers.clear()


def _hf_shape(spec: Tensor, cfg: DecoderConfig) -> tuple[int, ...]:
    """The checkpoint tensor's shape for one layer of a slot (one expert's, for a per-expert slot): the inverse
    of _read_one's steps."""
    expected = spec.layer_shape(cfg)[1:] if spec.per_expert else spec.layer_shape(cfg)
    shape = list(expected)
    if spec.transpose:
        shape[-2:] = shape[-1], shape[-2]
    if spec.split is not None:
        shape[spec.split.axis] = split_rows(spec.split, cfg)[1]
    if spec.squeeze is not None:
        shape.insert(spec.squeeze, 1)
    return tuple(shape)


def checkpoint_tensors(fam: Family, cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint of `cfg` holds -> its shape as stored, in the family table's order (a tensor
    that several slots split is listed once)."""
    out: dict[str, tuple[int, ...]] = {}
    for spec in fam.slots(cfg):
        for i in stack_layers(spec.slot, cfg) or (None,):
            experts = range(cfg.experts.num_experts) if spec.per_expert else (None,)
            for e in experts:
                out.setdefault(spec.hf.format(p=fam.prefix, i=i, e=e), _hf_shape(spec, cfg))
    return out


def _read_one(index: TensorIndex, name: str, spec: Tensor, cfg: DecoderConfig, dtype: np.dtype,
              out_major: bool = False, qc=None):
    """One checkpoint tensor as its slot holds it ([..., I, O] for a linear), or with out_major its last two axes
    swapped (a linear [O, I], as the checkpoint stores it: no transposed copy). A linear stored pre-quantized (qc,
    tlaloc_jax/prequantized.py) comes as a QuantizedWeight [I, O] either way."""
    hf_shape = _hf_shape(spec, cfg)
    arr = prequantized.read_tensor(index, name, hf_shape, spec, np.dtype(dtype).name, qc)    # a stored-quantized one
    if arr is not None and not isinstance(arr, np.ndarray):
        return arr
    arr = index.get(name) if arr is None else arr
    if tuple(arr.shape) != hf_shape:
        raise CheckpointError(f"tensor {name!r} has shape {list(arr.shape)}, expected {list(hf_shape)} "
                              f"for slot {spec.slot!r} of {cfg.model_type}")
    if spec.squeeze is not None:
        arr = arr.squeeze(spec.squeeze)
    if spec.split is not None:
        arr = np.take(arr, split_rows(spec.split, cfg)[0], axis=spec.split.axis)
    if spec.transpose != out_major:
        arr = arr.swapaxes(-1, -2)
    return np.ascontiguousarray(arr.astype(np.float32).astype(dtype, copy=False) if arr.dtype != dtype else arr)


def read_slot(index: TensorIndex, fam: Family, spec: Tensor, cfg: DecoderConfig, layer: int | None,
               dtype: np.dtype, out_major: bool = False, qc=None) -> np.ndarray:
    """One layer's tensor of a slot (`layer` None: a whole slot's), read in `dtype`; out_major and qc as _read_one."""
    if spec.per_expert:
        return prequantized.stack([_read_one(index, spec.hf.format(p=fam.prefix, i=layer, e=e), spec, cfg, dtype,
                                             out_major, qc) for e in range(cfg.experts.num_experts)])
    return _read_one(index, spec.hf.format(p=fam.prefix, i=layer), spec, cfg, dtype, out_major, qc)


def load_weights(checkpoint_dir: str | os.PathLike, fam: Family, cfg: DecoderConfig,
                 dtype: str = "float32") -> dict[str, np.ndarray]:
    """Read every slot of `cfg` as host arrays of `dtype`; per-layer slots are stacked [L, ...]. A pre-quantized
    checkpoint's quantized linears come as QuantizedWeights of compute dtype `dtype` (tlaloc_jax/prequantized.py)."""
    np_dtype = weight_dtype(dtype)
    qc = prequantized.quant_config(read_config(checkpoint_dir))
    index = TensorIndex(Path(checkpoint_dir))
    try:
        weights: dict[str, np.ndarray] = {}
        for spec in fam.slots(cfg):
            layers = stack_layers(spec.slot, cfg)
            if layers:
                weights[spec.slot] = prequantized.stack([read_slot(index, fam, spec, cfg, i, np_dtype, qc=qc)
                                                         for i in layers])
            else:
                weights[spec.slot] = read_slot(index, fam, spec, cfg, None, np_dtype, qc=qc)
        return weights
    finally:
        index.close()


def load_checkpoint(checkpoint_dir: str | os.PathLike, dtype: str = "float32"
                    ) -> tuple[DecoderConfig, dict[str, np.ndarray]]:
    """A checkpoint directory -> (DecoderConfig, Weights as host numpy arrays)."""
    fam, cfg = config_from_hf(read_config(checkpoint_dir))
    return cfg, load_weights(checkpoint_dir, fam, cfg, dtype)


def save_checkpoint(checkpoint_dir: str | os.PathLike, hf_config: dict[str, Any],
                    weights: dict[str, np.ndarray]) -> Path:
    """Write Weights as a Hugging Face checkpoint (config.json + model.safetensors, f32).

    The inverse of load_checkpoint through the same family table: slots are unstacked per layer and
    linears transposed back to [out, in]. Used by the demo and by training to publish a model that
    both load_hf and transformers read.
    """
    from safetensors.numpy import save_file

    fam, cfg = config_from_hf(hf_config)
    tensors: dict[str, np.ndarray] = {}
    covered: dict[str, np.ndarray] = {}      # split tensors: which rows the slots wrote
    for spec in fam.slots(cfg):
        if spec.slot not in weights:
            raise CheckpointError(f"weights have no slot {spec.slot!r}, which {cfg.model_type} needs")
        arr, shape = np.asarray(weights[spec.slot], np.float32), spec.slot_shape(cfg)
        if arr.shape != shape:
            raise CheckpointError(f"slot {spec.slot!r} has shape {list(arr.shape)}, {cfg.model_type} needs "
                                  f"{list(shape)}")
        layers = stack_layers(spec.slot, cfg)
        per_layer = list(zip(layers, arr)) if layers else [(None, arr)]
        for i, a in per_layer:
            per_expert = ([(spec.hf.format(p=fam.prefix, i=i, e=e), a[e]) for e in range(cfg.experts.num_experts)]
                          if spec.per_expert else [(spec.hf.format(p=fam.prefix, i=i), a)])
            for name, t in per_expert:
                _write_one(tensors, covered, name, t, spec, cfg)
    for name, rows in covered.items():
        if not rows.all():
            raise CheckpointError(f"the slots of {cfg.model_type} fill only {int(rows.sum())} of the "
                                  f"{rows.size} rows of {name!r}")
    out = Path(checkpoint_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return out


def _write_one(tensors: dict, covered: dict, name: str, a: np.ndarray, spec: Tensor, cfg: DecoderConfig) -> None:
    """Put one slot's tensor (one layer's, one expert's) into the checkpoint tensor `name` (_read_one inverted)."""
    a = a.swapaxes(-1, -2) if spec.transpose else a
    if spec.split is not None:
        rows, length = split_rows(spec.split, cfg)
        axis = spec.split.axis
        shape = list(a.shape)
        shape[axis] = length
        whole = tensors.setdefault(name, np.zeros(shape, np.float32))
        index = [slice(None)] * a.ndim
        index[axis] = rows
        whole[tuple(index)] = a
        covered.setdefault(name, np.zeros(length, bool))[rows] = True
        return
    if spec.squeeze is not None:
        a = np.expand_dims(a, spec.squeeze)
    tensors[name] = np.ascontiguousarray(a)


def random_weights(cfg: DecoderConfig, fam: Family, seed: int = 0, std: float = 0.08) -> dict[str, np.ndarray]:
    """Seeded random weights for every slot of `cfg` (norm weights near 1), as f32 host arrays."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in fam.slots(cfg):
        shape = spec.slot_shape(cfg)
        if spec.slot.endswith("norm"):
            out[spec.slot] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[spec.slot] = (std * rng.standard_normal(shape)).astype(np.float32)
    return out
