"""The prefix cache (serve/core/prefix_cache.py over kv_cache's hashes and pool) alone, without a model: page hashes
chained through every earlier page and the artifact, hits that share pages and count their holders, hits that never
cover a prompt's last token, pages evicted when the pool needs them, and a recurrent pool's state snapshots. Sequences
are driven as the scheduler drives them (lookup, take the rest, write, release last page first).

Control: a page hash that ignores its parent fails the chaining tests and the hit test, and all pass as they are."""

from __future__ import annotations

import numpy as np
import pytest

from tlaloc_jax import artifact as af
from tlaloc_jax.serve.core import kv_cache
from tlaloc_jax.serve.core.kv_cache import UnitPool, artifact_seed, block_hash, extend_hashes
from tlaloc_jax.serve.core.prefix_cache import Copy, PrefixCache
from tlaloc_jax.serve.core.request import Request
from tlaloc_jax.serve.host_sampling import GREEDY

PAGED, STATE = af.PoolKind.PAGED_KV, af.PoolKind.STATE_SLOTS
BS = 4                                   # positions a page
ROOT = artifact_seed("artifact A")


def hashes(tokens, root=ROOT) -> list[bytes]:
    out: list[bytes] = []
    extend_hashes(out, tokens, BS, root)
    return out


def test_page_hashes_chain_through_every_earlier_page():
    """Page i's hash covers pages 0..i and the artifact: lists that part at page j share hashes before j and no
    hash from j on; the partial last page has none; growing the list one token at a time gives the same hashes."""
    a = list(range(10, 28))                                      # four full pages and two tokens
    assert len(hashes(a)) == 4
    for j in range(4):
        b = list(a)
        b[j * BS + 1] += 100                                     # one token of page j differs
        ha, hb = hashes(a), hashes(b)
        assert ha[:j] == hb[:j], f"pages before {j}"
        assert all(x != y for x, y in zip(ha[j:], hb[j:])), f"a list that differs in page {j} shares a later hash"
    assert not set(hashes(a)) & set(hashes(a, artifact_seed("artifact B"))), "another artifact shares a hash"
    grown: list[bytes] = []
    for n in range(len(a) + 1):
        extend_hashes(grown, a[:n], BS, ROOT)
    assert grown == hashes(a)


def test_a_page_hashes_differently_at_another_place():
    """The same four tokens as page 0 of one list and page 1 of another are different pages (their KV differs)."""
    page = [7, 8, 9, 10]
    assert hashes(page)[0] != hashes([1, 2, 3, 4] + page)[1]
    assert hashes([5, 6, 7, 8] + page)[1] != hashes([1, 2, 3, 4] + page)[1]


def test_block_hash_covers_its_parent_and_each_token_in_order():
    parent, other = block_hash(ROOT, [1, 2, 3, 4]), block_hash(ROOT, [1, 2, 3, 5])
    tokens = [9, 8, 7, 6]
    seen = {block_hash(parent, tokens), block_hash(other, tokens), block_hash(parent, tokens[::-1]),
            block_hash(parent, [9, 8, 7, 7]), block_hash(parent, np.array(tokens, np.int32))}
    assert len(seen) == 4 and block_hash(parent, np.array(tokens, np.int32)) == block_hash(parent, tokens)


# -- the cache over a pool -------------------------------------------------------------------------------------


def request(rid: str, tokens: list[int], state: bool = False) -> Request:
    held = {PAGED: [], STATE: []} if state else {PAGED: []}
    return Request(rid, list(tokens), 8, frozenset(), GREEDY, np.random.default_rng(0), held, 0.0)


