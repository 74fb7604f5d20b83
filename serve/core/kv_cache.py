"""The units of each pool kind (KV pages, ring pages, state slots) and the prefix cache over them.

`UnitPool` is one kind's units: reference counts, a free queue in least-recently-used order, and the cached
units by block hash. A unit whose count falls to zero goes to the back of the free queue and stays findable by
its hash until it is taken again (then its hash is forgotten): full KV pages of finished or preempted
sequences, and state snapshots, are reused until the space is needed.

`extend_hashes` chains the hashes of a sequence's full pages: page i's hash covers the artifact, the request's
cache_salt (if any), every token before the page and the page's own tokens, so equal hashes mean equal prefixes
of requests with the same salt.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np


class UnitPool:
    """The P units of one kind of pool: who holds them and which hold cached content."""

    def __init__(self, num_units: int, name: str = "pool", unit: str = "pages"):
        if num_units <= 0:
            raise ValueError(f"pool {name!r} needs at least one unit, got {num_units}")
        self.num_units = num_units
        self.name = name
        self.unit = unit
        self._refs = [0] * num_units
        self._free: OrderedDict[int, None] = OrderedDict((u, None) for u in range(num_units))   # front: taken first
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}

    @property
    def free_units(self) -> int:
        """Units no sequence holds (cached ones included: they are given up when needed)."""
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.num_units - len(self._free)

    @property
    def cached_units(self) -> int:
        return len(self._hash_of)

    def take(self, n: int) -> list[int] | None:
        """n units for a sequence, least recently used first (their cached content forgotten), or None with nothing
        taken when fewer than n are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            u, _ = self._free.popitem(last=False)
            self._forget(u)
            self._refs[u] = 1
            out.append(u)
        return out

    def share(self, u: int) -> None:
        """One more holder of a (cached) unit."""
        if self._refs[u] == 0:
            del self._free[u]
        self._refs[u] += 1

    def release(self, units: Sequence[int]) -> None:
        """Drop one hold on each unit; a unit no longer held goes to the back of the free queue. Release a sequence's
        units last page first, so that the pages deep in a prefix are given up before the ones they follow."""
        for u in units:
            if self._refs[u] <= 0:
                raise ValueError(f"{self.unit[:-1]} {u} of pool {self.name!r} is not held")
            self._refs[u] -= 1
            if self._refs[u] == 0:
                self._free[u] = None

    def cache(self, u: int, h: bytes) -> None:
        """Record that unit u holds the content of block hash h (the first unit recorded for a hash keeps it)."""
        if h in self._by_hash or u in self._hash_of:
            return
        self._by_hash[h] = u
        self._hash_of[u] = h

    def lookup(self, h: bytes) -> int | None:
        return self._by_hash.get(h)

    def touch(self, u: int) -> None:
        """Mark a free cached unit as just used (it moves to the back of the queue)."""
        if self._refs[u] == 0:
            self._free.move_to_end(u)

    def _forget(self, u: int) -> None:
        h = self._hash_of.pop(u, None)
        if h is not None:
            del self._by_hash[h]

    def holders(self, u: int) -> int:
        return self._refs[u]


def artifact_seed(identity: str) -> bytes:
    """The root of every hash chain: an artifact's identity (its manifest's digest)."""
    return hashlib.blake2b(identity.encode(), digest_size=16).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a full page: its parent's hash (the whole prefix before it) and its own token ids."""
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


def salted_root(root: bytes, salt: str | None) -> bytes:
    """The parent of a request's first page: the artifact's root, mixed with the request's cache_salt when it has
    one (vLLM's way: the salt enters the first page's hash, hence every later one), so that its pages and state
    snapshots match only those of requests with the same salt."""
    if salt is None:
        return root
    return hashlib.blake2b(root + salt.encode("utf-8", "surrogatepass"), digest_size=16,
                           person=b"cache_salt").digest()


def extend_hashes(hashes: list[bytes], tokens: Sequence[int], block_size: int, root: bytes,
                  salt: str | None = None) -> None:
    """Append to `hashes` the hash of each full page of `tokens` it does not have yet (salt: the request's
    cache_salt, mixed into the first page's)."""
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else salted_root(root, salt)
        hashes.append(block_hash(parent, tokens[i * block_size:(i + 1) * block_size]))
