"""Weights read when they are written: a staged body needs only their shapes and dtypes, so a weight can stay on
disk (or uncomputed) until its file is written, and the export's memory is one weight's, not the model's."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import numpy as np

from ._entries import ExportError


@dataclasses.dataclass(frozen=True, eq=False)
class LazyWeight:
    """A weight leaf known by its shape and dtype; load() gives its values (a host array of that shape and dtype).

    parts: for a weight written in pieces (a stacked slot a layer at a time), a function yielding its values as
    consecutive blocks along axis 0 instead; load() then joins them. Not a pytree node: a leaf, which tracing
    replaces by an abstract value of its shape and dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype
    loader: Callable[[], np.ndarray] | None = None
    parts: Callable[[], Iterator[np.ndarray]] | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if (self.loader is None) == (self.parts is None):
            raise ValueError("a LazyWeight takes a loader or parts, one of the two")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def load(self) -> np.ndarray:
        if self.loader is None:
            return np.concatenate(list(self.parts()))
        return self.loader()

    def blocks(self, slot: str) -> Iterator[np.ndarray]:
        """The values as contiguous blocks along axis 0 (one block unless given in parts), each checked against
        the declared dtype and shape: a loader that returns something else is refused by the slot's name."""
        rows = 0
        for block in (self.parts() if self.parts is not None else (self.loader(),)):
            block = np.asarray(block)
            if block.dtype != self.dtype or block.shape[1:] != self.shape[1:] or block.ndim != self.ndim:
                raise ExportError(f"weight {slot!r}: its loader returned {block.dtype.name}{list(block.shape)}, "
                                  f"declared {self.dtype.name}{list(self.shape)}; return what the weight declares")
            rows += block.shape[0] if block.ndim else 1
            yield np.ascontiguousarray(block)
        if rows != (self.shape[0] if self.shape else 1):
            raise ExportError(f"weight {slot!r}: its loader gave {rows} rows, declared {list(self.shape)}")


def is_lazy(leaf) -> bool:
    """A leaf read when written: a LazyWeight, or any object with shape, dtype and load() (the duck type that
    an author's own weights may take)."""
    return isinstance(leaf, LazyWeight) or all(hasattr(leaf, a) for a in ("shape", "dtype", "load"))


def as_lazy(name: str, leaf) -> LazyWeight | None:
    """A lazy leaf as a LazyWeight: one with shape, dtype and load(), or a zero-argument loader (called once here to
    learn its shape and dtype, its values dropped: give shape and dtype to spare that read); None for an array."""
    if isinstance(leaf, LazyWeight):
        return leaf
    if is_lazy(leaf):
        return LazyWeight(tuple(leaf.shape), np.dtype(leaf.dtype), loader=leaf.load)
    if callable(leaf) and not hasattr(leaf, "shape"):
        probe = np.asarray(leaf())
        return LazyWeight(probe.shape, probe.dtype, loader=leaf)
    return None
