"""Decode calls fold their keys in blocks of DECODE_KEY_BLOCK positions (tlaloc_jax.decoder.decode_key_block), so
a call reads the blocks its rows wrote rather than its whole context bucket; it computes what one fold over the
bucket computes."""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np
import pytest

import tlaloc_jax
from hf_models import build_checkpoint
from margins import assert_within
from tlaloc_jax import decoder
from tlaloc_jax.decoder import DECODE_KEY_BLOCK, StepInputs, decode_key_block
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs


def test_decode_key_block_is_whole_pages_under_the_cap():
    assert decode_key_block(2048, 16) == DECODE_KEY_BLOCK == 128
    assert decode_key_block(2048, 48) == 96            # whole pages
    assert decode_key_block(2048, 256) == 256          # a page larger than the cap: one page
    assert decode_key_block(64, 16) == 64              # a smaller key block is kept


@pytest.mark.numeric
def test_decode_in_a_large_bucket_equals_one_fold_over_it(tmp_path, monkeypatch):
    path = build_checkpoint(tmp_path / "llama", seed=4, model_type="llama")
    model = tlaloc_jax.load_hf(path, block_size=8, weight_layout="per-layer")
    width, context = 64, 512                             # 4 key blocks of 128 positions
    rng = np.random.default_rng(0)
    host_pools = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in model.new_pools(2 * width).items()}

    def pools():       # the step donates its pools: each call gets its own copy
        return {k: jnp.asarray(v) for k, v in host_pools.items()}
    # Rows at positions in the first and the third key block.
    rows = [RowCall([5], p, list(range(i * width, (i + 1) * width))) for i, p in enumerate((20, 300))]
    inputs = StepInputs(**{k: jnp.asarray(v) for k, v in build_step_inputs(
        rows, batch=2, tokens=1, width=width, block_size=8).items()})
    blocked = model._step.lower(model.weights, pools(), inputs).compile()
    assert "while" in blocked.as_text()                 # the fold over the live blocks is a loop
    got, _ = blocked(model.weights, pools(), inputs)
    monkeypatch.setattr(decoder, "DECODE_KEY_BLOCK", 4096)
    # (the module: the package's name paged_attention is its function)
    monkeypatch.setattr(importlib.import_module("tlaloc_jax.kernels.paged_attention"), "CPU_DECODE_KEY_BLOCK", 4096)
    whole = tlaloc_jax.load_hf(path, block_size=8, weight_layout="per-layer")
    one_fold = whole._step.lower(whole.weights, pools(), inputs).compile()
    assert "while" not in one_fold.as_text()              # the control: one fold over the bucket, no loop
    want, _ = one_fold(whole.weights, pools(), inputs)
    bound = tol.bound(tol.decoder_roundings_of(model.config, context=context))
    assert_within(tol.relative_error(got, want), bound, "decode logits, key blocks of 128 vs one fold")
    # Control: the same call with the second row one position earlier is told apart.
    early = [rows[0], RowCall([5], 299, rows[1].pages)]
    other_inputs = StepInputs(**{k: jnp.asarray(v) for k, v in build_step_inputs(
        early, batch=2, tokens=1, width=width, block_size=8).items()})
    other, _ = blocked(model.weights, pools(), other_inputs)
    assert tol.relative_error(other, want) > 100 * bound
