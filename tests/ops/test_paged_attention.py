"""Paged attention and the KV cache write against their naive reference, at the seed's edge cases.

Every pool here is NaN wherever no key was written (free pages, slots past a row's length, pages a
sliding window has left), so any read of such a slot that reaches an output shows up as a NaN.
"""

import functools
import importlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tlaloc_jax.kernels import kv_cache_write, paged_attention, paged_attention_reference
from tlaloc_jax.kernels.paged_attention import key_block_range, shared_prefix
from margins import assert_within
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error

paged_attention_module = importlib.import_module("tlaloc_jax.kernels.paged_attention")

pytestmark = pytest.mark.numeric

S, D = 4, 8        # page size, head size
M = 12             # block-table width: context 48
KEY_BLOCK = 16     # 4 pages per key block, 3 key blocks per context
ONE_PASS = M * S   # a key block that holds the whole context: the one-pass form
SCALE = 0.4
# Blockwise, one-pass and reference forms are the same math over at most M * S keys, summed in other orders
# and (the reference) with another softmax arithmetic. Both sides widen a bf16 pool to f32 before any
# arithmetic, so a bf16 pool is held to the same f32 bound.
BOUND = tol.bound(tol.attention_roundings(D, M * S))


class Call(NamedTuple):
    q: jax.Array             # [B, T, H, D]
    kv_pool: jax.Array       # [L, 2, P, S, K, D]
    layer: int
    block_tables: jax.Array  # [B, M]
    positions: jax.Array     # [B, T]
    seq_lens: jax.Array      # [B]


