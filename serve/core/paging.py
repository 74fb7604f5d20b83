"""Host-side paging: how many units a pool kind gives a sequence, and the integer inputs of a call. JAX-free.

The runtime's scheduler, the in-process Model and the exporter (ring sizes) all read these, so a block table or a
slot mapping has one definition; the units themselves are kv_cache.UnitPool's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tlaloc_jax import artifact as af


def pages_for(length: int, block_size: int) -> int:
    """Pages that hold `length` positions."""
    return -(-length // block_size)


@dataclass(frozen=True)
class RowCall:
    """One sequence's part of a call: its new tokens, the position of the first, the pages it holds, (with a
    windowed pool) its ring of windowed pages, and (with linear-attention layers) its slot in the state
    pools, held for the sequence's life (-1: none; a row with tokens needs one)."""

    token_ids: Sequence[int]
    start: int
    pages: Sequence[int] | None     # None: the model keeps no full-history pages (every layer windowed)
    ring: Sequence[int] = ()
    state_slot: int = -1


def ring_pages_for(window: int, longest_call: int, block_size: int, max_pages: int) -> int:
    """Ring size: the pages that hold a window plus the longest call, capped at a whole context's pages."""
    return min(pages_for(window - 1 + longest_call, block_size), max_pages)


def ring_call_limit(start: int, window: int, ring_pages: int, block_size: int) -> int:
    """The most tokens one call may write from position `start` without overwriting a position that a
    token of the call still sees: ringPages * blockSize - min(start, window - 1)."""
    return ring_pages * block_size - min(start, window - 1)


