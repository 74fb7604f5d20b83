"""Prefix caching over the pools: full KV pages shared by hash, and state snapshots for recurrent pools.

A full page of full-history KV is recorded under its block hash (kv_cache.block_hash) once its positions are
written; a later sequence whose tokens hash the same shares it and starts after it. A recurrent layer's state
cannot be shared that way (it is one slot, rewritten by every token), so at the end of each page-aligned prompt
chunk the sequence's state is copied into a spare slot (a snapshot) recorded under the hash of the page it ends.
A later sequence then starts at the longest prefix whose pages are all cached *and* whose last page has a
snapshot: it shares the pages and gets a copy of the snapshot in its own slot. When its pages reach further
than the snapshots, its first chunk stops where its cached pages stop, and it leaves a snapshot there (the
point where the two prompts part), so the next sequence with that prefix starts there.

Snapshots and cached pages are held by nobody: they are the first units given up when a sequence needs one.
Both are found by the sequence's chain of page hashes, which starts from its cache_salt (kv_cache.salted_root):
requests with different salts, or a salt and none, share neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from tlaloc_jax import artifact as af

from . import kv_cache
from .request import Request

PAGED, STATE = af.PoolKind.PAGED_KV, af.PoolKind.STATE_SLOTS


@dataclass(frozen=True)
class Copy:
    """A state-slot copy the copy_slots entry makes: src slot -> dst slot (all state pools alike)."""

    src: int
    dst: int
    hash: bytes | None = None        # a snapshot's block hash (None: restoring a snapshot into a sequence's slot)
    seq: Request | None = None


@dataclass
class Hit:
    pages: list[int]                 # shared full pages (already held once more)
    snapshot: int | None             # the state snapshot to copy into the sequence's slot (held until copied)
    length: int                      # positions the sequence need not compute
    junction: int                    # where its first chunk stops to leave a snapshot (0: nowhere in particular)


class PrefixCache:
    def __init__(self, pools: dict[af.PoolKind, kv_cache.UnitPool], block_size: int, root: bytes,
                 snapshots: bool):
        self.pools = pools
        self.block_size = block_size
        self.root = root
        self.snapshots = snapshots and STATE in pools
        self._pending: list[tuple[Request, int]] = []

    def lookup(self, s: Request) -> Hit:
        """The longest prefix of the sequence's tokens a later call may skip (at least its last token is computed),
        with its units held."""
        tokens = s.tokens
        kv_cache.extend_hashes(s.hashes, tokens, self.block_size, self.root, s.prefix_salt)
        limit = (len(tokens) - 1) // self.block_size
        k = limit
        if PAGED in self.pools:
            pool = self.pools[PAGED]
            k = next((i for i, h in enumerate(s.hashes[:limit]) if pool.lookup(h) is None), limit)
        j, snap = k, None
        if STATE in self.pools:
            state = self.pools[STATE]
            j = next((i for i in range(k, 0, -1) if state.lookup(s.hashes[i - 1]) is not None), 0)
            if j:
                snap = state.lookup(s.hashes[j - 1])
                state.share(snap)
        pages = []
        if PAGED in self.pools:
            pool = self.pools[PAGED]
            pages = [pool.lookup(h) for h in s.hashes[:j]]
            for u in pages:
                pool.share(u)
        junction = k * self.block_size if self.snapshots and PAGED in self.pools and k > j else 0
        return Hit(pages, snap, j * self.block_size, junction)

    def give_back(self, hit: Hit) -> None:
        """Undo a lookup whose sequence did not start after all."""
        if hit.pages:
            self.pools[PAGED].release(hit.pages[::-1])
        if hit.snapshot is not None:
            self.pools[STATE].release([hit.snapshot])

    def written(self, s: Request, end: int, reading_prompt: bool) -> None:
        """A call wrote the sequence's positions up to `end`: its full pages join the cache, and a page-aligned end
        inside its prompt is marked for a snapshot."""
        full = end // self.block_size
        if full > s.cached_pages:
            kv_cache.extend_hashes(s.hashes, s.tokens[:full * self.block_size], self.block_size, self.root,
                                    s.prefix_salt)
            if PAGED in self.pools:
                pool, pages = self.pools[PAGED], s.held[PAGED]
                for i in range(s.cached_pages, full):
                    pool.cache(pages[i], s.hashes[i])
            s.cached_pages = full
        if self.snapshots and reading_prompt and end % self.block_size == 0 and full:
            self._pending.append((s, end))

    def snapshot_copies(self) -> list[Copy]:
        """The copies that take this step's marked snapshots, each into a unit of its own (held until committed)."""
        copies = []
        state = self.pools.get(STATE)
        for s, end in self._pending:
            h = s.hashes[end // self.block_size - 1]
            if s.finished or s.computed != end or not s.held[STATE] or state.lookup(h) is not None:
                continue
            units = state.take(1)
            if units is None:
                break
            copies.append(Copy(s.held[STATE][0], units[0], h, s))
        self._pending.clear()
        return copies

    def commit(self, copies: list[Copy], ok: bool) -> None:
        """After the copies ran (ok) or failed: snapshots are recorded and let go; restored ones let go."""
        state = self.pools.get(STATE)
        for c in copies:
            if c.hash is not None:
                if ok:
                    state.cache(c.dst, c.hash)
                state.release([c.dst])
            else:
                state.release([c.src])
