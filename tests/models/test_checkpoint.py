"""Checkpoint reading: families, refusals by name, tied heads."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_models import LLAMA3_ROPE, assert_random_weights_round_trip, build_checkpoint
from tlaloc_jax.checkpoint import CheckpointError, load_checkpoint
from tlaloc_jax.config import ConfigError
from tlaloc_jax.decoder import StepInputs, forward, init_pools
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.hf_config import read_rope


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_unknown_model_type_is_refused_by_name(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "c")
    _edit_config(path, model_type="mamba9")
    with pytest.raises(ConfigError, match=r"unknown model_type 'mamba9'"):
        load_checkpoint(path)


def test_missing_tensor_is_refused_by_name(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_checkpoint(path)


def test_wrong_shape_is_refused_by_name(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \[16, 64\], "
                                              r"expected \[32, 64\]"):
        load_checkpoint(path)


def test_unsupported_config_flags_are_refused_by_name():
    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    with pytest.raises(ConfigError, match="attention_bias"):
        config_from_hf(dict(base, attention_bias=True))
    with pytest.raises(ConfigError, match="rope type 'dynamic'"):
        config_from_hf(dict(base, rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ConfigError, match="longrope rope scaling needs 'short_factor'"):
        config_from_hf(dict(base, rope_parameters={"rope_type": "longrope", "factor": 2.0}))
    with pytest.raises(ConfigError, match="yarn rope scaling needs 'original_max_position_embeddings'"):
        config_from_hf(dict(base, rope_parameters={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ConfigError, match=r"quantization_config \(quant_method 'mxfp4'\)"):
        config_from_hf(dict(base, quantization_config={"quant_method": "mxfp4"}))
    with pytest.raises(ConfigError, match="missing the key 'hidden_size'"):
        config_from_hf({k: v for k, v in base.items() if k != "hidden_size"})


def test_rope_read_from_new_and_legacy_keys():
    new = read_rope({"rope_parameters": dict(LLAMA3_ROPE, rope_theta=500000.0)})
    legacy = read_rope({"rope_theta": 500000.0, "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items()
                                                                  if k != "rope_theta"}})
    assert new == legacy
    assert new.rope_type == "llama3" and new.theta == 500000.0 and new.factor == 8.0
    assert read_rope({"rope_theta": 1234.0}).theta == 1234.0


def test_linears_are_stored_in_out(llama_dir):
    cfg, w = load_checkpoint(llama_dir)
    hf = load_file(llama_dir / "model.safetensors")
    np.testing.assert_array_equal(w["attn.q_proj"][1], hf["model.layers.1.self_attn.q_proj.weight"].T)
    assert w["layers.gate_proj"].shape == (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size)


def test_tied_head_has_no_head_slot_and_contracts_the_embedding_table(tmp_path):
    path = build_checkpoint(tmp_path / "q", "qwen3", tied=True)
    cfg, w = load_checkpoint(path)
    assert cfg.tie_word_embeddings and "head" not in w
    pools = init_pools(cfg, 4, 4)
    inputs = StepInputs(*(jnp.zeros(s, jnp.int32) for s in [(1, 1), (1, 1), (1, 2), (1,), (1, 1)]))
    hlo = jax.jit(lambda w, p, i: forward(cfg, w, p, i)).lower(w, pools, inputs).as_text()
    V, E = cfg.vocab_size, cfg.hidden_size
    # The head is one dot_general contracting the hidden axis of both operands, the table as it is.
    assert re.search(rf"dot_general.*contracting_dims = \[1\] x \[1\].*tensor<{V}x{E}xf32>", hlo)
    assert not re.search(rf"transpose.*-> tensor<{E}x{V}xf32>", hlo), "a transposed copy of the table exists"


def test_save_checkpoint_round_trips_through_the_family_table(tmp_path):
    hf = dict(model_type="qwen3", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)
    assert_random_weights_round_trip(hf, tmp_path / "c")
