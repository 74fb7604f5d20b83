"""MTP heads (tlaloc_jax/mtp_head.py) against torch references built straight from the checkpoint's tensors:
DeepSeek-V3's (transformers' own DeepseekV3DecoderLayer loaded with `model.layers.<N>.*`, the head's norms, eh_proj
and shared head written out beside it) and Qwen3-Next's (Qwen3NextDecoderLayer loaded with `mtp.layers.0.*`, the
zero-centred norms, fc and the decoder's lm_head written out from vLLM's Qwen3NextMultiTokenPredictor). The head
runs as the runtime runs it, over two calls that share its KV pool."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import QWEN3_NEXT_MOE, build_checkpoint
from margins import assert_within
from mtp_checkpoint import (add_mtp_head, add_qwen3_next_mtp, mtp_bound, torch_hidden, torch_mtp,
                            torch_qwen3_next_mtp)
from tlaloc_jax.checkpoint import load_checkpoint, read_config
from tlaloc_jax.config import SPARSE
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax import mtp_head
from tlaloc_jax.mtp_head import POOL, load_mtp_weights, mtp_hidden, mtp_logits, mtp_pool

pytestmark = pytest.mark.numeric

SEED = 69          # tests/models/test_deepseek_v3.py's checkpoint
B, T, SPLIT, PAGE = 2, 10, 4, 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    plain = build_checkpoint(root / "plain", "deepseek_v3", seed=SEED)
    return plain, add_mtp_head(plain, root / "mtp", seed=SEED + 1)


@pytest.fixture(scope="module")
def case(checkpoints):
    """Tokens x [B, T + 2] and transformers' decoder's hidden states h_t of x_0..x_{T-1}, before and after its final
    norm; the head reads x_{t+1} and h_t at position t < T, and x_{T+1} with its own state at T. The reference is
    vLLM's contract: h_t after the final norm, the head's state chained after shared_head.norm."""
    rng = np.random.default_rng(SEED)
    checkpoint = checkpoints[1]
    x = rng.integers(0, load_checkpoint(checkpoint)[0].vocab_size, (B, T + 2)).astype(np.int32)
    before, after = torch_hidden(checkpoint, x[:, :T])
    tokens, chained = x[:, 1:T + 1], x[:, T + 1:]
    return tokens, chained, before, after, torch_mtp(checkpoint, tokens, after, chained)


def jax_mtp(cfg, kind, weights, tokens: np.ndarray, hidden: np.ndarray, chained: np.ndarray | None = None
            ) -> np.ndarray:
    """The head's logits as the runtime runs it: positions [0, SPLIT) in one call, the rest of T in a second that
    reads the first's latents from the pool, then one call per token of chained [B, k] on the state the call
    before returned; each row on pages of its own."""
    ids = tokens if chained is None else np.concatenate([tokens, chained], axis=1)
    pages = -(-ids.shape[1] // PAGE)
    spec = mtp_pool(cfg).to_pool(POOL, B * pages, PAGE)
    pool = jnp.zeros(spec.shape, jnp.float32)
    tables = np.arange(B * pages, dtype=np.int32).reshape(B, pages)
    weights = {k: jnp.asarray(v) for k, v in weights.items()}
    out = []
    for lo, hi in [(0, SPLIT), (SPLIT, T)] + [(t, t + 1) for t in range(T, ids.shape[1])]:
        pos = np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (B, hi - lo))
        slots = np.take_along_axis(tables, pos // PAGE, axis=1) * PAGE + pos % PAGE
        inputs = StepInputs(token_ids=jnp.asarray(ids[:, lo:hi]), positions=jnp.asarray(pos),
                            block_tables=jnp.asarray(tables), seq_lens=jnp.full((B,), hi, jnp.int32),
                            slot_mapping=jnp.asarray(slots.astype(np.int32)))
        h, pool = mtp_hidden(cfg, kind, weights, pool, inputs,
                             jnp.asarray(hidden[:, lo:hi]) if hi <= T else h[:, -1:], key_block=PAGE)
        out.append(np.asarray(mtp_logits(cfg, weights, h)))
    return np.concatenate(out, axis=1)


def _deepseek(checkpoint):
    fam, cfg = config_from_hf(read_config(checkpoint))
    weights, kind = load_mtp_weights(checkpoint, fam, cfg)
    return cfg, kind, weights, load_checkpoint(checkpoint)[1]


def _assert_reference(cfg, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """The positions that read the decoder's hidden states within one head's bound, the chained one within two."""
    assert_within(tol.relative_error(got[:, :T], want[:, :T]), mtp_bound(cfg, T), what)
    assert_within(tol.relative_error(got[:, T:], want[:, T:]), mtp_bound(cfg, T + 1, steps=2), f"{what}, chained")


def test_mtp_logits_equal_a_torch_reference_from_the_checkpoint(checkpoints, case):
    cfg, kind, weights, decoder = _deepseek(checkpoints[1])
    assert kind == SPARSE and "mtp.layers.expert_gate" in weights and "mtp.embed" not in weights
    tokens, chained, before, after, want = case
    got = jax_mtp(cfg, kind, {**decoder, **weights}, tokens, after, chained)
    _assert_reference(cfg, got, want, "MTP head vs torch reference")


def test_control_swapped_input_norms_fail_the_reference(checkpoints, case):
    cfg, kind, weights, decoder = _deepseek(checkpoints[1])
    tokens, chained, before, after, want = case
    swapped = {**weights, "mtp.enorm": weights["mtp.hnorm"], "mtp.hnorm": weights["mtp.enorm"]}
    got = jax_mtp(cfg, kind, {**decoder, **swapped}, tokens, after, chained)
    assert tol.relative_error(got[:, :T], want[:, :T]) > mtp_bound(cfg, T)


def test_control_the_pre_norm_contract_fails_the_reference(checkpoints, case):
    """The old contract is told apart on both counts: the head fed the decoder's hidden states before its final norm
    misses the reference; a reference chaining the head's state before shared_head.norm misses the head's chained
    position."""
    checkpoint = checkpoints[1]
    cfg, kind, weights, decoder = _deepseek(checkpoint)
    tokens, chained, before, after, want = case
    got = jax_mtp(cfg, kind, {**decoder, **weights}, tokens, before, chained)
    assert tol.relative_error(got[:, :T], want[:, :T]) > mtp_bound(cfg, T)
    got = jax_mtp(cfg, kind, {**decoder, **weights}, tokens, after, chained)
    unnormed = torch_mtp(checkpoint, tokens, after, chained, chain_normed=False)
    assert tol.relative_error(got[:, T:], unnormed[:, T:]) > mtp_bound(cfg, T + 1, steps=2)


def test_a_checkpoint_without_the_head_has_no_mtp_weights(checkpoints, tmp_path):
    plain = checkpoints[0]
    fam, cfg = config_from_hf(read_config(plain))
    assert load_mtp_weights(plain, fam, cfg) is None


QWEN_SEED = 71


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """A tiny Qwen3-Next with its MoE in every layer (as the released models' MTP layer has), with and without mtp.*;
    the head's weights; random tokens and hidden states."""
    root = tmp_path_factory.mktemp("qwen3-next-mtp")
    plain = build_checkpoint(root / "plain", "qwen3_next", seed=QWEN_SEED, **QWEN3_NEXT_MOE)
    head = add_qwen3_next_mtp(plain, root / "mtp", seed=QWEN_SEED + 1)
    fam, cfg = config_from_hf(read_config(head))
    weights, kind = load_mtp_weights(head, fam, cfg)
    rng = np.random.default_rng(QWEN_SEED)
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    hidden = rng.standard_normal((B, T, cfg.hidden_size)).astype(np.float32)
    return plain, head, cfg, weights, kind, load_checkpoint(head)[1], (tokens, hidden), torch_qwen3_next_mtp(
        head, tokens, hidden)


def test_qwen3_next_mtp_logits_equal_a_torch_reference_from_vllms_definition(qwen3_next):
    plain, head, cfg, weights, kind, decoder, case, want = qwen3_next
    assert kind == SPARSE and "mtp.layers.shared_expert_gate" in weights and "mtp.attn.q_norm" in weights
    assert "mtp.head" not in weights and "mtp.embed" not in weights           # the decoder's lm_head and embedding
    got = jax_mtp(cfg, kind, {**decoder, **weights}, *case)
    assert_within(tol.relative_error(got, want), mtp_bound(cfg, T), "Qwen3-Next MTP head vs torch reference")


@pytest.mark.parametrize("control", ["swapped norms", "swapped concat", "zeroed first embedding"])
def test_control_qwen3_next_mtp_misread_fails_the_reference(qwen3_next, control, monkeypatch):
    """Each way of misreading vLLM's head fails the bound the head meets: the two input norms swapped; the concat
    [hidden, embedding] (fc's input halves swapped); the embedding at position 0 zeroed as DeepSeek's head does."""
    plain, head, cfg, weights, kind, decoder, case, want = qwen3_next
    E = cfg.hidden_size
    if control == "swapped norms":
        weights = {**weights, "mtp.enorm": weights["mtp.hnorm"], "mtp.hnorm": weights["mtp.enorm"]}
    elif control == "swapped concat":
        weights = {**weights, "mtp.eh_proj": np.concatenate([weights["mtp.eh_proj"][E:], weights["mtp.eh_proj"][:E]])}
    else:
        layouts = {**mtp_head.LAYOUTS, "qwen3_next": dataclasses.replace(mtp_head.LAYOUTS["qwen3_next"],
                                                                        zero_first=True)}
        monkeypatch.setattr(mtp_head, "LAYOUTS", layouts)
    got = jax_mtp(cfg, kind, {**decoder, **weights}, *case)
    assert tol.relative_error(got, want) > mtp_bound(cfg, T)


def test_a_qwen3_next_checkpoint_without_mtp_tensors_has_no_head(qwen3_next):
    plain = qwen3_next[0]
    fam, cfg = config_from_hf(read_config(plain))
    assert load_mtp_weights(plain, fam, cfg) is None
