"""Every unit a sequence holds, behind one API: what the scheduler asks of the pools and the prefix cache.

As vLLM v1's KVCacheManager: `get_computed_blocks` finds a new sequence's cached prefix (and holds it),
`allocate_slots` takes the units its next positions need in every kind of pool (all or nothing), `free` gives back
all it holds, `cache_written` records its full pages once written. The scheduler never touches a pool itself.
"""

from __future__ import annotations

import logging
from typing import Sequence

from tlaloc_jax import artifact as af

from . import kv_cache
from .paging import pool_rule
from .prefix_cache import Copy, Hit, PrefixCache
from .request import Request, RequestRefused

log = logging.getLogger("tlaloc_jax.serve")

# How refusals and logs name each kind's units.
KIND_NAMES = {af.PoolKind.PAGED_KV: ("KV", "pages"), af.PoolKind.RING_KV: ("windowed KV", "pages"),
              af.PoolKind.STATE_SLOTS: ("state", "slots")}


class KVCacheManager:
    """The units of each of an artifact's pool kinds, who holds them, and (when on) the prefix cache over them."""

    def __init__(self, m: af.Manifest, *, prefix_caching: bool | None = None, identity: str = ""):
        self.manifest = m
        self.block_size = m.block_size
        self.rules = {kind: pool_rule(m.pools_of(kind)[0], m.block_size) for kind in m.pool_kinds}
        self.pools = {kind: kv_cache.UnitPool(m.capacity(kind), *KIND_NAMES.get(kind, (str(kind), "units")))
                      for kind in m.pool_kinds}
        copies = any(e.kind == af.EntryKind.COPY_SLOTS for e in m.entries)
        self.prefix_caching = self._caching(prefix_caching, copies)
        self.prefix = PrefixCache(self.pools, m.block_size, kv_cache.artifact_seed(identity), snapshots=copies) \
            if self.prefix_caching else None
        # While others run, a new sequence leaves this many KV pages free for their next tokens.
        self.watermark = max(1, self.pools[af.PoolKind.PAGED_KV].num_units // 100) \
            if af.PoolKind.PAGED_KV in self.pools else 0

    def _caching(self, asked: bool | None, copies: bool) -> bool:
        """Prefix caching, unless a pool's content cannot be reused exactly (refused by name when asked for)."""
        blocking = [p for p in self.manifest.pools if p.kind == af.PoolKind.RING_KV
                    or (p.kind == af.PoolKind.STATE_SLOTS and not copies)]
        if asked is False:
            return False
        if blocking:
            why = ", ".join(f"{p.name} ({p.kind}{'' if p.kind == af.PoolKind.RING_KV else ', no copy_slots entry'})"
                            for p in blocking)
            if asked:
                raise ValueError(f"prefix caching cannot reuse pool {why} exactly: a later sequence would need what "
                                 f"the pool held at the end of the prefix; serve without prefix caching")
            log.info("prefix caching is off: pool %s cannot be reused exactly by a later sequence", why)
            return False
        return True

    # -- sizes ---------------------------------------------------------------------------------------------

    def check_could_fit(self, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse a sequence that needs more units of a pool than the whole pool holds ("exceeds_pool")."""
        for kind, pool in self.pools.items():
            need = self.rules[kind].units(prompt_len + max_new_tokens - 1)
            if need > pool.num_units:
                size = "" if kind == af.PoolKind.STATE_SLOTS else \
                    f" of {prompt_len} prompt tokens plus max_new_tokens {max_new_tokens}"
                raise RequestRefused("exceeds_pool", f"a sequence{size} needs {need} {pool.name} {pool.unit}, and "
                                                     f"the pool holds {pool.num_units}: it could never run",
                                     pool=str(kind))

    def call_limit(self, start: int) -> int | None:
        """The most positions from `start` one call may write (a ring of pages holds a window), None: no limit."""
        limits = [n for n in (rule.call_limit(start) for rule in self.rules.values()) if n is not None]
        return min(limits) if limits else None

    def usage(self) -> float:
        """The fraction of the first pool kind's units held by sequences (vllm:kv_cache_usage_perc)."""
        pool = self.pools[self.manifest.pool_kinds[0]]
        return pool.in_use / pool.num_units

    def least_free(self) -> int:
        return min(p.free_units for p in self.pools.values())

    # -- a sequence's units --------------------------------------------------------------------------------

    def get_computed_blocks(self, s: Request) -> Hit | None:
        """A new (or preempted) sequence's cached prefix, its units held and `computed` moved past it; None: caching
        is off, or its prompt logprobs are asked (every prompt position is computed)."""
        if self.prefix is None or s.computed or (s.prompt_logprobs is not None and not s.generated):
            return None
        hit = self.prefix.lookup(s)
        if hit.pages:
            s.held[af.PoolKind.PAGED_KV] = list(hit.pages)
        s.computed = hit.length
        s.cached_pages = len(hit.pages)
        s.junction = hit.junction
        return hit

    def undo_computed_blocks(self, s: Request, hit: Hit | None) -> None:
        """Undo get_computed_blocks for a sequence that does not start after all."""
        if hit is not None:
            self.prefix.give_back(hit)
        for held in s.held.values():
            held.clear()
        s.computed = s.cached_pages = s.junction = 0

    def can_admit(self, s: Request, end: int, others_running: bool) -> bool:
        """Whether a waiting sequence may start with positions up to `end`: every kind has the units, and while others
        run, `watermark` KV pages stay free for their next tokens (a new sequence should not cause a preemption at
        once)."""
        for kind, pool in self.pools.items():
            left = pool.free_units - max(0, self.rules[kind].units(end) - len(s.held[kind]))
            if left < 0 or (others_running and kind == af.PoolKind.PAGED_KV and left < self.watermark):
                return False
        return True

    def allocate_slots(self, s: Request, end: int) -> bool:
        """Take what the sequence's positions up to `end` hold of each kind of pool; all or nothing."""
        got: dict[af.PoolKind, list[int]] = {}
        for kind, pool in self.pools.items():
            need = self.rules[kind].units(end) - len(s.held[kind])
            if need > 0:
                units = pool.take(need)
                if units is None:
                    for k, us in got.items():
                        self.pools[k].release(us)
                    return False
                got[kind] = units
        for kind, units in got.items():
            s.held[kind].extend(units)
        return True

    def held_counts(self, s: Request) -> dict[af.PoolKind, int]:
        return {kind: len(units) for kind, units in s.held.items()}

    def truncate(self, s: Request, counts: dict[af.PoolKind, int]) -> None:
        """Give back what the sequence took past `counts` units of each kind (held_counts before a trial)."""
        for kind, count in counts.items():
            extra = s.held[kind][count:]
            del s.held[kind][count:]
            self.pools[kind].release(extra[::-1])

    def trim(self, s: Request, end: int) -> None:
        """Give back the units past those the sequence's positions up to `end` hold (its deepest first)."""
        self.truncate(s, {kind: min(len(held), self.rules[kind].units(end)) for kind, held in s.held.items()})

    def free(self, s: Request) -> None:
        """Give back everything the sequence holds, its deepest pages first (they are evicted before the pages
        they follow)."""
        for kind, held in s.held.items():
            self.pools[kind].release(held[::-1])
            held.clear()
        s.cached_pages = 0

    # -- the prefix cache ----------------------------------------------------------------------------------

    def cache_written(self, s: Request, end: int) -> None:
        """A call wrote the sequence's positions up to `end`: its full pages join the prefix cache."""
        if self.prefix is not None:
            self.prefix.written(s, end, end <= len(s.prompt))

    def snapshot_copies(self) -> list[Copy]:
        """The state snapshots this step's calls left to take (core/prefix_cache.py); commit them once copied."""
        return self.prefix.snapshot_copies() if self.prefix is not None else []

    def commit_copies(self, copies: Sequence[Copy], ok: bool) -> None:
        if copies:
            self.prefix.commit(list(copies), ok)

    def computing(self, running: Sequence[Request], s: Request, hit: Hit) -> bool:
        """Whether the page after a waiting sequence's cached prefix is one a running sequence is computing now
        (the same tokens, in a prompt it is still reading): the waiting one starts once that page is cached rather
        than compute it too (requests that share a system prompt and arrive together compute it once)."""
        c = hit.length // self.block_size
        if c >= (s.length - 1) // self.block_size:
            return False                  # nothing more of its prompt could come from the cache
        h = s.hashes[c]
        return any(r.reading_prompt and r.computed < (c + 1) * self.block_size and len(r.hashes) > c
                   and r.hashes[c] == h for r in running)
