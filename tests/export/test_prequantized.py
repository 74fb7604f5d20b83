"""Pre-quantized checkpoints read directly (tlaloc_jax/prequantized.py): tiny Llamas packed in GPTQ (v1 and v2,
symmetric and not), AWQ GEMM, compressed-tensors pack-quantized (int4 both ways, int8 per channel) and FP8 block
scales by the test's own packers (tests/support/prequant_packers.py), exported and served, their greedy ids against
transformers running the float weights the codes stand for (near-tie rule at the f32 bound: both sides hold the same
weights). Controls: a GPTQ v1 checkpoint read without its +1, and AWQ's packing order ignored, each fail. Refusals:
an unknown method, bits, group size, version, format, desc_act's g_idx, requantizing, each by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import tlaloc_jax
from hf_models import build_checkpoint, load_hf_torch, torch_greedy
from oracle import GreedyMismatch, check_greedy_batch, engine_next_token
from prequant_packers import (awq_tensors, compressed_tensors_tensors, fp8_tensors, gptq_tensors,
                              write_prequantized)
from tlaloc_jax import artifact as af
from tlaloc_jax import prequantized
from tlaloc_jax.checkpoint import CheckpointError, load_checkpoint
from tlaloc_jax.config import ConfigError
from tlaloc_jax.export import ExportError, export_checkpoint
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.quantized_matmul import QuantizedWeight

PROMPTS = [[5, 17, 99, 3, 250, 8, 61], [7, 7, 7, 1, 2, 3, 200, 100, 11, 13, 17, 19]]
NEW = 10
LAYERS = 3


def _gptq(group, sym, v1):
    return ({"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": False,
             "checkpoint_format": "gptq" if v1 else "gptq_v2"},
            lambda w: gptq_tensors(w, group, sym=sym, v1=v1))


def _ct(group, sym, bits=4):
    weights = ({"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group}
               if bits == 4 else {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"})
    return ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
             "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}},
            lambda w: compressed_tensors_tensors(w, group, sym=sym, bits=bits))


LAYOUTS = {
    "gptq-v1-asym-g32": (*_gptq(32, False, True), "uint4"),
    "gptq-v2-sym-g32": (*_gptq(32, True, False), "int4"),
    "awq-gemm-g32": ({"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True},
                     lambda w: awq_tensors(w, 32), "uint4"),
    "ct-int4-sym-g32": (*_ct(32, True), "int4"),
    "ct-int4-asym-g32": (*_ct(32, False), "uint4"),
    "ct-int8-channel": (*_ct(0, True, bits=8), "int8"),
    "fp8-block32": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [32, 32]}, lambda w: fp8_tensors(w, (32, 32)), None),
}


TRANSFORMERS_READS = ("ct-int4-sym-g32", "ct-int8-channel")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("pq-base"), "llama", seed=11, num_hidden_layers=LAYERS)


def _write(base, tmp_path, name):
    qconfig, pack, _ = LAYOUTS[name]
    q, deq = tmp_path / "q", tmp_path / "deq"
    write_prequantized(base, q, deq, qconfig, pack, LAYERS)
    return q, deq


@pytest.mark.numeric
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_served_prequantized_matches_the_dequantized_checkpoint(base, tmp_path, name):
    from tlaloc_jax.serve.engine import Engine

    q, deq = _write(base, tmp_path, name)
    scheme = LAYOUTS[name][2]
    out = tmp_path / "art"
    export_checkpoint(q, out, batch_ladder=(1,), context_ladder=(64,), progress=False, sampler=None)
    m = af.load_manifest(out)
    schemes = {w.quant.scheme for w in m.weights if w.quant}
    assert schemes == ({af.QuantScheme(scheme)} if scheme else set()), schemes
    assert ":q" + name.split("-")[0].replace("ct", "compressed-tensors") in m.model.name, m.model.name
    if scheme:      # every decoder projection is stored as read, the head kept float
        assert {w.quant.weight for w in m.weights if w.quant} == {
            f"{s}.{i}" for s in ("attn.qkv_proj", "attn.o_proj", "layers.gate_up_proj", "layers.down_proj")
            for i in range(LAYERS)}
    cfg, _ = load_checkpoint(deq)
    want = [torch_greedy(load_hf_torch(deq), p, NEW) for p in PROMPTS]
    # 4-bit weights are served through the native int4 kernel, which quantizes each projection's input to int8.
    activation = tol.INT8_ACTIVATION_ROUNDOFF if scheme and af.QuantScheme(scheme) in af.GROUPED_SCHEMES else 0.0
    bound = tol.quantized_logit_bound(0.0, cfg.num_layers, tol.decoder_roundings_of(cfg, 64),
                                      activation_roundoff=activation)
    # transformers reads compressed-tensors' symmetric layouts itself on CPU (the compressed-tensors package
    # decompresses them): against it too. Its asymmetric int4 it cannot load (it expects the zero points unpacked,
    # test_packers_agree_with_compressed_tensors checks those), nor GPTQ, AWQ or FP8 without optimum, gptqmodel or
    # accelerate and a GPU kernel.
    own = [torch_greedy(load_hf_torch(q), p, NEW) for p in PROMPTS] if name in TRANSFORMERS_READS else None
    with Engine.load(out, progress=False) as engine:
        got = engine.generate(PROMPTS, NEW)
        check_greedy_batch(PROMPTS, got, want, logit_bound=bound, next_token=engine_next_token(engine))
        if own is not None:
            check_greedy_batch(PROMPTS, got, own, logit_bound=bound, next_token=engine_next_token(engine))


def test_packers_agree_with_compressed_tensors():
    """The test's compressed-tensors packer against the library's own pack_to_int32 (codes along the input, zero
    points along the output), so the layout the reader is checked on is the library's."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    w = np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)
    t, _ = compressed_tensors_tensors(w, 32, sym=False)
    from prequant_packers import asym_codes
    codes, _, zeros = asym_codes(w, 32)
    q, zp = torch.tensor(codes - 8, dtype=torch.int8), torch.tensor(zeros - 8, dtype=torch.int8)
    np.testing.assert_array_equal(t["weight_packed"], pack_to_int32(q, 4).numpy())
    np.testing.assert_array_equal(t["weight_zero_point"], pack_to_int32(zp, 4, packed_dim=0).numpy())
    t8, _ = compressed_tensors_tensors(w, 0, sym=True, bits=8)
    q8 = np.clip(np.round(w / t8["weight_scale"].astype(np.float64)), -128, 127)
    np.testing.assert_array_equal(t8["weight_packed"], pack_to_int32(torch.tensor(q8, dtype=torch.int8), 8).numpy())


