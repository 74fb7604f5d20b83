"""Dense families with their checkpoint quirks, against transformers: qwen2 (biases on q, k and v), phi3 (q|k|v and
gate|up fused in the checkpoint, LongRoPE), olmo2 (norms after attention and the MLP only, q/k norms over the
whole projection), granite (multipliers on the residual stream and the scores' scale given).

Greedy ids (near-tie rule, tests/support/oracle.py) and first logits in process, then served by the JAX-free runtime
alone and 4 at once; each family with a control that must fail: its quirk left out.

LongRoPE. transformers rotates every position of a sequence longer than original_max_position_embeddings (64
here) with the long factors and of a shorter one with the short factors, choosing again at each call from the
sequence's length; a KV cache written earlier cannot follow such a switch, so this library chooses one set for
every position from the context it serves (DecoderConfig.with_context: the long set past 64, as vLLM does for
max_model_len). Each regime is checked on the prompts whose whole run stays in it.
"""

from __future__ import annotations


import numpy as np
import pytest

import tlaloc_jax
from hf_models import assert_saved_back, build_checkpoint, load_hf_torch, torch_greedy
from margins import assert_within
from oracle import GreedyMismatch, check_greedy_batch, check_served_greedy, engine_next_token, kv_one_slot_off
from tlaloc_jax.checkpoint import load_checkpoint
from tlaloc_jax.config import FULL, SLIDING, ConfigError
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.layers import rope_inv_freq

pytestmark = pytest.mark.numeric

LONG = [[(i * 37 + 11) % 256 for i in range(100)], [(i * 11 + 5) % 253 for i in range(70)]]
SHORT = [[42], [5, 17, 99, 3, 249, 8, 61]]
PROMPTS = LONG + SHORT
NEW = 16
CASES = {"qwen2": 71, "phi3": 72, "olmo2": 73, "granite": 74}
# phi3's runs of SHORT stay within 64 positions, those of LONG are past 64 from their first step; the served check
# takes four of the latter.
PHI3_LONG4 = LONG + [[(i * 13 + 7) % 251 for i in range(90)], [(i * 29 + 3) % 256 for i in range(66)]]


@pytest.fixture(scope="module")
def store():
    return {}


def checkpoint(store, tmp_path_factory, name):
    if name not in store:
        store[name] = build_checkpoint(tmp_path_factory.mktemp(name), name, seed=CASES[name])
    return store[name]


def oracle(store, tmp_path_factory, name, prompts):
    key = (name, tuple(map(tuple, prompts)))
    if key not in store:
        ref = load_hf_torch(checkpoint(store, tmp_path_factory, name))
        store[key] = [torch_greedy(ref, p, NEW) for p in prompts]
    return store[key]


def logit_bound(cfg) -> float:
    return tol.bound(tol.decoder_roundings_of(cfg, context=max(map(len, PROMPTS)) + NEW))




def without_quirk(name, model):
    """Control: the model with its family's quirk left out."""
    cfg, w = model.config, model.weights
    if name == "qwen2":
        w = {k: v * 0 if k.endswith("_bias") else v for k, v in w.items()}
    elif name == "phi3":       # the other factor set
        cfg = cfg.replace(rope=cfg.rope.__class__(**{**cfg.rope.__dict__, "long_factors": not cfg.rope.long_factors}))
    elif name == "olmo2":      # the norms after attention and the MLP dropped
        cfg = cfg.replace(residual=dict(sandwich_norms=False))
    else:
        cfg = cfg.replace(residual=dict(multiplier=1.0))
    return tlaloc_jax.Model(cfg, w, block_size=model.block_size)


# (family, the context the model serves, the prompts checked there). make test runs phi3 at 128 positions (the
# fused checkpoint tensors, LongRoPE's long factors); the others run in make test-slow, where every family is also
# served against transformers.
IN_PROCESS = [pytest.param("phi3", 128, LONG, id="phi3-long"),
              pytest.param("phi3", 64, SHORT, id="phi3-short", marks=pytest.mark.slow),
              *(pytest.param(n, None, PROMPTS, id=n, marks=pytest.mark.slow) for n in CASES if n != "phi3")]


