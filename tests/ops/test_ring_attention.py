"""Paged attention over a ring (a sliding layer's windowed pool) against full-history pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from margins import assert_within
from tlaloc_jax.kernels import kv_cache_write, paged_attention
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.paged_attention import ring_key_positions

pytestmark = pytest.mark.numeric

S, K, H, D = 4, 2, 4, 8
SCALE = D ** -0.5
LENGTH = 40
# The ring and the full-history pages hold the same keys; the two attentions sum them in other orders.
BOUND = tol.bound(tol.attention_roundings(D, LENGTH))


def ring_pages(window: int, call: int, page_size: int = S) -> int:
    """Pages a ring needs so that a call of `call` tokens fits past the window."""
    return -(-(window - 1 + call) // page_size)


def _kv(positions, seed=0):
    """Deterministic keys and values per absolute position: [n, K, D] each."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((2, 512, K, D)).astype(np.float32)
    return jnp.asarray(table[0, positions]), jnp.asarray(table[1, positions])


def _run(length: int, window: int, call: int, ring: int, *, call_override: int | None = None, sinks=None):
    """Write a sequence of `length` tokens in calls of `call` through a full pool and a ring of `ring` pages;
    -> the largest difference between the two attentions over all calls, relative to the largest output."""
    full_pages = list(range(-(-length // S)))
    ring_ids = [7, 3, 9, 1, 5, 11][:ring]           # scattered pages: the ring is not a contiguous range
    full = jnp.full((1, 2, 16, S, K, D), jnp.nan, jnp.float32)
    win = jnp.full((1, 2, 16, S, K, D), jnp.nan, jnp.float32)
    rng = np.random.default_rng(1)
    full_table = jnp.asarray([full_pages + [0] * (16 - len(full_pages))], jnp.int32)
    ring_table = jnp.asarray([ring_ids], jnp.int32)

    @jax.jit    # one call's writes and both attentions, compiled once per call length (op by op took ~0.6 s a call)
    def step(full, win, k, v, full_slots, ring_slots, q, positions, seq_lens):
        full = kv_cache_write(full, k[None], v[None], full_slots, 0)
        win = kv_cache_write(win, k[None], v[None], ring_slots, 0)
        want = paged_attention(q, full, 0, full_table, positions, seq_lens, scale=SCALE, window=window, sinks=sinks)
        got = paged_attention(q, win, 0, ring_table, positions, seq_lens, scale=SCALE, window=window, ring=True,
                              sinks=sinks)
        return full, win, want, got

    worst, scale = 0.0, 0.0
    p0 = 0
    while p0 < length:
        n = min(call_override or call, length - p0)
        pos = np.arange(p0, p0 + n)
        k, v = _kv(pos)
        full_slots = jnp.asarray([[full_pages[q // S] * S + q % S for q in pos]], jnp.int32)
        ring_slots = jnp.asarray([[ring_ids[(q // S) % ring] * S + q % S for q in pos]], jnp.int32)
        q = jnp.asarray(rng.standard_normal((1, n, H, D)).astype(np.float32))
        positions = jnp.asarray(pos[None], jnp.int32)
        seq_lens = jnp.asarray([p0 + n], jnp.int32)
        full, win, want, got = step(full, win, k, v, full_slots, ring_slots, q, positions, seq_lens)
        assert np.isfinite(np.asarray(want)).all()
        worst = max(worst, float(jnp.max(jnp.abs(got - want))) if np.isfinite(np.asarray(got)).all() else np.inf)
        scale = max(scale, float(jnp.max(jnp.abs(want))))
        p0 += n
    return worst / scale


# (6, 3) in `make test-slow`: (5, 4) covers a call that does not divide the window, (4, 9) one longer than it.
@pytest.mark.parametrize("window, call", [pytest.param(6, 3, marks=pytest.mark.slow), (8, 1), (5, 4), (4, 9)])
def test_ring_matches_full_history_over_several_windows(window, call):
    assert_within(_run(LENGTH, window, call, ring_pages(window, call)), BOUND, f"ring, window {window}, call {call}")


def test_ring_with_sinks_matches_full_history():
    """GPT-OSS's sliding layers: sinks in the ring's one pass as in the full-history pages."""
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    assert_within(_run(LENGTH, 6, 3, ring_pages(6, 3), sinks=sinks), BOUND, "ring with sinks, window 6, call 3")


def test_control_ring_one_page_short_changes_the_result():
    window, call = 6, 3
    assert _run(LENGTH, window, call, ring_pages(window, call) - 1) > 1e-3


def test_control_call_one_token_too_long_for_the_ring_changes_the_result():
    window, call = 6, 3
    R = ring_pages(window, call)
    longest = R * S - (window - 1)          # what the ring holds past the window
    assert_within(_run(LENGTH, window, call, R, call_override=longest), BOUND, "ring, longest call")
    assert _run(LENGTH, window, call, R, call_override=longest + 1) > 1e-3


def test_ring_key_positions_hand_worked():
    # A ring of 8 slots, 11 keys written (positions 0..10): slots 0..2 hold 8..10, slots 3..7 hold 3..7.
    # With 2 keys, slots 0 and 1 hold 0 and 1; slot i >= 2 would hold i - 8 (never written, negative).
    np.testing.assert_array_equal(ring_key_positions(jnp.asarray([11, 2, 0]), 8),
                                  [[8, 9, 10, 3, 4, 5, 6, 7], [0, 1, -6, -5, -4, -3, -2, -1],
                                   [-8, -7, -6, -5, -4, -3, -2, -1]])


def test_ring_gathers_only_its_pages(jaxpr_eqns):
    win = jnp.zeros((1, 2, 64, S, K, D))
    eqns = jaxpr_eqns(lambda q, t, p, s: paged_attention(q, win, 0, t, p, s, scale=SCALE, window=6, ring=True),
                      jnp.zeros((2, 1, H, D)), jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                      jnp.zeros((2,), jnp.int32))
    gathers = [e for e in eqns if e.primitive.name == "gather"]
    assert gathers and all(np.prod(e.outvars[0].aval.shape) <= 2 * 3 * S * K * D for e in gathers)