def _fails_against_oracle(q, deq):
    cfg, weights = load_checkpoint(q)
    model = tlaloc_jax.Model(cfg, weights)
    want = [torch_greedy(load_hf_torch(deq), p, NEW) for p in PROMPTS]
    with pytest.raises(GreedyMismatch):
        check_greedy_batch(PROMPTS, model.generate(PROMPTS, max_new_tokens=NEW), want,
                           logit_bound=tol.bound(tol.decoder_roundings_of(cfg, 64)),
                           next_token=engine_next_token(model))


@pytest.mark.numeric
def test_gptq_v1_read_without_its_plus_one_fails(base, tmp_path):
    """Control: the v1 checkpoint (zeros stored less 1) labelled gptq_v2, so its zero points are read as stored."""
    q, deq = _write(base, tmp_path, "gptq-v1-asym-g32")
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (q / "config.json").write_text(json.dumps(cfg))
    _fails_against_oracle(q, deq)


@pytest.mark.numeric
def test_awq_read_in_plain_order_fails(base, tmp_path, monkeypatch):
    """Control: AWQ's packing order ignored (nibble j read as output 8c + j)."""
    q, deq = _write(base, tmp_path, "awq-gemm-g32")
    monkeypatch.setattr(prequantized, "AWQ_ORDER", tuple(range(8)))
    _fails_against_oracle(q, deq)


def test_the_codes_are_read_as_stored(base, tmp_path):
    """No requantizing: the uint4 codes, zero points and scales read from a GPTQ v1 checkpoint are the packer's,
    bit for bit (scales as fp16 widened), and a layer dequantizes to the packer's float weight exactly."""
    from safetensors.numpy import load_file
    from tlaloc_jax.kernels.quantized_matmul import dequantize
    q, deq = _write(base, tmp_path, "gptq-v1-asym-g32")
    _, weights = load_checkpoint(q)
    w = weights["attn.q_proj"]
    assert isinstance(w, QuantizedWeight) and w.scheme == "uint4" and w.group == 32 and w.zeros.dtype == np.int8
    want = load_file(deq / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"]
    layer = QuantizedWeight(w.codes[1], w.scales[1], w.scheme, w.group, w.compute, zeros=w.zeros[1])
    np.testing.assert_array_equal(dequantize(layer).astype(np.float32), want.T)


@pytest.mark.parametrize("edit,error,message", [
    (dict(quant_method="bitsandbytes"), ConfigError, "quant_method 'bitsandbytes'"),
    (dict(bits=3), CheckpointError, "quantization_config.bits = 3"),
    (dict(group_size=48), CheckpointError, "quantization_config.group_size = 48"),
    (dict(group_size=-1), CheckpointError, "quantization_config.group_size = -1"),
    (dict(checkpoint_format="marlin"), CheckpointError, "checkpoint_format = 'marlin'"),
], ids=["method", "bits", "group", "per-channel", "format"])
def test_gptq_configs_are_refused_by_name(base, tmp_path, edit, error, message):
    q, _ = _write(base, tmp_path, "gptq-v2-sym-g32")
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"].update(edit)
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error, match=message):
        load_checkpoint(q)


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 32}, "version = 'gemv'"),
    ({"quant_method": "awq", "version": "exllama", "bits": 4, "group_size": 32}, "version = 'exllama'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {"weights": {}}}},
     "format = 'int-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 8, "strategy": "group", "group_size": 32, "symmetric": True}}}}, "strategy = 'group"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "strategy": "group", "group_size": 32}, "input_activations": {"num_bits": 8}}}},
     "input_activations"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size = None"),
], ids=["awq-gemv", "awq-exllama", "ct-format", "ct-int8-group", "ct-activations", "fp8-static", "fp8-no-block"])
def test_other_layouts_are_refused_by_name(qc, message):
    with pytest.raises(CheckpointError, match=message):
        prequantized.quant_config({"quantization_config": qc})


def test_desc_act_groups_and_requantizing_are_refused(base, tmp_path):
    q, _ = _write(base, tmp_path, "gptq-v2-sym-g32")
    with pytest.raises(ExportError, match="already quantized .*--weight-quant none"):
        export_checkpoint(q, tmp_path / "art", batch_ladder=(1,), context_ladder=(64,), progress=False,
                          weight_quant="int8")
    from safetensors.numpy import load_file, save_file
    tensors = load_file(q / "model.safetensors")
    g = tensors["model.layers.0.mlp.down_proj.g_idx"]
    tensors["model.layers.0.mlp.down_proj.g_idx"] = np.ascontiguousarray(g[::-1])
    save_file(tensors, str(q / "model.safetensors"))
    with pytest.raises(CheckpointError, match="down_proj.g_idx .*desc_act"):
        load_checkpoint(q)
    shutil.rmtree(q)
