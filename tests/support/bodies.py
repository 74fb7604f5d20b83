"""Running an artifact's bodies in process (through jax.export.deserialize), arguments built by role."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from tlaloc_jax import artifact as af
from tlaloc_jax.export import flatten_weights
from tlaloc_jax.layout import per_layer


def weights_by_slot(entry: af.Entry, weights: dict) -> dict:
    """In-process (stacked) decoder weights by the entry's slot names: as they are when the artifact kept them
    stacked, else in the per-layer layout the exporter writes (tlaloc_jax.layout)."""
    slots = {sig.slot for sig in entry.inputs if sig.role not in af.STEP_FIELDS and sig.role != af.Role.POOL_IN}
    if slots <= set(weights):
        return weights
    return flatten_weights(per_layer({k: np.asarray(v) for k, v in weights.items()}))[0]


def entry_args(entry: af.Entry, step_inputs: dict, pools: dict, weights: dict) -> list:
    """The entry's arguments in its signature's order: step inputs by role (build_step_inputs' dict), pools by
    name, weights by slot (stacked weights are laid out as the entry's slots name them)."""
    weights = weights_by_slot(entry, weights)
    out = []
    for sig in entry.inputs:
        if sig.role in af.STEP_FIELDS:
            out.append(jnp.asarray(step_inputs[af.STEP_FIELDS[sig.role]]))
        elif sig.role == af.Role.POOL_IN:
            out.append(jnp.asarray(pools[sig.slot]))
        else:
            out.append(jnp.asarray(weights[sig.slot]))
    return out


def run_body(art: Path, entry: af.Entry, args: list) -> dict:
    """Call the entry's jax-serialized body; -> {"logits", "next_token", pool name: updated pool}."""
    # v2/v3 did not record it; v5 writes it when the export asks (exported=True)
    path = Path(art) / (entry.exported or entry.serialized.replace(".mlirbc", ".exported"))
    stat = path.stat()
    outs = _compiled(str(path), stat.st_mtime_ns, stat.st_size)(*args)
    named = {}
    for sig, value in zip(entry.outputs, outs):
        key = sig.slot if sig.role == af.Role.POOL_OUT else {af.Role.LOGITS: "logits",
                                                             af.Role.NEXT_TOKEN: "next_token"}[sig.role]
        named[key] = value
    return named


@functools.lru_cache(maxsize=64)
def _compiled(path: str, mtime_ns: int, size: int):
    """A serialized body deserialized and jitted once per file version: calling a freshly deserialized body
    compiles it again, which made a test looping over calls spend its time compiling."""
    return jax.jit(jax_export.deserialize(bytearray(Path(path).read_bytes())).call)
