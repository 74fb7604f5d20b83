"""The Pallas GPU decode kernel (tlaloc_jax/kernels/paged_attention_gpu.py), run in Pallas' interpret mode on CPU, against
the naive reference at the edge cases the XLA kernel's tests cover; its refusals; its cuda lowering.

As in test_paged_attention.py every pool is NaN wherever no key was written, so a read of such a slot that
reaches an output shows up as a NaN. Shapes differ from that file's: Triton's dot wants a head size and a key
block of at least 16.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_calls import D, M, S, Call, assert_controls_fail, make_call
from margins import assert_within
from tlaloc_jax.kernels import paged_attention_reference
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.paged_attention_gpu import TRITON_CUSTOM_CALL, paged_decode_attention
from tlaloc_jax.kernels.tolerances import relative_error

pytestmark = pytest.mark.numeric

PPB = 4            # pages per key block: 16 keys, 3 key blocks per context
SCALE = 0.4
# The kernel and the reference are the same math over at most M * S keys, summed in other orders and with
# another softmax arithmetic; both widen a bf16 pool to f32 before any arithmetic.
BOUND = tol.bound(tol.attention_roundings(D, M * S))


# window is traced (0 = none), as under a scan over layers; layer is traced by jit too.
@functools.partial(jax.jit, static_argnames=("soft_cap", "pages_per_block", "splits"))
def kernel(call, window, *, soft_cap=None, sinks=None, pages_per_block=PPB, splits=None):
    """splits None: splits_for's choice, several for these small batches (4 for 8 rows of 2 KV heads)."""
    return paged_decode_attention(*call, scale=SCALE, window=window, soft_cap=soft_cap, sinks=sinks,
                                  pages_per_block=pages_per_block, splits=splits, interpret=True)


@functools.partial(jax.jit, static_argnames=("soft_cap",))
def reference(call, window, *, soft_cap=None, sinks=None):
    return paged_attention_reference(*call, scale=SCALE, window=window, soft_cap=soft_cap, sinks=sinks)


def check(call, window=0, **kw):
    """The kernel matches the reference; padding and empty rows get 0. -> the kernel's output."""
    out = kernel(call, jnp.int32(window), **kw)
    want = reference(call, jnp.int32(window), **{k: v for k, v in kw.items() if k not in ("pages_per_block", "splits")})
    assert out.dtype == jnp.float32 and out.shape == call.q.shape and np.all(np.isfinite(out))
    assert_within(relative_error(out, want), BOUND, f"pallas decode vs reference, window {window}, {kw}")
    dead = np.asarray(call.positions[:, 0]) < 0
    np.testing.assert_array_equal(np.asarray(out)[dead], 0.0)
    return out


EDGES = [1, 4, 5, 16, 17, 48, 3, 0]  # length 1, at and one past a page (4) and a key block (16), the full bucket, empty


@pytest.mark.parametrize("H, K, dtype, splits", [(4, 4, np.float32, 1), (4, 2, jnp.bfloat16, None),
                                                 (8, 2, np.float32, 3), (6, 2, jnp.bfloat16, None)],
                         ids=["G1-f32-1split", "G2-bf16", "G4-f32-3splits", "G3-bf16"])
def test_decode_matches_reference(H, K, dtype, splits):
    """Lengths 1, a key-block boundary and one past, the full bucket, an empty row, a padding row with keys;
    GQA ratios 1, 2, 4 and 3 (padded to 16 rows), f32 and bf16 pools; one program per (row, KV head), or the
    key blocks split over 3 (uneven shares) or 4 programs; with and without a window (traced, one compile).
    Both sides widen a bf16 pool to f32, so it is held to the f32 bound."""
    call = make_call(H + K, EDGES, H=H, K=K, dtype=dtype, padding=(6,))
    check(call, splits=splits)
    check(call, window=5, splits=splits)
    check(call, window=17, splits=splits)     # the window start crosses a key block boundary for the long rows
    check(call._replace(positions=jnp.full_like(call.positions, -1)), splits=splits)   # no live row: all 0
    if H == K:
        check(call, pages_per_block=None, splits=splits)   # the default key block: the whole context in one block


