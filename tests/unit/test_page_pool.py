"""The page pool (serve/core/kv_cache.py UnitPool) alone, without a model: reference counts through take, share and
release, the free queue's least-recently-used order, cached pages given up (evicted) when taken, and a seeded random
run of operations checked step by step against a reference model of the pool (a dict of counts, a list of free
pages, a dict of hashes): no page is handed out while anyone holds it, and every count agrees.

Control: a release that frees a page still held once (an off-by-one in its count) fails the count test and the
random run, and both pass on the pool as it is."""

from __future__ import annotations

import random

import pytest

from tlaloc_jax.serve.core import kv_cache
from tlaloc_jax.serve.core.kv_cache import UnitPool


def test_a_shared_page_stays_held_until_its_last_holder_releases_it():
    """The case an off-by-one release gets wrong: a page held twice and released once is still held, so a take of
    every free page must fail, and a take of one must hand out the other page."""
    p = UnitPool(2)
    u = p.take(1)[0]
    p.share(u)
    assert p.holders(u) == 2
    p.release([u])
    assert p.holders(u) == 1 and p.free_units == 1 and p.in_use == 1
    assert p.take(2) is None and p.free_units == 1          # refused whole: nothing taken
    assert p.take(1) == [1 - u]
    p.release([u])
    assert p.holders(u) == 0 and p.free_units == 1
    with pytest.raises(ValueError, match=rf"page {u} of pool 'pool' is not held"):
        p.release([u])
    assert p.holders(u) == 0 and p.free_units == 1          # the refused release changed nothing


def test_free_pages_are_taken_least_recently_freed_first():
    p = UnitPool(4, "kv", "pages")
    assert p.take(4) == [0, 1, 2, 3] and p.take(1) is None
    p.release([2, 0, 3])
    p.touch(0)                          # a free page just used again goes to the back
    assert p.take(3) == [2, 3, 0]


def test_a_cached_page_outlives_its_holders_until_it_is_taken_again():
    """Released, a cached page is free yet still found by its hash; shared again, it leaves the free queue; taken
    for another sequence (evicted), its hash is forgotten."""
    p = UnitPool(3)
    a, b, c = p.take(3)
    p.cache(a, b"A")
    p.cache(b, b"A")                    # the first page recorded for a hash keeps it
    p.cache(a, b"other")                # and a page holds one hash
    assert p.lookup(b"A") == a and p.lookup(b"other") is None and p.cached_units == 1
    p.release([c, b, a])
    assert p.free_units == 3 and p.lookup(b"A") == a
    p.share(a)                          # a prefix hit on a free cached page
    assert p.holders(a) == 1 and p.free_units == 2 and p.lookup(b"A") == a
    p.release([a])
    assert p.take(2) == [c, b] and p.lookup(b"A") == a      # a went to the back: the others go first
    assert p.take(1) == [a] and p.lookup(b"A") is None and p.cached_units == 0


def test_an_empty_pool_is_refused_by_name():
    with pytest.raises(ValueError, match="pool 'kv' needs at least one unit, got 0"):
        UnitPool(0, "kv")


# -- a random run against a reference model ---------------------------------------------------------------------


class Model:
    """What the pool should hold: each page's count, the free pages in the order they are taken, each cached
    page's hash."""

    def __init__(self, n: int):
        self.refs = {u: 0 for u in range(n)}
        self.free = list(range(n))
        self.hash_of: dict[int, bytes] = {}

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        for u in out:
            self.refs[u] = 1
            self.hash_of.pop(u, None)
        return out

    def share(self, u: int) -> None:
        if self.refs[u] == 0:
            self.free.remove(u)
        self.refs[u] += 1

    def release(self, units: list[int]) -> None:
        for u in units:
            self.refs[u] -= 1
            if self.refs[u] == 0:
                self.free.append(u)

    def touch(self, u: int) -> None:
        if self.refs[u] == 0:
            self.free.remove(u)
            self.free.append(u)


def check(pool: UnitPool, model: Model, step: str) -> None:
    """The pool agrees with the model in every count, and in which pages are free and cached."""
    for u, n in model.refs.items():
        assert pool.holders(u) == n, f"after {step}: page {u} has {pool.holders(u)} holders, {n} expected"
    assert pool.free_units == len(model.free) and pool.in_use == pool.num_units - len(model.free), step
    assert pool.cached_units == len(model.hash_of), step
    for u, h in model.hash_of.items():
        assert pool.lookup(h) == u, f"after {step}: hash of page {u} not found"


def run_operations(seed: int, steps: int = 3000, pages: int = 12) -> None:
    """`steps` random operations on a pool of `pages`, each checked against the model: sequences take pages, share
    cached ones (prefix hits), cache their pages, release them (last page first) or one page, touch free cached
    pages; a take that finds cached free pages evicts them. AssertionError at the first disagreement."""
    rng = random.Random(seed)
    pool, model = UnitPool(pages), Model(pages)
    seqs: list[list[int]] = []          # the pages each live sequence holds, one hold each
    next_hash = 0
    for i in range(steps):
        op = rng.choice(["take", "take", "share", "cache", "release", "release_one", "touch"])
        if op == "take":
            n = rng.randint(1, 4)
            got, want = pool.take(n), model.take(n)
            assert got == want, f"step {i}: take({n}) gave {got}, the model {want}"
            if got is not None:
                seqs.append(got)
        elif op == "share" and model.hash_of:
            u = pool.lookup(model.hash_of[rng.choice(sorted(model.hash_of))])
            pool.share(u)
            model.share(u)
            seqs.append([u])
        elif op == "cache" and seqs:
            u = rng.choice(rng.choice(seqs))
            h = next_hash.to_bytes(8, "little")
            next_hash += 1
            pool.cache(u, h)
            if u not in model.hash_of:
                model.hash_of[u] = h
        elif op == "release" and seqs:
            held = seqs.pop(rng.randrange(len(seqs)))
            pool.release(held[::-1])
            model.release(held[::-1])
        elif op == "release_one" and seqs:
            held = rng.choice(seqs)
            u = held.pop(rng.randrange(len(held)))
            pool.release([u])
            model.release([u])
            seqs[:] = [s for s in seqs if s]
        elif op == "touch" and model.hash_of:
            u = rng.choice(sorted(model.hash_of))
            pool.touch(u)
            model.touch(u)
        check(pool, model, f"step {i} ({op})")
        holds = [u for s in seqs for u in s]
        assert all(pool.holders(u) == holds.count(u) for u in set(holds)), f"step {i}: a held page was handed out"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_operations_agree_with_the_reference_model(seed):
    run_operations(seed)


# -- control ------------------------------------------------------------------------------------------------------


def _release_off_by_one(self, units):
    """The planted bug: a page goes back to the free queue while one holder still has it."""
    for u in units:
        if self._refs[u] <= 0:
            raise ValueError(f"{self.unit[:-1]} {u} of pool {self.name!r} is not held")
        self._refs[u] -= 1
        if self._refs[u] <= 1 and u not in self._free:
            self._free[u] = None


@pytest.mark.parametrize("check_run", [test_a_shared_page_stays_held_until_its_last_holder_releases_it,
                                       lambda: run_operations(0), lambda: run_operations(1)],
                         ids=["count test", "random run seed 0", "random run seed 1"])
def test_control_a_release_that_frees_a_held_page_is_caught(check_run, monkeypatch):
    check_run()                          # clean: passes
    monkeypatch.setattr(kv_cache.UnitPool, "release", _release_off_by_one)
    with pytest.raises(AssertionError):
        check_run()