@pytest.mark.parametrize("name, context, prompts", IN_PROCESS)
def test_in_process_gives_transformers_ids_and_first_logits(name, context, prompts, store, tmp_path_factory):
    """Prompts prefilled and decoded together in process give transformers' greedy ids (near-tie rule) and first
    logits within the tolerance model's bound. Control: the family's quirk left out (phi3: the other factor set)
    moves the first logits far past it."""
    path = checkpoint(store, tmp_path_factory, name)
    want = oracle(store, tmp_path_factory, name, prompts)
    model = tlaloc_jax.load_hf(path, block_size=8, context=context)
    bound = logit_bound(model.config)
    check_greedy_batch(prompts, model.generate(prompts, NEW), want, logit_bound=bound,
                       next_token=engine_next_token(model))
    for prompt, first, run in zip(prompts, model.first_logits(prompts), want):
        assert_within(relative_error(first, run.logits[0]), bound, f"{name}, prompt of {len(prompt)}: first logits")
    broken = without_quirk(name, model).first_logits(prompts)
    assert max(relative_error(b, run.logits[0]) for b, run in zip(broken, want)) > 100 * bound


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_served_gives_transformers_ids(name, store, tmp_path_factory, tmp_path, monkeypatch, serve_cache_dir):
    """Exported (decode and 32-token prefill chunks, batches 1 and 4, contexts 64 and 128: phi3 then rotates with
    its long factors, checked on four prompts past 64) and served by the JAX-free runtime: each prompt alone, then
    all decoded together, give transformers' greedy ids (near-tie rule). Control: keys and values written one slot
    off fail the check."""
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.serve import Engine
    path = checkpoint(store, tmp_path_factory, name)
    prompts = PHI3_LONG4 if name == "phi3" else PROMPTS
    want = oracle(store, tmp_path_factory, name, prompts)
    export_checkpoint(path, tmp_path / "art", batch_ladder=(1, 4), context_ladder=(64, 128), block_size=8,
                      prefill_chunk=32, prefill_long_chunk=0, progress=False)
    bound = tol.bound(tol.decoder_roundings_of(load_checkpoint(path)[0], context=128))

    with Engine.load(tmp_path / "art", cache_dir=serve_cache_dir, progress=False) as eng:
        check_served_greedy(eng, prompts, want, logit_bound=bound, new=NEW)
        kv_one_slot_off(monkeypatch)
        with pytest.raises(GreedyMismatch):
            check_served_greedy(eng, prompts, want, logit_bound=bound, new=NEW)


# ---------------------------------------------------------------------------------------------------
# The family tables.


@pytest.mark.parametrize("name", list(CASES))
def test_save_checkpoint_writes_back_every_tensor(name, store, tmp_path_factory, tmp_path):
    """Load a transformers checkpoint and save it back: every tensor bit for bit (phi3's qkv_proj and gate_up_proj
    rebuilt from their slots)."""
    assert_saved_back(checkpoint(store, tmp_path_factory, name), tmp_path / "c")


BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8)