def test_windows_skip_blocks_whose_pages_are_freed():
    """A window that leaves whole key blocks behind: those pages are NaN (an allocator may free them), and the
    kernel must not read them into the output."""
    window = 8
    call = make_call(5, [48, 45, 36, 33])
    pool = np.array(call.kv_pool)
    for b, length in enumerate([48, 45, 36, 33]):
        for m in range(max(length - window, 0) // S):
            pool[:, :, call.block_tables[b, m]] = np.nan
    check(call._replace(kv_pool=jnp.asarray(pool)), window=window)


@pytest.mark.parametrize("splits", [1, None], ids=["1split", "splits"])
def test_soft_cap_and_sinks(splits):
    """Soft-capped scores and sinks, the sinks in the one program's softmax or joining the splits' merge.
    Control: the same without the sinks is far off."""
    call = make_call(11, [1, 16, 17, 48, 0], H=4, K=2)
    # Sinks around the scores' scale, so each takes a real share of its softmax.
    sinks = jnp.asarray(np.random.default_rng(31).standard_normal(4) + 1.0, jnp.float32)
    out = check(call, window=7, soft_cap=2.0, sinks=sinks, splits=splits)
    assert relative_error(out, reference(call, jnp.int32(7), soft_cap=2.0)) > 0.05


def test_controls_that_must_fail():
    """Plausible bugs the comparison catches: a causal length one short, a wrong GQA head mapping."""
    assert_controls_fail(kernel, reference, BOUND)


def ring_call(seed, lengths, ring, window):
    """Rows whose last `ring` pages' worth of positions sit in a ring (logical page p on ring page p % ring),
    and the same keys in full-history pages: -> (ring Call, full-history Call)."""
    rng = np.random.default_rng(seed)
    B, K, H = len(lengths), 2, 4
    P = B * M + 8
    full = np.full((1, 2, P, S, K, D), np.nan, np.float32)
    rings = np.full((1, 2, P, S, K, D), np.nan, np.float32)
    order = rng.permutation(P)
    full_tables = order[:B * M].reshape(B, M).astype(np.int32)
    ring_tables = rng.permutation(P)[:B * ring].reshape(B, ring).astype(np.int32)
    for b, length in enumerate(lengths):
        for j in range(length):
            kv = rng.standard_normal((2, K, D))
            full[0, :, full_tables[b, j // S], j % S] = kv
            if j >= length - ring * S:
                rings[0, :, ring_tables[b, (j // S) % ring], j % S] = kv
    positions = np.asarray([[n - 1 if n else -1] for n in lengths], np.int32)
    q = jnp.asarray(rng.standard_normal((B, 1, H, D)).astype(np.float32))
    seq_lens = jnp.asarray(lengths, jnp.int32)
    return (Call(q, jnp.asarray(rings), 0, jnp.asarray(ring_tables), jnp.asarray(positions), seq_lens),
            Call(q, jnp.asarray(full), 0, jnp.asarray(full_tables), jnp.asarray(positions), seq_lens))


def test_ring_matches_full_history():
    """A sliding layer's ring: the kernel over the ring against the reference over full-history pages, lengths
    short of, at and past the ring's wrap. Control: the same keys without the window."""
    ring, window = 3, 9
    ring_c, full_c = ring_call(ring, [1, 5, ring * S, ring * S + 3, 41], ring, window)
    kw = dict(scale=SCALE, pages_per_block=PPB, ring=True, interpret=True)
    got = jax.jit(lambda c, w: paged_decode_attention(*c, window=w, **kw))(ring_c, jnp.int32(window))
    want = reference(full_c, jnp.int32(window))
    assert np.all(np.isfinite(got))
    assert_within(relative_error(got, want), BOUND, f"ring {ring}, window {window}")
    unwindowed = reference(full_c, jnp.int32(0))
    assert relative_error(got, unwindowed) > 100 * BOUND


@pytest.mark.parametrize("case, why", [
    (dict(T=2), "one token a row, the call has 2"),
    (dict(D=24), "head size 24 is not a power of two"),
    (dict(D=8), "head size 8 is not a power of two of at least 16"),
    (dict(S=6), "page size 6 is not a power of two"),
    (dict(H=5), "5 query heads are not a multiple of 2 KV heads"),
    (dict(dtype=jnp.int8), "pool dtype int8"),
])
def test_refusals_name_the_reason(case, why):
    T, H, K, Dh, Sz = case.get("T", 1), case.get("H", 4), 2, case.get("D", D), case.get("S", S)
    q = jax.ShapeDtypeStruct((2, T, H, Dh), jnp.float32)
    pool = jax.ShapeDtypeStruct((1, 2, 8, Sz, K, Dh), case.get("dtype", jnp.float32))
    ints = [jax.ShapeDtypeStruct(s, jnp.int32) for s in ((2, 4), (2, T), (2,))]
    with pytest.raises(ValueError, match=f"Pallas GPU kernel.*{re.escape(why)}"):
        jax.eval_shape(lambda q, p, t, pos, n: paged_decode_attention(q, p, 0, t, pos, n, scale=1.0), q, pool, *ints)


def test_inference_only():
    call = make_call(0, [5], H=4, K=2)
    with pytest.raises(TypeError, match="paged_decode_attention is inference-only"):
        jax.jvp(lambda x: paged_decode_attention(x, *call[1:], scale=SCALE, interpret=True), (call.q,), (call.q,))


@pytest.mark.parametrize("splits", [1, None], ids=["1split", "splits"])
def test_lowers_for_cuda_to_one_triton_call(splits):
    """jax.export for cuda lowers the kernel on this CPU machine (no GPU): one custom call to the GPU plugin's
    Triton target, the Triton IR in its backend_config, and the pool read in place (no gather of it)."""
    from tlaloc_jax.export import custom_call_targets
    from tlaloc_jax.export._entries import export_fn
    call = make_call(0, [20, 33], H=4, K=2, dtype=jnp.bfloat16)
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in call._replace(layer=jnp.int32(1))]
    f = lambda q, pool, layer, t, pos, n: paged_decode_attention(q, pool, layer, t, pos, n, scale=SCALE, window=7,
                                                                 splits=splits)
    text = export_fn(f, avals, platform="cuda").mlir_module()
    assert custom_call_targets(text) == {TRITON_CUSTOM_CALL}
    assert text.count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}") == 1
    assert "stablehlo.gather" not in text