def build_step_inputs(rows: Sequence[RowCall], *, batch: int, tokens: int, width: int,
                      block_size: int, ring_pages: int = 0, state_slots: bool = False) -> dict[str, np.ndarray]:
    """The integer inputs of one call (docs/glossary.md roles), rows right-aligned, unused rows empty.

    batch B, tokens T, width M (block-table entries). Returns int32 arrays keyed by the StepInputs field
    names: token_ids [B, T], positions [B, T], block_tables [B, M], seq_lens [B], slot_mapping [B, T];
    with ring_pages R > 0 also window_block_tables [B, M] (entry b: ring page b % R) and
    window_slot_mapping [B, T]; with state_slots also state_slots [B] (each row's RowCall.state_slot, -1
    for unused rows).
    """
    if len(rows) > batch:
        raise ValueError(f"{len(rows)} sequences do not fit a call of batch {batch}")
    token_ids = np.zeros((batch, tokens), np.int32)
    positions = np.full((batch, tokens), -1, np.int32)
    slots = np.full((batch, tokens), -1, np.int32)
    tables = np.zeros((batch, width), np.int32)
    seq_lens = np.zeros((batch,), np.int32)
    wtables = np.zeros((batch, width), np.int32)
    wslots = np.full((batch, tokens), -1, np.int32)
    sslots = np.full((batch,), -1, np.int32)
    for b, row in enumerate(rows):
        n = len(row.token_ids)
        if n > tokens:
            raise ValueError(f"row {b} has {n} tokens, the call takes {tokens}")
        end = row.start + n
        if pages_for(end, block_size) > width:
            raise ValueError(f"row {b} reaches position {end - 1}, past the call's context of {width * block_size}")
        pos = np.arange(row.start, end, dtype=np.int64)
        if state_slots:
            if n and row.state_slot < 0:
                raise ValueError(f"row {b} has {n} tokens but no state slot")
            sslots[b] = row.state_slot
        token_ids[b, tokens - n:] = row.token_ids
        positions[b, tokens - n:] = pos
        seq_lens[b] = end
        if row.pages is not None:
            if pages_for(end, block_size) > len(row.pages):
                raise ValueError(f"row {b} reaches position {end - 1} but holds {len(row.pages)} pages of {block_size}")
            # A sequence may hold pages past this call's context (reserved for later tokens): the call's
            # block table names only the first `width`.
            pages = np.asarray(row.pages[:width], np.int64)
            slots[b, tokens - n:] = pages[pos // block_size] * block_size + pos % block_size
            tables[b, :len(pages)] = pages
        if ring_pages:
            ring = np.asarray(row.ring, np.int64)
            if len(ring) < min(ring_pages, pages_for(end, block_size)):
                raise ValueError(f"row {b} reaches position {end - 1} but its ring holds {len(ring)} pages")
            if len(ring):
                # Entries past the ring's pages are never written for this row; repeating a ring page keeps
                # them in range (they are masked by position).
                wtables[b] = ring[np.minimum(np.arange(width) % ring_pages, len(ring) - 1)]
                wslots[b, tokens - n:] = ring[(pos // block_size) % ring_pages] * block_size + pos % block_size
    out = dict(token_ids=token_ids, positions=positions, block_tables=tables, seq_lens=seq_lens,
               slot_mapping=slots)
    if ring_pages:
        out.update(window_block_tables=wtables, window_slot_mapping=wslots)
    if state_slots:
        out.update(state_slots=sslots)
    return out


# The per-token fields of build_step_inputs, which a packed prefill takes flat ([1, N]); the rest stay per row.
PACKED_FIELDS = tuple(af.STEP_FIELDS[role] for role in af.PACKED_TOKEN_INPUTS)


def pack_step_inputs(inputs: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """build_step_inputs' [B, T] inputs as a packed prefill takes them: the rows' tokens side by side in flat
    per-token fields [1, n] (row by row, padding after them: position -1, no slot), and pack_index [B, T], each
    row position's index in them (n where the row has no token)."""
    live = inputs["positions"] >= 0
    count = int(live.sum())
    if count > n:
        raise ValueError(f"{count} tokens do not fit a packed call of {n}")
    pack_index = np.full(live.shape, n, np.int32)
    pack_index[live] = np.arange(count, dtype=np.int32)
    out = {k: v for k, v in inputs.items() if k not in PACKED_FIELDS}
    for k in PACKED_FIELDS:
        if k in inputs:
            flat = np.full((1, n), 0 if k == "token_ids" else -1, np.int32)
            flat[0, :count] = inputs[k][live]
            out[k] = flat
    out["pack_index"] = pack_index
    return out


# -- what a sequence holds of each kind of pool --------------------------------------------------------
# One rule per manifest PoolKind: how many units (pages, or state slots) a sequence of a given length holds,
# and the most tokens one call may write from a position. The runtime's scheduler asks these rules and
# never names a kind; a new kind of pool is a new rule here (and its step inputs in build_step_inputs).


@dataclass(frozen=True)
class PagedRule:
    """paged_kv: one page per block of the sequence's length."""

    block_size: int

    def units(self, length: int) -> int:
        return pages_for(length, self.block_size)

    def call_limit(self, start: int) -> int | None:
        return None


@dataclass(frozen=True)
class RingRule:
    """ring_kv: at most the ring's pages, whatever the length; a call must not overwrite a position that one
    of its own tokens still sees."""

    block_size: int
    window: int
    ring_pages: int

    def units(self, length: int) -> int:
        return min(pages_for(length, self.block_size), self.ring_pages)

    def call_limit(self, start: int) -> int | None:
        return ring_call_limit(start, self.window, self.ring_pages, self.block_size)


@dataclass(frozen=True)
class SlotRule:
    """state_slots: one slot for the sequence's life."""

    def units(self, length: int) -> int:
        return 1 if length > 0 else 0

    def call_limit(self, start: int) -> int | None:
        return None


def pool_rule(pool: af.Pool, block_size: int) -> PagedRule | RingRule | SlotRule:
    """The rule of a manifest pool's kind."""
    if pool.kind == af.PoolKind.PAGED_KV:
        return PagedRule(block_size)
    if pool.kind == af.PoolKind.RING_KV:
        return RingRule(block_size, pool.window, pool.ring_pages)
    if pool.kind == af.PoolKind.STATE_SLOTS:
        return SlotRule()
    raise ValueError(f"pool {pool.name!r} has kind {pool.kind!r}, for which this runtime has no rule")


def row_call(token_ids: Sequence[int], start: int, held: dict[af.PoolKind, list[int]]) -> RowCall:
    """A sequence's part of a call, from what it holds of each kind of pool (absent kinds: none)."""
    slots = held.get(af.PoolKind.STATE_SLOTS)
    return RowCall(token_ids, start, held.get(af.PoolKind.PAGED_KV), held.get(af.PoolKind.RING_KV, ()),
                   slots[0] if slots else -1)