def test_config_keys_and_refusals():
    q = config_from_hf(dict(BASE, model_type="qwen2"))[1]
    assert q.attention.bias and not q.attention.output_bias and q.layer_types == (FULL,) * 4
    # use_sliding_window: the layers from max_window_layers on slide, as transformers builds them.
    q = config_from_hf(dict(BASE, model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2))[1]
    assert q.layer_types == (FULL, FULL, SLIDING, SLIDING) and q.sliding_window == 8
    o = config_from_hf(dict(BASE, model_type="olmo2"))[1]
    assert (o.residual.input_norms, o.residual.sandwich_norms) == (False, True)
    assert (o.attention.qk_norm, o.attention.qk_norm_whole, o.attention.bias) == (True, True, False)
    g = config_from_hf(dict(BASE, model_type="granite", attention_multiplier=0.25, embedding_multiplier=12.0))[1]
    assert g.query_scale == 0.25
    assert (g.residual.embedding_multiplier, g.residual.multiplier, g.residual.logits_scaling) == (12.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="granite config key mlp_bias=True is not supported"):
        config_from_hf(dict(BASE, model_type="granite", mlp_bias=True))
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    p = config_from_hf(dict(BASE, model_type="phi3", original_max_position_embeddings=64, max_position_embeddings=256,
                            rope_scaling=dict(longrope, type="su")))[1]
    assert p.rope.rope_type == "longrope" and p.rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(4) / np.log(64)))
    assert not p.rope.long_factors and p.with_context(65).rope.long_factors and not p.with_context(64).rope.long_factors
    with pytest.raises(ConfigError, match=r"longrope short_mscale=1.2 \(config key rope_parameters/rope_scaling\)"):
        config_from_hf(dict(BASE, model_type="phi3", max_position_embeddings=256,
                            rope_scaling=dict(longrope, short_mscale=1.2)))
    with pytest.raises(ConfigError, match=r"phi3 longrope short_factor and long_factor need 4 entries each"):
        config_from_hf(dict(BASE, model_type="phi3", original_max_position_embeddings=64, max_position_embeddings=256,
                            rope_scaling=dict(longrope, short_factor=[1.0] * 3)))
    # Without the top-level key, transformers' Phi3Config default (4096); another family needs the key.
    p = config_from_hf(dict(BASE, model_type="phi3", max_position_embeddings=8192, rope_scaling=longrope))[1]
    assert p.rope.original_max_position_embeddings == 4096
    with pytest.raises(ConfigError, match="longrope rope scaling needs 'original_max_position_embeddings'"):
        config_from_hf(dict(BASE, model_type="llama", rope_scaling=longrope))


@pytest.mark.parametrize("params", [
    dict(original_max_position_embeddings=4096),
    dict(original_max_position_embeddings=4096, factor=2.0),
    dict(original_max_position_embeddings=4096, attention_factor=1.19),
    dict(original_max_position_embeddings=1024, partial_rotary_factor=0.75),
], ids=["defaults", "factor", "attention_factor", "partial"])
@pytest.mark.parametrize("long", [False, True])
def test_longrope_frequencies_match_transformers(params, long):
    """LongRoPE's inverse frequencies (short or long factors) and cos/sin scale against transformers' own
    computation: the short set for a sequence within original_max_position_embeddings (transformers' seq_len
    None or below it), the long set past it; the scale from max_position_embeddings / original unless the config
    gives factor or attention_factor. Control: the other set differs."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = dict(params)
    partial = params.pop("partial_rotary_factor", 1.0)
    half = int(64 * partial) // 2
    rng = np.random.default_rng(1)
    factors = dict(short_factor=list(1 + rng.random(half)), long_factor=list(2 + 30 * rng.random(half)))
    original = params.pop("original_max_position_embeddings")
    # Phi-3's files keep the original context at the top level, which wins over one in the rope parameters.
    rope_parameters = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=partial,
                           original_max_position_embeddings=original // 2, **factors, **params)
    hf = dict(model_type="phi3", vocab_size=8, hidden_size=128, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=2, head_dim=64, max_position_embeddings=131072, rope_parameters=rope_parameters,
              original_max_position_embeddings=original, pad_token_id=None, eos_token_id=None)
    config = Phi3Config(**{k: v for k, v in hf.items() if k != "model_type"})
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=original + 1 if long else None)
    chosen = config_from_hf(hf)[1].with_context(original + 1 if long else original).rope
    assert chosen.attention_factor == pytest.approx(want_factor, rel=1e-12)
    rtol = tol.bound(tol.TRANSCENDENTAL_ULPS + 3)    # pow, the factor's product, the divide
    np.testing.assert_allclose(rope_inv_freq(chosen, 64), want_inv.numpy(), rtol=rtol, atol=0)
    other = chosen.__class__(**{**chosen.__dict__, "long_factors": not long})
    assert np.abs(rope_inv_freq(other, 64) / want_inv.numpy() - 1).max() > 1e-2