def start(cache: PrefixCache, pool: UnitPool, s: Request) -> int:
    """A sequence's prompt as the scheduler reads it: its cached prefix shared, the other pages taken, all its
    positions written. -> the positions the hit let it skip."""
    hit = cache.lookup(s)
    s.held[PAGED] = list(hit.pages)
    s.computed, s.cached_pages = hit.length, len(hit.pages)
    need = -(-len(s.tokens) // BS) - len(hit.pages)
    s.held[PAGED] += pool.take(need)
    cache.written(s, len(s.tokens), True)
    s.computed = len(s.tokens)
    return hit.length


def finish(pool: UnitPool, s: Request) -> None:
    pool.release(s.held[PAGED][::-1])
    s.held[PAGED] = []


def new_cache() -> tuple[PrefixCache, UnitPool]:
    pool = UnitPool(16, "kv", "pages")
    return PrefixCache({PAGED: pool}, BS, ROOT, snapshots=False), pool


def test_a_hit_shares_the_cached_pages_and_counts_their_holders():
    cache, pool = new_cache()
    a = request("a", list(range(1, 15)))                         # three full pages and two tokens
    assert start(cache, pool, a) == 0 and pool.cached_units == 3
    b = request("b", list(range(1, 13)) + [50, 51, 52])          # the same three pages, another tail
    assert start(cache, pool, b) == 12
    assert b.held[PAGED][:3] == a.held[PAGED][:3] and b.held[PAGED][3] != a.held[PAGED][3]
    assert [pool.holders(u) for u in a.held[PAGED]] == [2, 2, 2, 1]
    assert pool.in_use == 5
    finish(pool, a)
    assert [pool.holders(u) for u in b.held[PAGED]] == [1, 1, 1, 1] and pool.in_use == 4
    finish(pool, b)
    assert pool.in_use == 0 and pool.cached_units == 3         # free, and still found
    c = request("c", list(range(1, 9)) + [60])                   # two of those pages
    assert start(cache, pool, c) == 8


def test_a_hit_stops_at_the_first_page_that_differs():
    """Pages after a differing one are not shared even when their own tokens match: their KV read other keys."""
    cache, pool = new_cache()
    a = request("a", list(range(1, 18)))
    start(cache, pool, a)
    b = request("b", [1, 2, 3, 4, 99, 6, 7, 8] + list(range(9, 18)))
    assert start(cache, pool, b) == 4
    shifted = request("shifted", list(range(5, 18)))             # a's pages 1-3, one page earlier
    assert start(cache, pool, shifted) == 0
    assert not set(shifted.held[PAGED]) & set(a.held[PAGED])


def test_a_hit_leaves_the_last_prompt_token_to_compute():
    """A prompt of exactly two cached pages reuses one: its last token must be computed to give the next one."""
    cache, pool = new_cache()
    a = request("a", list(range(1, 10)))
    start(cache, pool, a)
    assert start(cache, pool, request("b", list(range(1, 9)))) == 4
    assert start(cache, pool, request("c", list(range(1, 10)))) == 8


def test_give_back_undoes_a_lookup():
    cache, pool = new_cache()
    a = request("a", list(range(1, 14)))
    start(cache, pool, a)
    before = [pool.holders(u) for u in range(pool.num_units)], pool.free_units
    hit = cache.lookup(request("b", list(range(1, 14))))
    assert hit.length == 12 and [pool.holders(u) for u in hit.pages] == [2, 2, 2]
    cache.give_back(hit)
    assert ([pool.holders(u) for u in range(pool.num_units)], pool.free_units) == before


def test_cached_pages_are_evicted_least_recently_used_first_and_then_miss():
    """Cached pages no one holds are given up when a sequence needs pages, the least recently used first; a hit
    counts as a use. An evicted page's prefix misses from there on."""
    cache, pool = new_cache()
    old, new = request("old", list(range(1, 10))), request("new", list(range(101, 110)))
    for s in (old, new):
        start(cache, pool, s)
        finish(pool, s)
    assert pool.cached_units == 4 and pool.free_units == 16
    again = request("again", list(range(1, 10)))                 # old's prefix is used again: new's is now older
    assert start(cache, pool, again) == 8
    finish(pool, again)
    filler = request("filler", list(range(200, 252)))            # 13 pages: the least recently used, new's among them
    start(cache, pool, filler)
    assert cache.lookup(request("new2", list(range(101, 110)))).length == 0
    hit = cache.lookup(request("old2", list(range(1, 10))))
    assert hit.length == 8
    cache.give_back(hit)


def test_a_state_snapshot_is_recorded_once_copied_and_held_until_restored():
    """A recurrent pool's state is shared through snapshots taken at page-aligned ends of a prompt's chunks: a copy
    that failed records nothing; one that ran is found by a later prompt with that prefix, held by it until its
    own copy of it ran, and the hit stops at the last snapshot even where more pages are cached (the junction,
    where that prompt's first chunk stops to leave one)."""
    paged, state = UnitPool(16, "kv", "pages"), UnitPool(4, "state", "slots")
    cache = PrefixCache({PAGED: paged, STATE: state}, BS, ROOT, snapshots=True)
    a = request("a", list(range(1, 11)), state=True)
    assert cache.lookup(a).length == 0
    a.held = {PAGED: paged.take(3), STATE: state.take(1)}
    for ok in (False, True):
        a.computed = 8
        cache.written(a, 8, True)                                # the end of a page-aligned chunk of its prompt
        (copy,) = cache.snapshot_copies()
        assert (copy.src, copy.hash) == (a.held[STATE][0], a.hashes[1]) and state.holders(copy.dst) == 1
        cache.commit([copy], ok)
        assert state.holders(copy.dst) == 0 and state.lookup(a.hashes[1]) == (copy.dst if ok else None)
    a.generated, a.computed = [11, 12], 12
    cache.written(a, 12, False)                                  # a third page, written decoding: no snapshot
    assert cache.snapshot_copies() == [] and paged.cached_units == 3
    b = request("b", list(range(1, 13)) + [70], state=True)
    hit = cache.lookup(b)
    assert (hit.length, hit.snapshot, hit.junction) == (8, copy.dst, 12)
    assert hit.pages == a.held[PAGED][:2] and state.holders(copy.dst) == 1
    b.held = {PAGED: list(hit.pages), STATE: state.take(1)}
    cache.commit([Copy(hit.snapshot, b.held[STATE][0], seq=b)], True)      # the restore ran
    assert state.holders(copy.dst) == 0 and state.lookup(a.hashes[1]) == copy.dst


# -- control ------------------------------------------------------------------------------------------------------


def _parentless(parent: bytes, tokens) -> bytes:
    """The planted bug: a page's hash of its own tokens only."""
    return block_hash(b"", tokens)                # this module's name for the real one, unpatched


@pytest.mark.parametrize("check_run", [test_page_hashes_chain_through_every_earlier_page,
                                       test_a_page_hashes_differently_at_another_place,
                                       test_a_hit_stops_at_the_first_page_that_differs])
def test_control_a_hash_that_ignores_its_parent_is_caught(check_run, monkeypatch):
    check_run()                          # clean: passes
    monkeypatch.setattr(kv_cache, "block_hash", _parentless)
    with pytest.raises(AssertionError):
        check_run()
