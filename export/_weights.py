"""A weights pytree as the artifact's weight slots: one name per leaf, joined from its path."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from tlaloc_jax import artifact as af

from ._entries import ExportError
from ._lazy import LazyWeight, as_lazy

def key_name(k) -> str:
    """One key of a pytree path as a slot name's part."""
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def path_name(path) -> str:
    """A pytree path as a slot name: its keys joined with "."."""
    return ".".join(key_name(k) for k in path)


def flatten_weights(weights: Any) -> tuple[dict[str, np.ndarray | LazyWeight], Any]:
    """A weights pytree (a dict of named arrays, nested dicts, a flax.nnx State) -> ({slot name: array}, treedef).
    A lazy leaf (export/_lazy.py: shape, dtype and load(), or a zero-argument loader) stays a LazyWeight, read
    when its file is written.

    Slot names join the path's keys with "." (an nnx Variable's trailing `.value` dropped); they name the
    artifact's weight files, so they keep to letters, digits, "_", "." and "-"."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(weights)
    out: dict[str, np.ndarray] = {}
    for path, leaf in leaves:
        keys = list(path)
        if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
            keys = keys[:-1]
        name = path_name(keys) or "weight"
        if not af.NAME.match(name):
            raise ExportError(f"weight {name!r}: a slot name keeps to letters, digits, '_', '.' and '-'")
        if name in out:
            raise ExportError(f"two weights flatten to the slot name {name!r}")
        arr = as_lazy(name, leaf)
        arr = np.asarray(leaf) if arr is None else arr
        if arr.dtype.name not in af.DTYPES:
            raise ExportError(f"weight {name!r} has dtype {arr.dtype.name}, which an artifact cannot hold "
                              f"(known: {', '.join(af.DTYPES)})")
        out[name] = arr
    if not out:
        raise ExportError("the weights pytree has no arrays")
    return out, treedef