def make_call(seed, lengths, new_tokens, *, T=8, H=4, K=2, layers=2, layer=1, dtype=np.float32) -> Call:
    """Rows whose sequences hold lengths[b] keys, the last new_tokens[b] of them this call's tokens.

    Rows are right-aligned (padding first, position -1). Each row's pages are distinct pages drawn at
    random from P = B * M + 8; table entries past a row's pages point at random pages, free ones included.
    """
    rng = np.random.default_rng(seed)
    B, P = len(lengths), len(lengths) * M + 8
    pool = np.full((layers, 2, P, S, K, D), np.nan, np.float32)
    block_tables = rng.integers(0, P, (B, M), dtype=np.int32)
    own_pages = iter(rng.permutation(P))
    positions = np.full((B, T), -1, np.int32)
    for b, (length, new) in enumerate(zip(lengths, new_tokens)):
        for m in range(math.ceil(length / S)):
            block_tables[b, m] = next(own_pages)
        for j in range(length):
            pool[:, :, block_tables[b, j // S], j % S] = rng.standard_normal((layers, 2, K, D))
        positions[b, T - new:] = np.arange(length - new, length)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    return Call(jnp.asarray(q), jnp.asarray(pool, dtype), layer, jnp.asarray(block_tables), jnp.asarray(positions),
                jnp.asarray(lengths, jnp.int32))


# window is always traced here (0 = none), as under a scan over layers; layer is traced by jit too.
@functools.partial(jax.jit, static_argnames=("key_block", "soft_cap", "query_block"))
def fast(call, window, *, key_block, soft_cap=None, sinks=None, query_block=None):
    return paged_attention(*call, scale=SCALE, window=window, soft_cap=soft_cap, key_block=key_block, sinks=sinks,
                           query_block=query_block)


@functools.partial(jax.jit, static_argnames=("soft_cap",))
def reference(call, window, *, soft_cap=None, sinks=None):
    return paged_attention_reference(*call, scale=SCALE, window=window, soft_cap=soft_cap, sinks=sinks)


def check_against_reference(call, window=0, soft_cap=None, sinks=None):
    """Blockwise and one-pass forms agree to reordering error, and both match the reference. -> blockwise output."""
    window = jnp.int32(window)
    blockwise = fast(call, window, key_block=KEY_BLOCK, soft_cap=soft_cap, sinks=sinks)
    one_pass = fast(call, window, key_block=ONE_PASS, soft_cap=soft_cap, sinks=sinks)
    expected = reference(call, window, soft_cap=soft_cap, sinks=sinks)
    assert blockwise.dtype == jnp.float32 and np.all(np.isfinite(blockwise)) and np.all(np.isfinite(one_pass))
    assert_within(relative_error(blockwise, one_pass), BOUND, "blockwise vs one-pass")
    assert_within(relative_error(blockwise, expected), BOUND, "blockwise vs reference")
    assert_within(relative_error(one_pass, expected), BOUND, "one-pass vs reference")
    return blockwise


# --- the reference itself ---------------------------------------------------------------------------


def hand_worked_call():
    """One head, D = 2, a row with keys k0 = (0, 0), k1 = (ln 3, 5) and values v0 = (4, 0), v1 = (0, 8).

    With q = (1, 0) and scale 1 the scores are 0 and ln 3, so the weights are 1/4 and 3/4. The table's
    second page is never written (NaN). Token 0 (position 0) sees k0 only; token 1 sees both.
    """
    pool = np.full((1, 2, 2, 2, 1, 2), np.nan, np.float32)
    pool[0, 0, 0, :, 0] = [[0.0, 0.0], [np.log(3.0), 5.0]]
    pool[0, 1, 0, :, 0] = [[4.0, 0.0], [0.0, 8.0]]
    q = np.zeros((2, 2, 1, 2), np.float32)
    q[:, :, 0, 0] = 1.0
    positions = np.array([[0, 1], [-1, -1]], np.int32)  # row 1 is an empty row
    return (jnp.asarray(q), jnp.asarray(pool), 0, jnp.array([[0, 1], [1, 1]], jnp.int32), jnp.asarray(positions),
            jnp.array([2, 0], jnp.int32))


@pytest.mark.parametrize("attention", [paged_attention_reference,
                                       functools.partial(paged_attention, key_block=2)],  # 2 key blocks
                         ids=["reference", "blockwise"])
def test_hand_worked_case(attention):
    attention = jax.jit(attention, static_argnames=("scale", "window", "soft_cap"))
    call = hand_worked_call()
    rtol = tol.bound(tol.attention_roundings(2, 2))
    out = attention(*call, scale=1.0)
    np.testing.assert_allclose(out[0, :, 0], [[4.0, 0.0], [1.0, 6.0]], rtol=rtol)
    np.testing.assert_array_equal(out[1], 0.0)
    # A window of one key: each token sees only itself.
    np.testing.assert_allclose(attention(*call, scale=1.0, window=1)[0, :, 0], [[4.0, 0.0], [0.0, 8.0]], rtol=rtol)
    # Soft-cap 2: a raw score of 2 atanh(ln 3 / 2) is capped back to ln 3.
    pool = call[1].at[0, 0, 0, 1, 0, 0].set(2.0 * np.arctanh(np.log(3.0) / 2.0))
    capped = attention(call[0], pool, *call[2:], scale=1.0, soft_cap=2.0)
    np.testing.assert_allclose(capped[0, :, 0], [[4.0, 0.0], [1.0, 6.0]], rtol=rtol)


@pytest.mark.parametrize("attention", [paged_attention_reference,
                                       functools.partial(paged_attention, key_block=2)],
                         ids=["reference", "blockwise"])
def test_hand_worked_sinks(attention):
    """The hand-worked call with a sink of ln 4: token 1's weights are 1, 3 and the sink's 4 over 8, so it
    gets (4 + 0) / 8, (8 * 3) / 8 = (0.5, 3); token 0 sees k0 and the sink: 4 / 5 = 0.8. The sink has no
    value, and the empty row still gets 0."""
    attention = jax.jit(attention, static_argnames=("scale", "window", "soft_cap"))
    call = hand_worked_call()
    out = attention(*call, scale=1.0, sinks=jnp.log(jnp.array([4.0])))
    np.testing.assert_allclose(out[0, :, 0], [[0.8, 0.0], [0.5, 3.0]], rtol=tol.bound(tol.attention_roundings(2, 3)))
    np.testing.assert_array_equal(out[1], 0.0)


SINK_CASES = {
    "prefill, GQA 2": (dict(lengths=[30, 48, 7, 19], new_tokens=[8, 8, 7, 3], H=4, K=2), 0),
    "prefill, window 7": (dict(lengths=[30, 48, 7, 19], new_tokens=[8, 8, 7, 3], H=4, K=2), 7),
    "decode": (dict(lengths=[1, 16, 17, 48], new_tokens=[1, 1, 1, 1], T=1, H=4, K=1), 0),
    "lengths 0 and 1, no live row": (dict(lengths=[0, 1, 5, 0], new_tokens=[0, 1, 3, 0]), 0),
}


@pytest.mark.parametrize("case", SINK_CASES)
def test_sinks_match_reference(case):
    """Sinks (one logit per query head, joining each softmax's denominator) in the blockwise and one-pass forms
    against the reference's explicit extra column. Control: ignoring the sinks is far off."""
    kw, window = SINK_CASES[case]
    call = make_call(29, **kw)
    H = call.q.shape[2]
    # Sinks around the scores' scale, so each takes a real share of its softmax.
    sinks = jnp.asarray(np.random.default_rng(31).standard_normal(H) + 1.0, jnp.float32)
    out = check_against_reference(call, window, sinks=sinks)
    live = np.asarray(call.positions) >= 0
    if live.any():
        without = reference(call, jnp.int32(window))
        assert relative_error(np.asarray(without)[live], np.asarray(out)[live]) > 0.05


def test_controls_that_must_fail():
    """Two plausible bugs the reference comparison catches: a wrong GQA head mapping, a causal length one short."""
    call = make_call(0, [20, 33, 9], [8, 8, 8], H=4, K=2)
    expected = reference(call, jnp.int32(0))
    # Query head h reading KV head h % K instead of h // G: feed the kernel heads in (g, k) order.
    tiled = call.q.reshape(3, 8, 2, 2, D).transpose(0, 1, 3, 2, 4).reshape(3, 8, 4, D)
    wrong_heads = fast(call._replace(q=tiled), jnp.int32(0), key_block=KEY_BLOCK)
    wrong_heads = wrong_heads.reshape(3, 8, 2, 2, D).transpose(0, 1, 3, 2, 4).reshape(3, 8, 4, D)
    assert relative_error(wrong_heads, expected) > 0.1
    # Each token missing its own key (j < p instead of j <= p).
    short = call._replace(positions=jnp.where(call.positions > 0, call.positions - 1, call.positions))
    assert relative_error(fast(short, jnp.int32(0), key_block=KEY_BLOCK), expected) > 0.1


# --- prefill and decode against the reference --------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_prefill_matches_reference(groups, dtype):
    """Random right-aligned prefill rows (chunks after earlier context), GQA H / K = groups, with and without a window.

    Both sides read the same pool and widen it to f32, so a bf16 pool is held to the f32 tolerance.
    """
    rng = np.random.default_rng(groups)
    lengths = rng.integers(1, M * S + 1, 4)
    new_tokens = [int(rng.integers(1, min(8, n) + 1)) for n in lengths]
    call = make_call(groups, lengths, new_tokens, H=2 * groups, K=2, dtype=dtype)
    check_against_reference(call)
    check_against_reference(call, window=7)


def test_decode_matches_reference():
    call = make_call(1, [1, 16, 17, 48], [1, 1, 1, 1], T=1)
    check_against_reference(call)
    check_against_reference(call, window=5)
    check_against_reference(call, soft_cap=2.0)


def share_pages(call: Call, rows, pages: int) -> Call:
    """The rows' first `pages` block-table columns name row rows[0]'s pages (a cached prefix they share)."""
    tables = np.array(call.block_tables)
    tables[list(rows[1:]), :pages] = tables[rows[0], :pages]
    return call._replace(block_tables=jnp.asarray(tables))


SHARED = {   # lengths, rows sharing, shared pages, window
    "whole pages of a longer history": ([37, 48, 29, 41], (0, 1, 2, 3), 7, 0),
    "every key shared": ([28, 28, 28], (0, 1, 2), 7, 0),
    "an empty row's table differs": ([40, 0, 33, 45], (0, 2, 3), 8, 0),
    "a row shorter than the shared pages": ([44, 6, 39], (0, 1, 2), 9, 0),
    "a window inside the shared keys": ([40, 46, 35], (0, 1, 2), 8, 7),
    "a window past the shared keys": ([44, 47, 42], (0, 1, 2), 4, 9),
}


@pytest.mark.parametrize("case", SHARED)
def test_decode_over_shared_pages_matches_reference(case):
    """Decode rows whose leading pages are the same pages (a prefix cache hit): the CPU form scores them once for
    all rows. Blockwise (shared blocks of 16 keys) and one-pass (one shared block) both match the reference."""
    lengths, rows, pages, window = SHARED[case]
    call = share_pages(make_call(11, lengths, [1 if n else 0 for n in lengths], T=1), rows, pages)
    shared, _ = shared_prefix(call.block_tables, call.seq_lens, S)
    assert int(shared) == min(pages * S, max(lengths))      # the shared path runs
    check_against_reference(call, window)
    check_against_reference(call, window, soft_cap=2.0, sinks=jnp.linspace(-1.0, 1.0, 4))


def test_decode_of_one_key_block_over_shared_pages():
    """A context of one decode key block (8 pages of 4: 32 keys) is one fold with no shared pass; rows that share
    pages there still see every key (a shared count taken but not scored would drop them)."""
    call = share_pages(make_call(12, [27, 32, 19, 30], [1, 1, 1, 1], T=1), (0, 1, 2, 3), 4)
    call = call._replace(block_tables=call.block_tables[:, :8])
    window = jnp.int32(0)
    expected = reference(call, window)
    assert_within(relative_error(fast(call, window, key_block=ONE_PASS), expected), BOUND, "one block, shared pages")


def test_shared_prefix():
    tables = jnp.array([[5, 6, 7, 8], [5, 6, 9, 1], [2, 2, 2, 2], [5, 6, 7, 3]], jnp.int32)
    n, table = shared_prefix(tables, jnp.array([16, 12, 0, 16], jnp.int32), 4)
    assert int(n) == 8 and table.tolist() == [5, 6, 7, 8]                # row 2 is empty: its table is not read
    assert int(shared_prefix(tables, jnp.array([0, 0, 9, 0], jnp.int32), 4)[0]) == 0    # one live row
    n, table = shared_prefix(tables, jnp.array([0, 0, 0, 6], jnp.int32), 4)
    assert int(n) == 0 and table.tolist() == [5, 6, 7, 3]
    assert int(shared_prefix(tables[jnp.array([0, 3])], jnp.array([9, 10], jnp.int32), 4)[0]) == 10  # at most the longest row
    assert int(shared_prefix(tables[jnp.array([0, 3])], jnp.array([16, 16], jnp.int32), 4)[0]) == 12


def test_shared_pages_control_must_fail(monkeypatch):
    """Counting one page past what the rows share scores a row's own page with another row's keys: caught."""
    call = share_pages(make_call(11, [37, 48, 29, 41], [1, 1, 1, 1], T=1), (0, 1, 2, 3), 5)
    expected = reference(call, jnp.int32(0))
    counted = paged_attention_module.shared_prefix

    def one_page_too_many(block_tables, seq_lens, page_size):
        n, table = counted(block_tables, seq_lens, page_size)
        return n + page_size, table

    monkeypatch.setattr(paged_attention_module, "shared_prefix", one_page_too_many)
    wrong = jax.jit(lambda c: paged_attention(*c, scale=SCALE, key_block=KEY_BLOCK))(call)
    assert relative_error(wrong, expected) > 0.01


# --- blockwise vs one-pass at the edges -------------------------------------------------------------

EDGES = {
    "lengths at and one past a block boundary": ([16, 17, 32, 33], [1, 8, 8, 2], 0),
    "lengths 0 and 1": ([0, 1, 5, 0], [0, 1, 3, 0], 0),
    "no live position": ([12, 0, 40, 3], [0, 0, 0, 0], 0),
    "blocks fully masked for some rows": ([3, 48, 20, 9], [3, 8, 1, 8], 0),
    "window start crosses a block boundary": ([30, 45, 8, 17], [8, 8, 8, 8], 8),
    "window skips the first key block": ([36, 45, 40, 33], [8, 8, 8, 8], 8),
}


def free_pages_behind_window(call: Call, window: int) -> Call:
    """NaN out every page wholly before each row's earliest window start, as an allocator may free them."""
    pool = np.array(call.kv_pool)
    for b, row in enumerate(np.asarray(call.positions)):
        live = row[row >= 0]
        if len(live):
            earliest = live.min() - window + 1
            for m in range(max(earliest, 0) // S):
                pool[:, :, call.block_tables[b, m]] = np.nan
    return call._replace(kv_pool=jnp.asarray(pool))


@pytest.mark.parametrize("case", EDGES)
def test_blockwise_edges(case):
    lengths, new_tokens, window = EDGES[case]
    call = make_call(7, lengths, new_tokens)
    if window:
        call = free_pages_behind_window(call, window)
    out = check_against_reference(call, window)
    for b, length in enumerate(lengths):
        np.testing.assert_array_equal(out[b][np.asarray(call.positions[b]) < 0], 0.0)  # padding sees nothing
        if length == 0:
            np.testing.assert_array_equal(out[b], 0.0)


# Prompts whose tokens span several query tiles (T = 8 in tiles of 3 or 4) over three key blocks of 16:
# (lengths, new tokens, window). Rows are right-aligned, so a short row's first tiles are all padding.
QUERY_TILES = {
    "whole prompts": ([8, 5, 3, 8], [8, 5, 3, 8], 0),
    "chunks after context": ([48, 40, 21, 9], [8, 8, 8, 8], 0),
    "mixed, windowed": ([48, 17, 3, 30], [8, 8, 3, 2], 6),
    "a tile ends on a block's first key": ([17, 12], [8, 8], 0),
}


@pytest.mark.parametrize("query_block", [3, 4])
@pytest.mark.parametrize("case", QUERY_TILES)
def test_query_tiles(case, query_block):
    """A call taken in query tiles, each tile folding only the key blocks up to its own last position, gives
    the untiled call's output and the reference's (sinks too); padding tokens, whole tiles of them included,
    see nothing."""
    lengths, new_tokens, window = QUERY_TILES[case]
    call = make_call(11, lengths, new_tokens)
    sinks = jnp.asarray(np.random.default_rng(3).standard_normal(4), jnp.float32)
    for extra in ({}, {"sinks": sinks}):
        untiled = fast(call, jnp.int32(window), key_block=KEY_BLOCK, **extra)
        tiled = fast(call, jnp.int32(window), key_block=KEY_BLOCK, query_block=query_block, **extra)
        expected = reference(call, jnp.int32(window), **extra)
        assert_within(relative_error(tiled, untiled), BOUND, "query tiles vs one tile")
        assert_within(relative_error(tiled, expected), BOUND, "query tiles vs reference")
        np.testing.assert_array_equal(np.asarray(tiled)[np.asarray(call.positions) < 0], 0.0)


def test_key_block_range():
    positions = jnp.array([[-1, 20, 21], [-1, -1, 40]], jnp.int32)
    seq_lens = jnp.array([22, 41], jnp.int32)
    blocks = functools.partial(key_block_range, key_block=16, num_blocks=3)
    assert blocks(positions, seq_lens, jnp.int32(0)) == (0, 2)
    # A query tile's tokens see no key past their own positions: its last block is that of its last position.
    assert blocks(jnp.array([[2, 3, 4], [-1, 15, 16]], jnp.int32), seq_lens, jnp.int32(0)) == (0, 1)
    assert blocks(jnp.array([[2, 3, 4], [-1, 14, 15]], jnp.int32), seq_lens, jnp.int32(0)) == (0, 0)
    assert blocks(jnp.array([[-1, -1, -1], [-1, -1, -1]], jnp.int32), seq_lens, jnp.int32(0))[1] == -1
    assert blocks(positions, seq_lens, jnp.int32(5)) == (1, 2)   # earliest key 20 - 5 + 1 = 16
    assert blocks(positions, seq_lens, jnp.int32(30)) == (0, 2)
    first, last = blocks(jnp.full((2, 3), -1), jnp.zeros(2, jnp.int32), jnp.int32(0))
    assert last == -1 and first > last                           # every row empty: no block
    first, last = blocks(jnp.full((2, 3), -1), seq_lens, jnp.int32(5))
    assert first > last                                          # no live token under a window: no block


def test_per_layer_windows_under_scan():
    """A lax.scan over layers with a traced window per layer (0 = full attention)."""
    windows = [None, 6, 13]
    call = make_call(3, [40, 17, 29], [8, 3, 8], layers=3)

    @jax.jit
    def all_layers(call, windows):
        def layer(_, xs):
            index, window = xs
            return None, paged_attention(call.q, call.kv_pool, index, *call[3:], scale=SCALE, window=window,
                                         key_block=KEY_BLOCK)
        return lax.scan(layer, None, (jnp.arange(3), windows))[1]

    outs = all_layers(call, jnp.array([w or 0 for w in windows], jnp.int32))
    for index, window in enumerate(windows):
        expected = paged_attention_reference(*call._replace(layer=index), scale=SCALE, window=window)
        assert_within(relative_error(outs[index], expected), BOUND, f"layer {index} under scan")


# --- how the work is done ---------------------------------------------------------------------------


@pytest.mark.parametrize("key_block", [KEY_BLOCK, ONE_PASS], ids=["blockwise", "one-pass"])
def test_pages_gathered_once_per_row_in_pool_dtype(jaxpr_eqns, key_block):
    """Each gather from the pool reads at most one key block per row ([B, N, K, D]), shared by the T tokens,
    in the pool's dtype; the pool is never widened as a whole."""
    call = make_call(0, [20, 48, 9, 30], [8, 8, 8, 8], T=8, dtype=jnp.bfloat16)
    B, K = 4, 2
    eqns = jaxpr_eqns(lambda c: paged_attention(*c, scale=SCALE, key_block=key_block), call)
    gathers = [e for e in eqns if e.primitive.name == "gather" and e.invars[0].aval.shape == call.kv_pool.shape]
    assert gathers
    for e in gathers:
        out = e.outvars[0].aval
        assert out.dtype == jnp.bfloat16 and out.size <= B * key_block * K * D
    assert not any(v.aval.shape == call.kv_pool.shape and v.aval.dtype == jnp.float32
                   for e in eqns for v in e.outvars)


def test_blockwise_has_no_context_wide_scores(jaxpr_eqns):
    """No intermediate of the blockwise path spans the context (48); the one-pass form does (the control)."""
    call = make_call(0, [20, 48, 9, 30], [8, 8, 8, 8])
    context = M * S

    def widths(key_block):
        eqns = jaxpr_eqns(lambda c: paged_attention(*c, scale=SCALE, key_block=key_block), call)
        return {d for e in eqns for v in e.outvars for d in getattr(v.aval, "shape", ())}

    assert context not in widths(KEY_BLOCK)
    assert context in widths(ONE_PASS)


def test_dots_in_f32_at_highest(jaxpr_eqns):
    call = make_call(0, [20, 48, 9, 30], [8, 8, 8, 8], dtype=jnp.bfloat16)
    eqns = jaxpr_eqns(lambda c: paged_attention(*c, scale=SCALE, key_block=KEY_BLOCK), call)
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2  # Q.K and P.V, inside the loop
    for e in dots:
        assert e.params["precision"] == (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
        assert e.params["preferred_element_type"] == jnp.float32
        assert all(v.aval.dtype == jnp.float32 for v in e.invars)


# --- KV cache write ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kv_cache_write_slots(dtype):
    """Written slots hold the new keys and values cast to the pool dtype; every other bit of the pool,
    other layers and slot -1 padding included, is unchanged. The pool is NaN-free so equality is exact."""
    rng = np.random.default_rng(0)
    L, P, K, B, T = 3, 6, 2, 2, 5
    pool = jnp.asarray(rng.standard_normal((L, 2, P, S, K, D)), dtype)
    k, v = (rng.standard_normal((B, T, K, D)).astype(np.float32) for _ in range(2))
    # Slot P * S - 1 = 23 is left unwritten: a -1 that wrapped around would land there.
    slots = np.array([[-1, -1, 9, 10, 11], [-1, 0, 1, 21, 22]], np.int32)
    written = jax.jit(kv_cache_write)(pool, k, v, slots, jnp.int32(1))

    expected = np.array(pool)
    for b, t in zip(*np.nonzero(slots >= 0)):
        page, offset = divmod(slots[b, t], S)
        expected[1, 0, page, offset] = np.asarray(jnp.asarray(k[b, t], dtype))
        expected[1, 1, page, offset] = np.asarray(jnp.asarray(v[b, t], dtype))
    assert written.dtype == dtype
    np.testing.assert_array_equal(np.asarray(written), expected)


def test_kv_cache_write_is_one_scatter_into_the_donated_pool():
    pool = jnp.zeros((3, 2, 6, S, 2, D), jnp.bfloat16)
    k = v = jnp.zeros((2, 5, 2, D), jnp.float32)
    slots = jnp.zeros((2, 5), jnp.int32)
    exported = jax.export.export(jax.jit(kv_cache_write, donate_argnums=0))(pool, k, v, slots, jnp.int32(0))
    text = exported.mlir_module()
    assert text.count('"stablehlo.scatter"(') == 1
    assert "dynamic_slice" not in text and "dynamic_update_slice" not in text
    assert "tf.aliasing_output = 0" in text


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_prefill_chunk_written_then_attended(dtype):
    """A prefill chunk: write the chunk's keys and values (slot -1 for padding), then attend.

    Against the reference over an f32 pool written directly, so a bf16 pool shows its rounding: keys and
    values rounded once each, two bf16 rounding points on the path.
    """
    full = make_call(5, [21, 9, 40], [8, 4, 6])
    B, T = full.positions.shape
    pos = np.asarray(full.positions)
    pages = np.take_along_axis(np.asarray(full.block_tables), np.maximum(pos, 0) // S, axis=1)
    slots = np.where(pos >= 0, pages * S + pos % S, -1).astype(np.int32)
    pool = np.array(full.kv_pool)
    k = pool[full.layer, 0, slots // S, slots % S]  # [B, T, K, D]; padding rows read junk, written nowhere
    v = pool[full.layer, 1, slots // S, slots % S]
    before = pool.copy()
    for b, t in zip(*np.nonzero(slots >= 0)):
        before[full.layer, :, slots[b, t] // S, slots[b, t] % S] = np.nan

    step = jax.jit(lambda c, k, v, slots: paged_attention(
        c.q, kv_cache_write(c.kv_pool, k, v, slots, c.layer), *c[2:], scale=SCALE, key_block=KEY_BLOCK))
    out = step(full._replace(kv_pool=jnp.asarray(before, dtype)), k, v, slots)
    bound = tol.bound({"bfloat16": 2 if dtype == jnp.bfloat16 else 0, "float32": tol.attention_roundings(D, M * S)})
    assert_within(relative_error(out, reference(full, jnp.int32(0))), bound, f"written then attended, {dtype}")


# --- inference only, and export ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["jvp", "grad"])
@pytest.mark.parametrize("op", ["paged_attention", "kv_cache_write"])
def test_inference_only(op, mode):
    call = make_call(0, [5], [2], T=2)
    k = jnp.ones((1, 2, 2, D))
    slots = jnp.array([[4, 5]], jnp.int32)
    f = {"paged_attention": lambda x: paged_attention(x, *call[1:], scale=SCALE),
         "kv_cache_write": lambda x: kv_cache_write(call.kv_pool, x, x, slots, call.layer)}[op]
    x = {"paged_attention": call.q, "kv_cache_write": k}[op]
    with pytest.raises(TypeError, match=f"{op} is inference-only"):
        if mode == "jvp":
            jax.jvp(f, (x,), (x,))
        else:
            jax.grad(lambda x: jnp.sum(f(x)))(x)


def test_export_blockwise_step():
    """A write-then-attend step exports with the pool donated, a while loop and no custom_call,
    and the serialized form runs and matches jax.jit."""
    call = make_call(2, [40, 17, 29], [8, 3, 8])

    def step(kv_pool, q, block_tables, positions, seq_lens, slots, k, v, window):
        kv_pool = kv_cache_write(kv_pool, k, v, slots, 1)
        return paged_attention(q, kv_pool, 1, block_tables, positions, seq_lens, scale=SCALE, window=window,
                               key_block=KEY_BLOCK), kv_pool

    B, T = call.positions.shape
    slots = jnp.full((B, T), -1, jnp.int32)  # the keys are already in the pool; write nothing
    kv = jnp.zeros((B, T, 2, D))
    args = (call.kv_pool, call.q, call.block_tables, call.positions, call.seq_lens, slots, kv, kv, jnp.int32(6))
    expected = paged_attention_reference(*call, scale=SCALE, window=6)
    exported = jax.export.export(jax.jit(step, donate_argnums=0))(*args)
    text = exported.mlir_module()
    assert "custom_call" not in text
    assert "stablehlo.while" in text
    assert "tf.aliasing_output = 1" in text  # the pool is the second result
    out, _ = jax.export.deserialize(exported.serialize()).call(*args)
    assert_within(relative_error(out, expected), BOUND, "exported step")
