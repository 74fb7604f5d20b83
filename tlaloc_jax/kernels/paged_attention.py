"""Paged attention and the KV cache write over a stacked pool (inference only).

The pool holds every layer's keys and values: kv_pool [L, 2, P, S, K, D] (index 0 = keys, 1 = values).
A sequence owns pages; its block table [B, M] names them in order, so key position j of row b lives at
page block_tables[b, j // S], offset j % S. Names follow docs/glossary.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ._softmax import (HIGHEST, block_scores, finish, fold_block, group_heads, init_state, ungroup_heads,
                       visible_keys)


def _refuse_derivative(name: str):
    """A custom_jvp rule that refuses forward and reverse mode (jax.grad linearizes through the jvp)."""
    def rule(*args):
        raise TypeError(f"{name} is inference-only: it has no derivative (neither jax.jvp nor jax.grad)")
    return rule


def _window_array(window) -> jax.Array:
    """None, a Python int or a traced int32 scalar -> int32 scalar; <= 0 means no window."""
    return jnp.asarray(0 if window is None else window, jnp.int32)


# --- KV cache write ---------------------------------------------------------------------------------


def kv_cache_write(kv_pool: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, layer) -> jax.Array:
    """Scatter the call's keys and values into the pool.

    kv_pool: [L, 2, P, S, K, D], any float dtype (k and v are cast to it; float8_e4m3fn clamps them to +-448
    first); k, v: [B, T, K, D];
    slot_mapping: [B, T] int32, page * S + offset, -1 = write nothing; layer: int or int32 scalar.
    -> the updated kv_pool. One scatter into the whole pool, so XLA updates a donated pool in place.
    """
    return _kv_cache_write(kv_pool, k, v, slot_mapping, jnp.asarray(layer, jnp.int32))


@jax.custom_jvp
def _kv_cache_write(kv_pool, k, v, slot_mapping, layer):
    pages, page_size = kv_pool.shape[2], kv_pool.shape[3]
    # jnp wraps negative indices (page -1 would be the last page): send padding past the end and drop it.
    page = jnp.where(slot_mapping >= 0, slot_mapping // page_size, pages)
    offset = slot_mapping % page_size
    key_or_value = jnp.arange(2, dtype=jnp.int32)[:, None, None]  # [2, 1, 1] against page/offset [B, T]
    new = jnp.stack([k, v])  # [2, B, T, K, D]
    if kv_pool.dtype == jnp.float8_e4m3fn:
        # e4m3fn has no infinity: past +-448 the convert gives NaN. A value is stored as itself, clamped.
        new = jnp.clip(new, -448.0, 448.0)
    new = new.astype(kv_pool.dtype)
    return kv_pool.at[layer, key_or_value, page, offset].set(new, mode="drop")


_kv_cache_write.defjvp(_refuse_derivative("kv_cache_write"))


# --- paged attention --------------------------------------------------------------------------------


def paged_attention(q: jax.Array, kv_pool: jax.Array, layer, block_tables: jax.Array, positions: jax.Array,
                    seq_lens: jax.Array, *, scale: float, window=None, soft_cap: float | None = None,
                    key_block: int = 2048, ring: bool = False, sinks: jax.Array | None = None,
                    query_block: int | None = None) -> jax.Array:
    """Attention of the call's tokens over their sequences' pages.

    q: [B, T, H, D]; kv_pool: [L, 2, P, S, K, D]; layer: int or int32 scalar; block_tables: [B, M] int32;
    positions: [B, T] int32 (-1 = padding); seq_lens: [B] int32 (keys written for the row; 0 = empty row).
    Token (b, t) sees key j iff j <= positions[b, t], j < seq_lens[b] and, with a window W > 0,
    j > positions[b, t] - W. window: None, int, or int32 scalar (<= 0 = none, so it can vary under a scan
    over layers). soft_cap: scores -> cap * tanh(scores / cap). sinks: [H] or None, a logit per query head
    that joins each softmax's denominator with no value (GPT-OSS's attention sinks; not soft-capped).
    -> [B, T, H, D] f32; 0 where nothing is seen.

    A call whose context M * S fits in key_block is scored in one pass; a longer one loops over key
    blocks of key_block positions (a multiple of S) with an online softmax. On CPU such a call of more than
    query_block tokens a row (None: CPU_QUERY_BLOCK) is taken in tiles of query_block tokens, each folding
    only the key blocks its own tokens can see, so a prompt's early tokens skip its late keys.

    ring: block_tables [B, R] is each row's ring of R pages (a sliding layer's windowed pool): logical
    block b of the sequence lives on ring page b % R, so position p is written over p - R * S. Only the
    ring's R * S slots are gathered and scored, in one pass: slot i holds the position
    (L - 1) - ((L - 1 - i) mod (R * S)) of a row with L = seq_len keys, and is masked by that position as
    above. The caller keeps every position a token needs in the ring: a call writing n tokens from p0
    needs min(p0, W - 1) + n <= R * S.
    """
    page_size = kv_pool.shape[3]
    if key_block % page_size:
        raise ValueError(f"paged_attention: key_block {key_block} is not a multiple of the page size S = {page_size}")
    args = (q, kv_pool, jnp.asarray(layer, jnp.int32), block_tables, positions, seq_lens, _window_array(window), sinks)
    default = functools.partial(_paged_attention, scale, soft_cap, key_block, ring, None)
    if q.shape[1] == 1 and not ring:
        # A decode call: on CPU, small key blocks scored as multiply-reduces (see _decode_cpu); elsewhere the dots.
        cpu = functools.partial(_decode_cpu, scale, soft_cap, _whole_pages(CPU_DECODE_KEY_BLOCK, page_size, key_block),
                                _whole_pages(CPU_SHARED_KEY_BLOCK, page_size, key_block))
        return lax.platform_dependent(*args, cpu=cpu, default=default)
    if ring:
        return default(*args)
    # On CPU a call of several tokens a row folds key blocks of at most CPU_KEY_BLOCK positions, its tokens in
    # tiles of query_block.
    query_block = query_block or CPU_QUERY_BLOCK
    cpu_block = _whole_pages(CPU_KEY_BLOCK, page_size, key_block)
    tiled = q.shape[1] > query_block and block_tables.shape[1] * page_size > cpu_block
    if cpu_block == key_block and not tiled:
        return default(*args)
    cpu = functools.partial(_paged_attention, scale, soft_cap, cpu_block, ring, query_block if tiled else None)
    return lax.platform_dependent(*args, cpu=cpu, default=default)


def _whole_pages(keys: int, page_size: int, key_block: int) -> int:
    """A CPU key block of about `keys` positions: whole pages (at least one), at most key_block."""
    return min(max(keys // page_size, 1) * page_size, key_block)


# On CPU a decode call folds its keys in blocks of CPU_DECODE_KEY_BLOCK positions (whole pages), and a call of
# several tokens a row in blocks of at most CPU_KEY_BLOCK: blocks of 32 keys stay in cache while one token's scores
# and sums are taken, twice as fast as blocks of 128 at 8 and 32 rows (bench/decode_attention.py), and a prompt
# chunk over 128-key blocks takes half the time of one pass over a 256-position bucket (bench/decode_attention.py --prefill 32).
CPU_DECODE_KEY_BLOCK = 32
CPU_KEY_BLOCK = 128
# A CPU call of several tokens a row over more than one key block takes its tokens in tiles of CPU_QUERY_BLOCK,
# each tile folding the key blocks up to its own last position (a causal prompt scores about half its square).
CPU_QUERY_BLOCK = 128
# Keys on pages every row of a decode call shares (a cached prefix) are scored for all rows as dots, in blocks of
# CPU_SHARED_KEY_BLOCK: at 32 rows and 192 shared of 260 keys, half the time of each row reading them
# (bench/decode_attention.py --shared 192).
CPU_SHARED_KEY_BLOCK = 64


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _decode_cpu(scale, soft_cap, key_block, shared_block, q, kv_pool, layer, block_tables, positions, seq_lens, window,
                sinks):
    """paged_attention of one token a row, as XLA's CPU backend runs it fastest.

    In a call of several rows over more than one key block, keys on pages every live row shares (a cached prefix:
    the leading block-table columns that agree) are read once and scored for all rows as dots, in blocks of
    shared_block positions. The rest loop over the key blocks the rows have written, each block's pages gathered and
    its scores and value sums written as multiply-reduces over the head dimension (XLA fuses the gather into them;
    its batched dots of G query heads are slower)."""
    B, _, H, D = q.shape
    S, K = kv_pool.shape[3], kv_pool.shape[4]
    G = H // K
    qg = q.astype(jnp.float32).reshape(B, K, G, D)
    pages_per_block = key_block // S
    M = block_tables.shape[1]
    num_blocks = -(-M // pages_per_block)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_blocks * pages_per_block - M)))
    first, last = key_block_range(positions, seq_lens, window, key_block, num_blocks)
    shares = B > 1 and num_blocks > 1        # a context of one block stays one fold, no loop
    shared, shared_table = shared_prefix(block_tables, seq_lens, S) if shares else (0, None)

    def fold(state, s, axis, value_sums):
        """Fold scores s (-inf where unseen; keys on `axis`) into (m, l, acc); value_sums(p): p's sums of values."""
        m, l, acc = state
        m_new = jnp.maximum(m, jnp.max(s, axis=axis))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - jnp.expand_dims(shift, axis))
        rescale = jnp.exp(m - shift)
        return m_new, rescale * l + jnp.sum(p, axis=axis), rescale[..., None] * acc + value_sums(p)

    def capped(s):
        return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)

    def body(i, state):
        pages = lax.dynamic_slice_in_dim(tables, i * pages_per_block, pages_per_block, axis=1)
        k, v = _gather_pages(kv_pool, layer, pages)                                  # [B, N, K, D]
        s = capped(jnp.sum(qg[:, None] * k[:, :, :, None, :], axis=-1) * scale)      # [B, N, K, G]
        key_pos = i * key_block + jnp.arange(key_block, dtype=jnp.int32)
        seen = visible_keys(key_pos, positions, seq_lens, window)[:, 0] & (key_pos >= shared)   # [B, N]
        s = jnp.where(seen[:, :, None, None], s, -jnp.inf)
        v = jnp.where(seen[:, :, None, None], v, 0.0)        # a never-written value may be NaN: never multiplied
        return fold(state, s, 1, lambda p: jnp.sum(p[..., None] * v[:, :, :, None, :], axis=1))   # [B, K, G, D]

    if sinks is None:
        state = (jnp.full((B, K, G), -jnp.inf, jnp.float32), jnp.zeros((B, K, G), jnp.float32))
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(K, G)[None], (B, K, G))
        state = (sink, jnp.ones((B, K, G), jnp.float32))
    state = (*state, jnp.zeros((B, K, G, D), jnp.float32))
    if shares:
        shared_pages = shared_block // S
        shared_blocks = -(-M // shared_pages)
        shared_table = jnp.pad(shared_table, (0, shared_blocks * shared_pages - M))
        qk = jnp.transpose(qg, (1, 0, 2, 3)).reshape(K, B * G, D)  # the shared keys' dots: K heads of B * G queries

        def shared_body(i, state):                          # state by KV head: [K, B * G], [K, B * G, D]
            pages = lax.dynamic_slice_in_dim(shared_table, i * shared_pages, shared_pages)
            k, v = (x[0].transpose(1, 0, 2) for x in _gather_pages(kv_pool, layer, pages[None]))  # [K, N, D]
            s = capped(jnp.einsum("kqd,knd->kqn", qk, k, precision=HIGHEST,
                                  preferred_element_type=jnp.float32) * scale)        # [K, B * G, N]
            key_pos = i * shared_block + jnp.arange(shared_block, dtype=jnp.int32)
            seen = visible_keys(key_pos, positions, seq_lens, window)[:, 0] & (key_pos < shared)    # [B, N]
            s = jnp.where(jnp.repeat(seen, G, axis=0)[None], s, -jnp.inf)
            v = jnp.where(jnp.any(seen, axis=0)[None, :, None], v, 0.0)   # a never-written value may be NaN
            return fold(state, s, -1, lambda p: jnp.einsum("kqn,knd->kqd", p, v, precision=HIGHEST,
                                                           preferred_element_type=jnp.float32))

        def by_kv_head(x):      # [B, K, G, ...] <-> [K, B * G, ...]
            return jnp.moveaxis(x, 0, 1).reshape(K, B * G, *x.shape[3:])

        def by_row(x):
            return jnp.moveaxis(x.reshape(K, B, G, *x.shape[2:]), 1, 0)

        first_shared = key_block_range(positions, seq_lens, window, shared_block, shared_blocks)[0]
        state = lax.fori_loop(first_shared, -(-shared // shared_block), shared_body, tuple(map(by_kv_head, state)))
        state = tuple(map(by_row, state))
        first = jnp.maximum(first, shared // key_block)
    m, l, acc = body(0, state) if num_blocks == 1 else lax.fori_loop(first, last + 1, body, state)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    return out.reshape(B, 1, H, D)


_decode_cpu.defjvp(_refuse_derivative("paged_attention"))


def shared_prefix(block_tables: jax.Array, seq_lens: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """The keys every live row reads from the same pages: -> (n, table [M]).

    n: int32, the leading keys on block-table columns equal in every live row (seq_len > 0), at most the longest
    row's seq_len, and 0 unless two rows are live; table: the first live row's block table, which names them.
    """
    live = seq_lens > 0
    table = block_tables[jnp.argmax(live)]
    same = jnp.all((block_tables == table) | ~live[:, None], axis=0)                   # [M]
    pages = jnp.sum(jnp.cumprod(same.astype(jnp.int32)))
    n = jnp.minimum(pages * page_size, jnp.max(seq_lens))
    return jnp.where(jnp.sum(live) >= 2, n, 0).astype(jnp.int32), table


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3, 4))
def _paged_attention(scale, soft_cap, key_block, ring, query_block, q, kv_pool, layer, block_tables, positions,
                     seq_lens, window, sinks):
    M, page_size = block_tables.shape[1], kv_pool.shape[3]

    def attend(q, positions):
        # q: [B, T', K, G, D] and its tokens' positions [B, T'] -> out [B, T', K, G, D]
        fold = functools.partial(_fold_pages, q=q, kv_pool=kv_pool, layer=layer, positions=positions,
                                 seq_lens=seq_lens, window=window, scale=scale, soft_cap=soft_cap)
        if ring:
            state = fold(init_state(q, sinks), block_tables, ring_key_positions(seq_lens, M * page_size))
        elif M * page_size <= key_block:
            state = fold(init_state(q, sinks), block_tables, 0)
        else:
            state = _blockwise(fold, init_state(q, sinks), block_tables, positions, seq_lens, window, key_block,
                               page_size)
        return finish(state)[0]

    q = group_heads(q.astype(jnp.float32), kv_pool.shape[4])
    if query_block is None:     # the call's tokens in one tile (paged_attention decides when tiles pay)
        return ungroup_heads(attend(q, positions))
    return ungroup_heads(_query_tiles(attend, q, positions, query_block))


def _query_tiles(attend, q: jax.Array, positions: jax.Array, query_block: int) -> jax.Array:
    """attend(q, positions) over tiles of query_block tokens, one after another (lax.map): q [B, T, K, G, D] ->
    [B, T, K, G, D]. A tile's loop ends at the key block of its own last position; padding tokens fill the last."""
    B, T = positions.shape
    n = -(-T // query_block)
    pad = n * query_block - T
    q = jnp.pad(q, ((0, 0), (0, pad)) + ((0, 0),) * 3)
    positions = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-1)

    def tiles(x):  # [B, n * query_block, ...] -> [n, B, query_block, ...]
        return jnp.moveaxis(x.reshape(B, n, query_block, *x.shape[2:]), 1, 0)

    out = lax.map(lambda tile: attend(*tile), (tiles(q), tiles(positions)))
    return jnp.moveaxis(out, 0, 1).reshape(B, n * query_block, *out.shape[3:])[:, :T]


_paged_attention.defjvp(_refuse_derivative("paged_attention"))


def _gather_pages(kv_pool: jax.Array, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """pages: [B, M'] -> keys, values [B, M' * S, K, D] f32, read in the pool's dtype and widened after."""
    k, v = kv_pool[layer, 0, pages], kv_pool[layer, 1, pages]  # [B, M', S, K, D]
    B, Mb, S, K, D = k.shape
    return (k.reshape(B, Mb * S, K, D).astype(jnp.float32), v.reshape(B, Mb * S, K, D).astype(jnp.float32))


def ring_key_positions(seq_lens: jax.Array, n: int) -> jax.Array:
    """The position each of a ring's n slots holds: [B] -> [B, n] int32 (negative: never written).

    Slot i holds the latest position congruent to i mod n that is below the row's seq_len L.
    """
    last = seq_lens[:, None].astype(jnp.int32) - 1
    return last - jnp.mod(last - jnp.arange(n, dtype=jnp.int32), n)


def _fold_pages(state, pages, first_key, *, q, kv_pool, layer, positions, seq_lens, window, scale, soft_cap):
    """Fold the keys on `pages` ([B, M']) into the softmax state of q [B, T, K, G, D].

    first_key: the position of the first key (consecutive positions follow), or [B, M' * S] positions
    per row (a ring). The pages are gathered once for the whole row: every token of the row scores the
    same keys.
    """
    k, v = _gather_pages(kv_pool, layer, pages)
    if jnp.ndim(first_key) == 2:
        key_pos = first_key
    else:
        key_pos = first_key + jnp.arange(k.shape[1], dtype=jnp.int32)
    mask = visible_keys(key_pos, positions, seq_lens, window)
    return fold_block(state, block_scores(q, k, scale=scale, soft_cap=soft_cap), mask, v)


def key_block_range(positions: jax.Array, seq_lens: jax.Array, window: jax.Array, key_block: int,
                    num_blocks: int) -> tuple[jax.Array, jax.Array]:
    """The key blocks the call must score: -> (first, last) int32, inclusive; first > last when there are none.

    positions: [B, T]; seq_lens: [B]; window: int32 scalar (<= 0 = none). The last block holds the last key
    any token sees (the smaller of max(seq_lens) - 1 and the latest position); the first is 0, or with a
    window the block of the earliest key any live token's window reaches.
    """
    last_key = jnp.minimum(jnp.max(seq_lens) - 1, jnp.max(positions))
    last = jnp.minimum(last_key // key_block, num_blocks - 1)  # -1 when every row is empty or every token padding
    window_start = jnp.maximum(positions - window + 1, 0)
    earliest = jnp.min(jnp.where(positions >= 0, window_start, num_blocks * key_block))
    first = jnp.where(window > 0, earliest // key_block, 0)
    return first.astype(jnp.int32), last.astype(jnp.int32)


def _blockwise(fold, state, block_tables, positions, seq_lens, window, key_block, page_size):
    """Online softmax over key blocks: a while loop that gathers key_block // S pages per iteration."""
    pages_per_block = key_block // page_size
    B, M = block_tables.shape
    num_blocks = -(-M // pages_per_block)
    # Whole blocks: the padding entries sit past every seq_len, so they are masked; page 0 is as good as any.
    tables = jnp.pad(block_tables, ((0, 0), (0, num_blocks * pages_per_block - M)))
    first, last = key_block_range(positions, seq_lens, window, key_block, num_blocks)

    def body(i, state):
        pages = lax.dynamic_slice_in_dim(tables, i * pages_per_block, pages_per_block, axis=1)
        return fold(state, pages, i * key_block)

    return lax.fori_loop(first, last + 1, body, state)


# --- reference --------------------------------------------------------------------------------------


def paged_attention_reference(q: jax.Array, kv_pool: jax.Array, layer, block_tables: jax.Array,
                              positions: jax.Array, seq_lens: jax.Array, *, scale: float, window=None,
                              soft_cap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Naive dense paged attention, for tests: same arguments and result as paged_attention.

    Gathers every page of every row, repeats KV heads to query heads, and takes a dense masked softmax (with
    sinks: over the visible scores and the head's sink, whose weight is then dropped).
    """
    B, T, H, D = q.shape
    _, _, _, S, K, _ = kv_pool.shape
    N = block_tables.shape[1] * S
    keys = kv_pool[layer, 0][block_tables].reshape(B, N, K, D).astype(jnp.float32)
    values = kv_pool[layer, 1][block_tables].reshape(B, N, K, D).astype(jnp.float32)
    keys = jnp.repeat(keys, H // K, axis=2)  # [B, N, H, D]: query head h reads KV head h // (H // K)
    values = jnp.repeat(values, H // K, axis=2)
    scores = jnp.einsum("bthd,bnhd->bhtn", q.astype(jnp.float32), keys, precision=HIGHEST)
    scores = scores * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)

    j = jnp.arange(N)
    pos = positions[:, :, None]
    mask = (j <= pos) & (j < seq_lens[:, None, None])
    if window is not None:
        mask = mask & ((window <= 0) | (j > pos - window))
    mask = mask[:, None]  # [B, 1, T, N]

    scores = jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], top.shape)   # [B, H, T, 1]
        top = jnp.maximum(top, sink)
    weights = jnp.where(mask, jnp.exp(scores - top), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    probs = weights / jnp.where(total > 0, total, 1.0)  # [B, H, T, N]
    terms = jnp.where(mask[..., None], probs[..., None] * jnp.transpose(values, (0, 2, 1, 3))[:, :, None], 0.0)
    return jnp.transpose(jnp.sum(terms, axis=3), (0, 2, 1, 3))  # [B, H, T, D] -> [B, T, H, D]
