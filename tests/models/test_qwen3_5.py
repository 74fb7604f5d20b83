"""Gated DeltaNet models (Qwen3.5, Qwen3-Next): the family tables, the state pools, and transformers parity.

The linear-attention layers keep per-sequence state in two stacked pools ("conv" [L, slots, C, W - 1],
"recurrent" [L, slots, Hv, Dk, Dv]) indexed by each row's state slot; these tests check them against
transformers' greedy ids, against the same prompts run alone or whole, and with controls that must fail.
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import tlaloc_jax
from hf_models import assert_random_weights_round_trip, build_checkpoint, load_hf_torch, torch_greedy
from margins import assert_within
from oracle import GreedyMismatch, check_greedy_batch, engine_next_token, transposed_weight
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.checkpoint import load_checkpoint, save_checkpoint
from tlaloc_jax.config import FULL, LINEAR, ConfigError
from tlaloc_jax.decoder import StepInputs, init_pools, pool_shapes
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.serve.core.kv_cache import UnitPool
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs, pages_for
from tlaloc_jax.serve.model_runner import ModelRunner

pytestmark = pytest.mark.numeric

# Two prompts longer than one 64-token chunk of the gated delta rule (the batch is prefilled at T = 128,
# two chunks), and short ones.
LONG = [[(i * 37 + 11) % 256 for i in range(100)], [(i * 11 + 5) % 253 for i in range(70)]]
PROMPTS = LONG + [[42], [5, 17, 99, 3, 249, 8, 61]]

CASES = {
    "qwen3_5_text": dict(model_type="qwen3_5_text", seed=51, tied=True),
    "qwen3_next": dict(model_type="qwen3_next", seed=52),
    # The text decoder of a multimodal Qwen3.5 checkpoint (weights under model.language_model.*).
    "qwen3_5": dict(model_type="qwen3_5", seed=53),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers' reference delta rule is a Python loop of small ops: with torch's threads competing with
    XLA's and other processes' on a small machine it runs 100x slower than on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {}


def _checkpoint(checkpoints, tmp_path_factory, name):
    if name not in checkpoints:
        checkpoints[name] = build_checkpoint(tmp_path_factory.mktemp(name), **CASES[name])
    return checkpoints[name]


# The multimodal config (qwen3_5; its text decoder is qwen3_5_text's) and qwen3_next (served against transformers
# in test_served_gives_transformers_ids_with_state_pools) in `make test-slow`.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("qwen3_5", "qwen3_next") else n
                                  for n in CASES])
def test_greedy_ids_and_first_logits_match_transformers(name, checkpoints, tmp_path_factory):
    path = _checkpoint(checkpoints, tmp_path_factory, name)
    ref = load_hf_torch(path)
    model = tlaloc_jax.load_hf(path)
    assert model.config.layer_types.count(LINEAR) == 3 * model.config.layer_types.count(FULL)
    bound = tol.bound(tol.decoder_roundings_of(model.config, context=max(map(len, PROMPTS)) + 16))
    want = [torch_greedy(ref, prompt, 16) for prompt in PROMPTS]
    check_greedy_batch(PROMPTS, model.generate(PROMPTS, max_new_tokens=16), want, logit_bound=bound,
                       next_token=engine_next_token(model))
    for prompt, first, oracle in zip(PROMPTS, model.first_logits(PROMPTS), want):
        assert_within(relative_error(first, oracle.logits[0]), bound, f"{name}, prompt of {len(prompt)}: first logits")
    # Control: the attention layers' output projection read transposed.
    broken = transposed_weight(model)
    with pytest.raises(GreedyMismatch):
        check_greedy_batch(PROMPTS, broken.generate(PROMPTS, max_new_tokens=16), want, logit_bound=bound,
                           next_token=engine_next_token(broken))


# ---------------------------------------------------------------------------------------------------
# The family tables: the interleaved Qwen3-Next projections, the multimodal config, refusals.


@torch.no_grad()
def test_qwen3_next_interleaved_projections_split_as_transformers_does(checkpoints, tmp_path_factory):
    """in_proj_qkvz / in_proj_ba are interleaved per key head; the table's splits give transformers' q, k, v,
    z, b, a. Control: cutting the same tensors into contiguous blocks gives other values."""
    path = _checkpoint(checkpoints, tmp_path_factory, "qwen3_next")
    cfg, w = load_checkpoint(path)
    attn = load_hf_torch(path).model.layers[1].linear_attn          # linear layer 1 = slot index 1
    x = torch.randn(1, 5, cfg.hidden_size)
    q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x), attn.in_proj_ba(x))
    want_qkv = torch.cat([t.reshape(1, 5, -1) for t in (q, k, v)], dim=-1).numpy()
    xn = x.numpy()
    bound = tol.bound(cfg.hidden_size)                              # numpy's and torch's hidden-size dots
    for slot, want in (("in_qkv", want_qkv), ("in_z", z.reshape(1, 5, -1).numpy()), ("in_b", b.numpy()),
                       ("in_a", a.numpy())):
        assert_within(relative_error(xn @ w[f"linear.{slot}"][1], want), bound, f"split {slot}")
    contiguous = xn @ attn.in_proj_qkvz.weight.numpy().T[:, :cfg.linear.conv_channels]
    assert np.abs(contiguous - want_qkv).max() > 1e-2


def test_save_checkpoint_inverts_the_splits(checkpoints, tmp_path_factory, tmp_path):
    """Loading a transformers checkpoint and saving it back writes every tensor it read, bit for bit (the
    interleaved in_proj_qkvz, in_proj_ba and the gated q_proj rebuilt from their slots)."""
    path = _checkpoint(checkpoints, tmp_path_factory, "qwen3_next")
    hf_config = json.loads((path / "config.json").read_text())
    cfg, w = load_checkpoint(path)
    out = load_file(save_checkpoint(tmp_path / "c", hf_config, w) / "model.safetensors")
    original = load_file(path / "model.safetensors")
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in out
    assert "model.layers.3.self_attn.q_proj.weight" in out
    for name, arr in out.items():
        np.testing.assert_array_equal(arr, original[name], err_msg=name)


def test_random_weights_round_trip_through_qwen3_next_and_qwen3_5_text(tmp_path):
    for model_type in ("qwen3_next", "qwen3_5_text"):
        hf = dict(model_type=model_type, vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=6, linear_key_head_dim=4, linear_value_head_dim=2)
        assert_random_weights_round_trip(hf, tmp_path / model_type)


def test_hybrid_config_keys():
    base = dict(model_type="qwen3_next", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=8,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=4, num_experts=0,
                full_attention_interval=4)
    _, cfg = config_from_hf(base)
    assert cfg.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    assert cfg.rope.partial_rotary_factor == 0.25          # transformers' default for these families
    assert cfg.residual.norm_offset == 1.0 and cfg.linear.conv_kernel == 4
    assert cfg.attention.qk_norm and cfg.attention.output_gate
    assert cfg.linear.conv_channels == 2 * 2 * 4 + 4 * 4 and cfg.linear.group == 2
    _, cfg = config_from_hf(dict(base, full_attention_interval=2, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}))
    assert cfg.layer_types == (LINEAR, FULL) * 4 and cfg.rope.partial_rotary_factor == 0.5
    # Every layer listed as dense (mlp_only_layers) is dense whatever num_experts says.
    config_from_hf(dict(base, num_experts=8, mlp_only_layers=list(range(8))))


def test_mixture_of_experts_config_keys_and_refusals():
    base = dict(model_type="qwen3_next", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                num_attention_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=4, linear_value_head_dim=4)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20)
    _, cfg = config_from_hf(dict(base, **moe))
    assert (cfg.experts.num_experts, cfg.experts.experts_per_token, cfg.experts.intermediate_size) == (8, 2, 12)
    assert cfg.experts.router_normalize and cfg.shared_expert and cfg.experts.shared_intermediate_size == 20
    assert not config_from_hf(dict(base, **moe, norm_topk_prob=False))[1].experts.router_normalize
    # Dense layers among the sparse ones, as transformers builds them.
    assert config_from_hf(dict(base, **moe, decoder_sparse_step=2))[1].mlp_types == ("dense", "sparse") * 2
    assert config_from_hf(dict(base, **moe, mlp_only_layers=[1]))[1].mlp_types == ("sparse", "dense", "sparse", "sparse")
    # Qwen3.5's table has no experts.
    with pytest.raises(ConfigError, match=r"qwen3_5_text layers \[0, 1, 2, 3\] have sparse mixture-of-experts"):
        config_from_hf(dict(base, **moe, model_type="qwen3_5_text"))
    with pytest.raises(ConfigError, match=r"unknown model_type 'qwen3_5_moe'"):
        config_from_hf(dict(base, model_type="qwen3_5_moe"))
    with pytest.raises(ConfigError, match="missing the key 'linear_num_key_heads'"):
        config_from_hf({k: v for k, v in base.items() if k != "linear_num_key_heads"})


def test_qwen3_5_checkpoint_reads_its_text_decoder(checkpoints, tmp_path_factory):
    path = _checkpoint(checkpoints, tmp_path_factory, "qwen3_5")
    cfg, w = load_checkpoint(path)
    hf = load_file(path / "model.safetensors")
    assert cfg.model_type == "qwen3_5" and cfg.hidden_size == 64 and cfg.num_layers == 4
    assert dict(cfg.refused_tokens) == {250: "image_token_id", 251: "video_token_id"}
    np.testing.assert_array_equal(w["embed"], hf["model.language_model.embed_tokens.weight"])
    conv = hf["model.language_model.layers.2.linear_attn.conv1d.weight"]        # [C, 1, W]
    np.testing.assert_array_equal(w["linear.conv"][2], conv[:, 0])


# ---------------------------------------------------------------------------------------------------
# State pools: batched, chunked and padded prefill against the solo whole prompt.

S = 8            # tokens per page
WIDTH = 16       # block-table entries: context 128
T = 128          # tokens of a whole-prompt call: two chunks of the gated delta rule
BATCH = [LONG[1], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9], [200, 201, 202]]


@pytest.fixture(scope="module")
def model(checkpoints, tmp_path_factory):
    return tlaloc_jax.load_hf(_checkpoint(checkpoints, tmp_path_factory, "qwen3_5_text"), block_size=S)


def _nan_pools(model, slots):
    """Pools whose state slots all hold NaN: what a freed slot may hold. A row starting at position 0 must
    never read it."""
    pools = model.new_pools(64, slots)
    return {k: v if k == "kv" else v * np.nan for k, v in pools.items()}


def _state_of(pools, slot):
    return {k: np.asarray(pools[k])[:, slot] for k in ("conv", "recurrent")}


def _solo(model, prompt):
    pages = UnitPool(64).take(pages_for(len(prompt), S))
    inputs = build_step_inputs([RowCall(prompt, 0, pages, state_slot=1)], batch=1, tokens=T, width=WIDTH,
                               block_size=S, state_slots=True)
    logits, pools = model.step(_nan_pools(model, 2), inputs)
    return np.asarray(logits)[0], _state_of(pools, 1)


def test_prompts_prefilled_together_give_their_solo_logits_and_states(model):
    alloc = UnitPool(64)
    slots = [2, 0, 3]                       # slot 1 stays unused; row 3 is empty (slot -1)
    rows = [RowCall(p, 0, alloc.take(pages_for(len(p), S)), state_slot=s) for p, s in zip(BATCH, slots)]
    rows.append(RowCall([], 0, None))
    inputs = build_step_inputs(rows, batch=4, tokens=T, width=WIDTH, block_size=S, state_slots=True)
    assert inputs["state_slots"].tolist() == [2, 0, 3, -1]
    logits, pools = model.step(_nan_pools(model, 4), inputs)
    logits = np.asarray(logits)
    bound = tol.bound(tol.decoder_roundings_of(model.config, context=T))
    for b, (prompt, slot) in enumerate(zip(BATCH, slots)):
        solo_logits, solo_state = _solo(model, prompt)
        assert_within(relative_error(logits[b], solo_logits), bound, f"batched row {b}: logits")
        for name, state in _state_of(pools, slot).items():
            assert_within(relative_error(state, solo_state[name]), bound, f"batched row {b}: {name} state")
    # Neither the unused slot nor the empty row was written or read into another.
    assert all(np.isnan(v).all() for v in _state_of(pools, 1).values())


def _chunked(model, prompt, chunk, padding_updates_state=False):
    pages = UnitPool(64).take(pages_for(len(prompt), S))
    pools = _nan_pools(model, 1)
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        inputs = build_step_inputs([RowCall(piece, start, pages, state_slot=0)], batch=1, tokens=chunk,
                                   width=WIDTH, block_size=S, state_slots=True)
        if padding_updates_state:
            # The bug this control stands for: padding columns taken as live tokens (given a position)
            # by the linear layers. They write no keys (slot mapping -1) and are never attended.
            pad = inputs["positions"][0] < 0
            inputs["positions"][0, pad] = start
        logits, pools = model.step(pools, inputs)
    return np.asarray(logits)[0], _state_of(pools, 0)


def test_chunked_prefill_gives_whole_prompt_logits_and_states(model):
    """Chunks of 16 against the whole prompt in one call: the gated delta rule's chunked form sums in another
    order for another chunk length, within the tolerance model's bound; the control below breaks it by more
    than 1e-3."""
    prompt = LONG[1]                       # 70 tokens in chunks of 16: the last chunk has 10 padding columns
    whole, whole_state = _solo(model, prompt)
    got, state = _chunked(model, prompt, 16)
    bound = tol.bound(tol.decoder_roundings_of(model.config, context=len(prompt)))
    assert_within(relative_error(got, whole), bound, "chunked prefill: logits")
    for name in state:
        assert_within(relative_error(state[name], whole_state[name]), bound, f"chunked prefill: {name} state")


def test_control_padding_that_updates_the_state_breaks_chunked_prefill(model):
    prompt = LONG[1]
    whole, _ = _solo(model, prompt)
    got, _ = _chunked(model, prompt, 16, padding_updates_state=True)
    assert np.abs(got - whole).max() > 1e-3 * np.abs(whole).max()


def test_control_a_row_past_position_0_reads_its_slot(model):
    """The NaN fill bites: a row whose first token is past position 0 continues from its slot (here NaN), so
    only a row starting at position 0 may skip reading it."""
    pages = UnitPool(64).take(4)
    inputs = build_step_inputs([RowCall(LONG[1][16:32], 16, pages, state_slot=0)], batch=1, tokens=16,
                               width=WIDTH, block_size=S, state_slots=True)
    logits, _ = model.step(_nan_pools(model, 1), inputs)
    assert np.isnan(np.asarray(logits)).all()


def test_state_pools_need_slots_and_step_inputs_need_state_slots(model):
    cfg = model.config
    with pytest.raises(ValueError, match="6 linear-attention layers: its pools need state_slots >= 1"):
        pool_shapes(cfg, 4, S)
    shapes = pool_shapes(cfg, 4, S, state_slots=3)
    assert shapes["conv"] == (6, 3, cfg.linear.conv_channels, 3)
    assert shapes["recurrent"] == (6, 3, cfg.linear.value_heads, cfg.linear.key_dim, cfg.linear.value_dim)
    assert shapes["kv"][0] == 2
    pools = init_pools(cfg, 4, S, state_slots=3)
    assert all(str(pools[k].dtype) == "float32" for k in ("conv", "recurrent"))
    inputs = build_step_inputs([RowCall([1, 2], 0, [0])], batch=1, tokens=2, width=1, block_size=S)
    with pytest.raises(ValueError, match="need state_slots"):
        model.step(pools, inputs)
    with pytest.raises(ValueError, match="row 0 has 2 tokens but no state slot"):
        build_step_inputs([RowCall([1, 2], 0, [0])], batch=1, tokens=2, width=1, block_size=S, state_slots=True)
    assert "state_slots" in StepInputs._fields


def test_donated_state_pools_are_written_in_place(model):
    """Each layer's states are scattered straight into the stacked pools: the compiled step copies no pool,
    and the pools it returns are the donated buffers."""
    pools = model.new_pools(64, 2)
    inputs = build_step_inputs([RowCall(LONG[1][:16], 0, [0, 1], state_slot=1)], batch=1, tokens=16,
                               width=WIDTH, block_size=S, state_slots=True)
    hlo = model._step.lower(model.weights, pools, StepInputs(**{k: jnp.asarray(v) for k, v in inputs.items()})
                            ).compile().as_text()
    for name in ("conv", "recurrent"):
        shape = "f32[" + ",".join(map(str, pools[name].shape)) + "]"
        assert not re.search(rf"= {re.escape(shape)}\{{[0-9,]*\}} copy\(", hlo), f"the {name} pool is copied"
    before = {k: v.unsafe_buffer_pointer() for k, v in pools.items()}
    _, pools = model.step(pools, inputs)
    assert {k: v.unsafe_buffer_pointer() for k, v in pools.items()} == before


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next"])
def test_served_gives_transformers_ids_with_state_pools(name, checkpoints, tmp_path_factory, tmp_path, monkeypatch,
                                                        serve_cache_dir):
    """Exported with their state pools (conv and recurrent: state_slots, a slot per sequence) beside the KV
    pages, and served by the JAX-free runtime: prompts longer than a prefill chunk carry their state across
    chunks; alone and decoded together they give transformers' greedy ids (near-tie rule). Control: every
    sequence handed slot 0 (sequences decoded together read and write each other's state) fails the check."""
    from tlaloc_jax import artifact as af
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.serve import Engine
    path = _checkpoint(checkpoints, tmp_path_factory, name)
    m = export_checkpoint(path, tmp_path / "art", batch_ladder=(4,), context_ladder=(128,), block_size=8,
                          prefill_chunk=32, prefill_long_chunk=0, progress=False)
    assert {p.name: p.kind for p in m.pools} == {"kv": af.PoolKind.PAGED_KV, "conv": af.PoolKind.STATE_SLOTS,
                                                 "recurrent": af.PoolKind.STATE_SLOTS}
    ref = load_hf_torch(path)
    want = [torch_greedy(ref, p, 16) for p in PROMPTS]
    cfg = tlaloc_jax.load_hf(path).config
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=max(map(len, PROMPTS)) + 16))

    def check(eng):
        next_token = engine_next_token(eng)
        check_greedy_batch(PROMPTS, [eng.generate([p], 16)[0] for p in PROMPTS], want, logit_bound=bound,
                           next_token=next_token)
        check_greedy_batch(PROMPTS, eng.generate(PROMPTS, 16), want, logit_bound=bound, next_token=next_token)

    with Engine.load(tmp_path / "art", cache_dir=serve_cache_dir, progress=False) as eng:
        check(eng)
        assert eng.stats()["pools"]["recurrent"]["pages_in_use"] == 0
        import tlaloc_jax.serve.core.inputs as inputs_module
        real = inputs_module.build_step_inputs

        def one_slot_for_all(*args, **kwargs):
            out = real(*args, **kwargs)
            out["state_slots"] = np.where(out["state_slots"] >= 0, 0, -1).astype(np.int32)
            return out

        monkeypatch.setattr(inputs_module, "build_step_inputs", one_slot_for_all)
        with pytest.raises(GreedyMismatch):
            check(eng)


