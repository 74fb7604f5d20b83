"""The artifact's pools that vLLM's block manager does not see: a sliding window's ring of pages (ring_kv) and the
recurrent state slots (state_slots) of hybrid families, kept by the worker per request.

vLLM's hybrid KV manager hands every cache group block ids from one pool of one page size; an artifact sizes these
pools apart (`ring_pages` pages a sequence, one state slot a sequence), so vLLM's ids cannot index them. Instead
each running request holds a whole ring and a slot from the worker's own free lists, taken when it is first
scheduled (or resumed) and given back when it finishes or is preempted; the entries start a sequence's state afresh
at position 0, and its ring is written again from there. vLLM runs at most `max_sequences` requests at once (the
platform caps max_num_seqs), so a scheduled request always finds its units; vLLM's prefix cache is off for such
artifacts (a cached prefix would skip the positions that fill the ring and the state).
"""

from __future__ import annotations

from tlaloc_jax import artifact as af
from tlaloc_jax.serve.core.kv_cache import UnitPool
from tlaloc_jax.serve.core.paging import pool_rule

SIDE_KINDS = (af.PoolKind.RING_KV, af.PoolKind.STATE_SLOTS)


def per_sequence(m: af.Manifest, kind: af.PoolKind) -> int:
    """The units of a side pool one sequence holds: its whole ring, or one state slot."""
    return m.ring.ring_pages if kind == af.PoolKind.RING_KV else 1


def max_sequences(m: af.Manifest) -> int | None:
    """How many sequences the side pools hold at once (None: the artifact has none)."""
    caps = [m.capacity(kind) // per_sequence(m, kind) for kind in SIDE_KINDS if kind in m.pool_kinds]
    return min(caps) if caps else None


class SidePools:
    def __init__(self, m: af.Manifest):
        self.manifest = m
        kinds = [kind for kind in SIDE_KINDS if kind in m.pool_kinds]
        self.rules = {kind: pool_rule(m.pools_of(kind)[0], m.block_size) for kind in kinds}
        self.free_lists = {kind: UnitPool(m.capacity(kind), str(kind)) for kind in kinds}
        self.held: dict[str, dict[af.PoolKind, list[int]]] = {}

    def take(self, req_id: str) -> None:
        """The request's ring and slot (kept if it holds them already)."""
        if self.free_lists and req_id not in self.held:
            held = {kind: pool.take(per_sequence(self.manifest, kind)) for kind, pool in self.free_lists.items()}
            if any(units is None for units in held.values()):
                self.held[req_id] = {kind: units for kind, units in held.items() if units is not None}
                self.give_back(req_id)
                raise RuntimeError(f"request {req_id!r}: the side pools hold {max_sequences(self.manifest)} "
                                   "sequences, all taken (vLLM's max_num_seqs should be capped at that)")
            self.held[req_id] = held

    def give_back(self, req_id: str) -> None:
        for kind, units in self.held.pop(req_id, {}).items():
            self.free_lists[kind].release(units)

    def ring(self, req_id: str) -> list[int]:
        return self.held.get(req_id, {}).get(af.PoolKind.RING_KV, [])

    def state_slot(self, req_id: str) -> int:
        slots = self.held.get(req_id, {}).get(af.PoolKind.STATE_SLOTS)
        return slots[0] if slots else -1

    def call_limit(self, start: int) -> int | None:
        """The most tokens one call may write from `start` (a ring must not overwrite what the call still reads)."""
        limits = [lim for rule in self.rules.values() if (lim := rule.call_limit(start)) is not None]
        return min(limits) if limits else None
