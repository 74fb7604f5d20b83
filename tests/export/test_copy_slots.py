"""The copy_slots entry (export/_copy_slots.py) against its reference: state slots copied in every state pool,
skipped pairs left alone, other pools untouched; a control that copies the pairs the wrong way round is caught."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tlaloc_jax import artifact as af
from tlaloc_jax.export._copy_slots import copy_slots_fn, copy_slots_reference, copy_slots_signature

POOLS = (af.Pool("conv", af.PoolKind.STATE_SLOTS, "float32", (3, 6, 4, 2), capacity=6, slot_axis=1),
         af.Pool("recurrent", af.PoolKind.STATE_SLOTS, "float32", (2, 6, 5), capacity=6, slot_axis=1),
         af.Pool("kv", af.PoolKind.PAGED_KV, "float32", (1, 2, 4, 8, 1, 2), capacity=4, slot_axis=2))


def _bufs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(p.shape).astype(np.float32) for p in POOLS if p.kind == af.PoolKind.STATE_SLOTS]


@pytest.mark.parametrize("src,dst", [([0, 2, -1, 5], [3, 4, 1, -1]), ([5, -1, -1, -1], [0, -1, -1, -1]),
                                     ([-1] * 4, [-1] * 4)])
def test_copy_slots_matches_the_reference_loop(src, dst):
    inputs, outputs, donations = copy_slots_signature(POOLS, 4)
    assert [s.slot for s in inputs[2:]] == [s.slot for s in outputs] == ["conv", "recurrent"]
    assert donations == ((0, 2), (1, 3))
    bufs = _bufs()
    got = jax.jit(copy_slots_fn(POOLS))(np.int32(src), np.int32(dst), *bufs)
    for p, buf, out in zip(POOLS, bufs, got):
        np.testing.assert_array_equal(np.asarray(out), copy_slots_reference(buf, src, dst, p.slot_axis))
    # Control: the pairs copied the wrong way round give other pools (the check above would catch it).
    if any(a >= 0 and b >= 0 for a, b in zip(src, dst)):
        wrong = copy_slots_reference(bufs[0], dst, src, POOLS[0].slot_axis)
        assert not np.array_equal(np.asarray(got[0]), wrong)
