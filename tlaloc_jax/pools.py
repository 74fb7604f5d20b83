"""Pool declarations: what a model keeps on the device between calls (tlaloc_jax.stage takes them; the built-in
decoder declares its own with them, tlaloc_jax.decoder.decoder_pools).

Each declaration says the pool's kind and its per-layer geometry; `stage` sizes it (pages or slots) from
the ladders and writes it to the manifest as a `Pool` of that kind. The runtime knows pools by kind only
(tlaloc_jax.artifact.PoolKind), never by name or model. JAX-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from tlaloc_jax import artifact as af


@dataclass(frozen=True)
class PagedKV:
    """Full-history keys and values in pages of block_size positions: [layers, 2, pages, S, kv_heads, head_dim]
    (index 0 of axis 1 holds keys, 1 values). Each sequence holds one page per block of its length; the step
    reads them through BLOCK_TABLES and writes through SLOT_MAPPING (tlaloc_jax.kernels: kv_cache_write,
    paged_attention).

    parts 1 is one entry per position that is both (`PagedKV.latent`): multi-head latent attention's cache
    [layers, 1, pages, S, 1, width], each position's latent and rotated key (tlaloc_jax/kernels/mla.py), paged as above."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    layer_ids: tuple[int, ...] = ()       # which model layers it holds (informative, in the manifest)
    parts: int = 2

    kind = af.PoolKind.PAGED_KV

    @classmethod
    def latent(cls, layers: int, width: int, dtype: str = "float32", layer_ids: tuple[int, ...] = ()) -> "PagedKV":
        """Latent attention's pages: `width` (the latent and the rotated key) per position, no heads."""
        return cls(layers, 1, width, dtype, layer_ids, parts=1)

    def to_pool(self, name: str, capacity: int, block_size: int) -> af.Pool:
        return af.Pool(name=name, kind=self.kind, dtype=self.dtype, capacity=capacity, slot_axis=2,
                       shape=(self.layers, self.parts, capacity, block_size, self.kv_heads, self.head_dim),
                       layers=tuple(self.layer_ids))


@dataclass(frozen=True)
class RingKV:
    """A sliding window's keys and values: the same pages as PagedKV, but each sequence holds a ring of
    ring_pages pages (block b on ring page b % ring_pages), so its memory stops growing past the window. The
    step reads WINDOW_BLOCK_TABLES ([B, R]: the ring) and writes through WINDOW_SLOT_MAPPING; attend with
    `paged_attention(..., window=window, ring=True)`. ring_pages None: the pages a window plus the longest
    call need (tlaloc_jax.serve.core.paging.ring_pages_for)."""

    layers: int
    kv_heads: int
    head_dim: int
    window: int
    dtype: str = "float32"
    ring_pages: int | None = None
    layer_ids: tuple[int, ...] = ()

    kind = af.PoolKind.RING_KV

    def to_pool(self, name: str, capacity: int, block_size: int) -> af.Pool:
        if self.ring_pages is None:
            raise ValueError(f"pool {name!r}: the ring size is resolved by stage before the pool is written")
        return af.Pool(name=name, kind=self.kind, dtype=self.dtype, capacity=capacity, slot_axis=2,
                       shape=(self.layers, 2, capacity, block_size, self.kv_heads, self.head_dim),
                       layers=tuple(self.layer_ids), window=self.window, ring_pages=self.ring_pages)


@dataclass(frozen=True)
class StateSlots:
    """One recurrent state of `shape` per live sequence: [layers, slots, *shape] ([slots, *shape] when layers is
    0). A sequence holds a slot from admission to its end, prompt chunks included; the step reads and writes
    it through STATE_SLOTS (-1: an empty row, which must write nothing). A row whose first position is 0
    must start from zero state, because a freed slot is handed on without clearing.

    shard_axis: staged on a mesh, the axis of `shape` split over the devices (the state of each device's heads);
    None: each device holds the whole state."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    layers: int = 0
    layer_ids: tuple[int, ...] = ()
    shard_axis: int | None = None

    kind = af.PoolKind.STATE_SLOTS

    def to_pool(self, name: str, capacity: int, block_size: int) -> af.Pool:
        return af.Pool(name=name, kind=self.kind, dtype=self.dtype, capacity=capacity,
                       slot_axis=1 if self.layers else 0,
                       shape=((self.layers,) if self.layers else ()) + (capacity, *self.shape),
                       layers=tuple(self.layer_ids))


PoolSpec = PagedKV | RingKV | StateSlots


def per_position(name: str) -> str:
    """The key of the buffer a verify call adds to the pools it gives a step, for state pool `name`: [layers, B, T,
    *shape] ([B, T, *shape] when layers is 0), where the step writes each row's state after each of its tokens (a
    padding token's: the state before it). The call keeps the one after the row's last accepted draft
    (export/_verify.py)."""
    return f"{name}@positions"


def keep_per_position(pools: dict, layer, **states) -> dict:
    """pools with each state pool's per_position buffer given one layer's states after every token ([B, T, ...])."""
    return {**pools, **{per_position(name): pools[per_position(name)].at[layer].set(v) for name, v in states.items()}}