SHARED_PREFIX = [(i * 29 + 3) % 250 + 3 for i in range(48)]           # six pages of 8


@pytest.mark.parametrize("name", ["qwen3_5_text", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_state_snapshots_give_exact_prefix_hits_and_queued_prompts_their_solo_ids(name, checkpoints,
                                                                                   tmp_path_factory, tmp_path,
                                                                                   monkeypatch, serve_cache_dir):
    """Exported with the default state slots (a slot per sequence of the pool, 4, and 4 spares): ten prompts, five of
    them sharing a 48-token prefix, decoded together with up to 16 running, more than the slots. Every row equals
    its solo run without prefix caching; with caching, sequences start from a snapshot of the recurrent state
    (copied into their slot by the copy_slots entry) and the shared pages, and the ids are the same. Control: a
    restore that copies nothing (the sequence starts from its slot's stale state) gives other ids."""
    from tlaloc_jax import artifact as af
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.serve import Engine
    path = _checkpoint(checkpoints, tmp_path_factory, name)
    m = export_checkpoint(path, tmp_path / "art", batch_ladder=(4,), context_ladder=(128,), block_size=8,
                          prefill_chunk=32, prefill_long_chunk=0, progress=False)
    assert m.capacity(af.PoolKind.STATE_SLOTS) == 8
    assert [e.batch for e in m.entries if e.kind == af.EntryKind.COPY_SLOTS] == [4]
    prompts = [SHARED_PREFIX + [(j * 7 + 1) % 250 + 3 for j in range(k + 2)] for k in range(5)] + \
        [[(i * 17 + k) % 250 + 3 for i in range(20 + 9 * k)] for k in range(5)]
    with Engine.load(tmp_path / "art", cache_dir=serve_cache_dir, progress=False,
                     enable_prefix_caching=False) as eng:
        solo = [eng.generate([p], 12)[0] for p in prompts]
        assert eng.generate(prompts, 12) == solo
    with Engine.load(tmp_path / "art", cache_dir=serve_cache_dir, progress=False, max_num_seqs=16) as eng:
        assert eng.scheduler.prefix_caching
        assert eng.generate(prompts[:1], 12) == solo[:1]          # leaves snapshots at 32 and 40 behind
        assert eng.generate(prompts, 12) == solo
        st = eng.stats()
        assert st["prefix_hits"] >= 4 * 40 and st["slot_copies"] > 0
        assert st["pools"]["recurrent"]["pages_in_use"] == 0

    real = ModelRunner.copy_slots
    restored = []

    def no_restore(self, copies):
        if copies and copies[0].hash is None:           # restores: copy nothing, keep the slot's stale state
            restored.extend(copies)
            self.scheduler.kv.commit_copies(copies, True)
            return True
        return real(self, copies)
    with Engine.load(tmp_path / "art", cache_dir=serve_cache_dir, progress=False, max_num_seqs=16) as eng:
        assert eng.generate(prompts[5:], 12) == solo[5:]          # the slots hold other sequences' states
        assert eng.generate(prompts[:1], 12) == solo[:1]          # leaves snapshots of the shared prefix
        monkeypatch.setattr(ModelRunner, "copy_slots", no_restore)
        assert eng.generate(prompts[1:5], 12) != solo[1:5]
        assert restored
