"""Pre-quantized checkpoints (tlaloc_jax/prequantized.py) exported by streaming, a layer's tensor at a time: the
weight files, their records and their bytes are those the load-everything path (loaded_weights) writes, for GPTQ,
AWQ, compressed-tensors and FP8 in both weight layouts, and the weight pass' peak memory is a few tensors, not the
model. Controls: a stream that drops the zero points, or one that reads the codes whole, each fail."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hf_models import build_checkpoint
from prequant_packers import write_prequantized
from test_prequantized import LAYOUTS
from test_streaming_export import _weight_pass
from tlaloc_jax.checkpoint import checkpoint_tensors, read_config
from tlaloc_jax.export import _checkpoint_weights
from tlaloc_jax.export._checkpoint_weights import loaded_weights, streamed_weights
from tlaloc_jax.export._files import write_weights
from tlaloc_jax.export._progress import progress_bar
from tlaloc_jax.export._quant import quant_records
from tlaloc_jax.export._weights import flatten_weights
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.kernels.quantized_matmul import QuantizedWeight

LAYERS = 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("pqs-base"), "llama", seed=5, num_hidden_layers=LAYERS)


def _checkpoint(base, tmp_path, name, layers=LAYERS):
    qconfig, pack, _ = LAYOUTS[name]
    write_prequantized(base, tmp_path / "q", tmp_path / "deq", qconfig, pack, layers)
    return tmp_path / "q"


def _weight_files(checkpoint, out, read, layout):
    """The weight files `read` gives the checkpoint, written -> ({file: record}, {file: bytes})."""
    fam, cfg = config_from_hf(read_config(checkpoint))
    weights = read(checkpoint, fam, cfg, dtype="float32", layout=layout, quant="none", group=32)
    flat, _ = flatten_weights(weights)
    records = write_weights(out, flat, progress_bar(len(flat), "weights", False), quant_records(weights))
    return {r.file: r for r in records}, {r.file: (out / r.file).read_bytes() for r in records}


def _differing(checkpoint, tmp_path, layout) -> list[str]:
    """The weight files whose record or bytes differ between the streamed and the loaded reads (the file lists
    must agree)."""
    s_rec, s_bytes = _weight_files(checkpoint, tmp_path / "streamed", streamed_weights, layout)
    l_rec, l_bytes = _weight_files(checkpoint, tmp_path / "loaded", loaded_weights, layout)
    assert list(s_rec) == list(l_rec)
    return [f for f in s_rec if s_rec[f] != l_rec[f] or s_bytes[f] != l_bytes[f]]


@pytest.mark.parametrize("name,layout", [
    ("gptq-v1-asym-g32", "per-layer"), ("gptq-v1-asym-g32", "stacked"), ("gptq-v2-sym-g32", "per-layer"),
    ("awq-gemm-g32", "per-layer"), ("awq-gemm-g32", "stacked"), ("ct-int4-asym-g32", "per-layer"),
    ("ct-int8-channel", "per-layer"), ("fp8-block32", "per-layer"),
])
def test_streamed_prequantized_weights_are_byte_identical_to_the_loaded_ones(base, tmp_path, name, layout):
    checkpoint = _checkpoint(base, tmp_path, name)
    assert _differing(checkpoint, tmp_path, layout) == []
    fam, cfg = config_from_hf(read_config(checkpoint))
    weights = streamed_weights(checkpoint, fam, cfg, dtype="float32", layout=layout, quant="none", group=32)
    quantized = [s for s, w in weights.items()
                 if isinstance(w[0] if isinstance(w, tuple) else w, QuantizedWeight)]
    assert bool(quantized) == (LAYOUTS[name][2] is not None), quantized      # fp8 is dequantized to floats


@pytest.mark.parametrize("name", ["gptq-v1-asym-g32", "awq-gemm-g32"])
def test_control_a_stream_that_drops_the_zero_points_differs(base, tmp_path, monkeypatch, name):
    """The streamed reader's out-major step made to drop the zero points (all 0): exactly the zero-point files
    differ from the loaded ones."""
    checkpoint = _checkpoint(base, tmp_path, name)
    to_out_major = _checkpoint_weights.to_out_major

    def dropped(q):
        q = to_out_major(q)
        return dataclasses.replace(q, zeros=np.zeros_like(q.zeros)) if q.zeros is not None else q
    monkeypatch.setattr(_checkpoint_weights, "to_out_major", dropped)
    differing = _differing(checkpoint, tmp_path, "per-layer")
    assert differing and all(".zeros" in f for f in differing), differing
    assert len(differing) == 4 * LAYERS         # qkv, o, gate|up and down of every layer


def test_prequantized_weight_pass_peak_is_a_few_tensors_not_the_model(tmp_path, monkeypatch):
    """32 GPTQ layers, stored in about 20 of the largest float tensor's bytes: the streamed pass stays within 12 (the
    float stream's bound in test_streaming_export; the checkpoint's index, a few entries a tensor, is in it too);
    the control, reading the stored codes whole (the loaded path this replaced), fails the same bound."""
    layers = 32
    base = build_checkpoint(tmp_path / "base", "llama", seed=2, num_hidden_layers=layers, vocab_size=64,
                            hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=32)
    checkpoint = _checkpoint(base, tmp_path, "gptq-v1-asym-g32", layers)
    fam, cfg = config_from_hf(read_config(base))
    shapes = checkpoint_tensors(fam, cfg).values()
    largest = max(4 * int(np.prod(s)) for s in shapes)
    assert (checkpoint / "model.safetensors").stat().st_size > 12 * largest            # the checkpoint, stored quantized, is past the bound
    kw = dict(dtype="float32", layout="per-layer", quant="none", group=32)
    streamed = _weight_pass(checkpoint, tmp_path / "streamed", streamed_weights, **kw)
    loaded = _weight_pass(checkpoint, tmp_path / "loaded", loaded_weights, **kw)
    assert streamed <= 12 * largest, (streamed, largest)
    assert loaded > 12 * largest, (loaded, largest)
