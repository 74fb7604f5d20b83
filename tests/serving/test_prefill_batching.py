"""Batched and chunked prefill give the solo, whole-prompt logits and KV; controls show the checks bite."""

from __future__ import annotations

import numpy as np
import pytest

import tlaloc_jax
from hf_models import build_checkpoint
from margins import assert_within
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.serve.core.kv_cache import UnitPool
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs, pages_for

pytestmark = pytest.mark.numeric

S = 4            # tokens per page
WIDTH = 8        # block-table entries: context 32
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9], [200, 201, 202]]


def bound(model) -> float:
    """Batched, chunked and solo calls are the same math with other shapes, so XLA may sum in other orders."""
    return tol.bound(tol.decoder_roundings_of(model.config, context=max(map(len, PROMPTS))))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=7)
    return tlaloc_jax.load_hf(path, block_size=S)


def _call(model, pools, rows, tokens, batch=None):
    inputs = build_step_inputs(rows, batch=batch or len(rows), tokens=tokens, width=WIDTH, block_size=S)
    logits, pools = model.step(pools, inputs)
    return np.asarray(logits), pools, inputs


def _kv_of(pools, pages, length):
    """The keys and values a sequence holds: [L, 2, length, K, D]."""
    kv = np.asarray(pools["kv"])[:, :, pages]           # [L, 2, n_pages, S, K, D]
    L, two, n, s, K, D = kv.shape
    return kv.reshape(L, two, n * s, K, D)[:, :, :length]


def _solo(model, prompt, tokens=16):
    alloc = UnitPool(16)
    pages = alloc.take(pages_for(len(prompt), S))
    logits, pools, _ = _call(model, model.new_pools(16), [RowCall(prompt, 0, pages)], tokens)
    return logits[0], _kv_of(pools, pages, len(prompt))


def test_prompts_prefilled_together_give_their_solo_logits_and_kv(model):
    alloc = UnitPool(32)
    pages = [alloc.take(pages_for(len(p), S)) for p in PROMPTS]
    logits, pools, _ = _call(model, model.new_pools(32), [RowCall(p, 0, pg) for p, pg in zip(PROMPTS, pages)], 16)
    for b, (p, pg) in enumerate(zip(PROMPTS, pages)):
        solo_logits, solo_kv = _solo(model, p)
        assert_within(relative_error(logits[b], solo_logits), bound(model), f"batched row {b}: logits")
        assert_within(relative_error(_kv_of(pools, pg, len(p)), solo_kv), bound(model), f"batched row {b}: KV")


def _chunked(model, prompt, chunk, padding_writes_kv=False):
    alloc = UnitPool(16)
    pages = alloc.take(pages_for(len(prompt), S))
    pools = model.new_pools(16)
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        inputs = build_step_inputs([RowCall(piece, start, pages)], batch=1, tokens=chunk, width=WIDTH, block_size=S)
        if padding_writes_kv:
            pad = inputs["slot_mapping"][0] < 0
            # The bug this control stands for: padding columns handed the slots of the row's first positions.
            inputs["slot_mapping"][0, pad] = pages[0] * S + np.arange(pad.sum())
        logits, pools = model.step(pools, inputs)
    return np.asarray(logits)[0]


def test_chunked_prefill_gives_whole_prompt_logits(model):
    prompt = PROMPTS[1]
    whole, _ = _solo(model, prompt)
    for chunk in (1, 4, 5):
        assert_within(relative_error(_chunked(model, prompt, chunk), whole), bound(model), f"chunks of {chunk}")


def test_control_padding_that_writes_kv_breaks_chunked_prefill(model):
    prompt = PROMPTS[1]                                  # 13 tokens in chunks of 5: the last chunk has padding
    whole, _ = _solo(model, prompt)
    got = _chunked(model, prompt, 5, padding_writes_kv=True)
    assert np.abs(got - whole).max() > 1e-3 * np.abs(whole).max()


def test_control_left_aligned_rows_break_batched_prefill(model):
    alloc = UnitPool(32)
    pages = [alloc.take(pages_for(len(p), S)) for p in PROMPTS]
    rows = [RowCall(p, 0, pg) for p, pg in zip(PROMPTS, pages)]
    inputs = build_step_inputs(rows, batch=3, tokens=16, width=WIDTH, block_size=S)
    for key in ("token_ids", "positions", "slot_mapping"):   # move each row's tokens to the left
        for b, p in enumerate(PROMPTS):
            row = inputs[key][b].copy()
            inputs[key][b] = np.concatenate([row[16 - len(p):], row[:16 - len(p)]])
    logits, _ = model.step(model.new_pools(32), inputs)
    logits = np.asarray(logits)
    solo, _ = _solo(model, PROMPTS[0])
    assert np.abs(logits[0] - solo).max() > 1e-3 * np.abs(solo).max()
