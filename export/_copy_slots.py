"""The copy_slots entry: copy state slots within every state pool, so the runtime never computes on a pool.

The runtime keeps recurrent states for prefix caching by copying a sequence's slot into a spare one at a
page-aligned prompt position (a snapshot), and a snapshot into a new sequence's slot (a restore). One call
copies up to N pairs, src[i] -> dst[i] in every state pool alike; a pair with a negative index is skipped.
Destinations are distinct and never a source of the same call (the runtime's snapshots and restores are).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlaloc_jax import artifact as af

from ._entries import check_body, export_fn
from ._files import write_body
from ._mesh import mesh_size, sharded

Role = af.Role


def copy_slots_signature(pools: Sequence[af.Pool], batch: int
                         ) -> tuple[list[af.TensorSig], list[af.TensorSig], tuple[tuple[int, int], ...]]:
    """(inputs, outputs, donations): COPY_SRC and COPY_DST [N], then each state pool in and out, donated."""
    inputs = [af.TensorSig(Role.COPY_SRC, "int32", (batch,)), af.TensorSig(Role.COPY_DST, "int32", (batch,))]
    outputs, donations = [], []
    for p in pools:
        if p.kind == af.PoolKind.STATE_SLOTS:
            donations.append((len(outputs), len(inputs)))
            inputs.append(af.TensorSig(Role.POOL_IN, p.dtype, p.shape, p.name, p.partition))
            outputs.append(af.TensorSig(Role.POOL_OUT, p.dtype, p.shape, p.name, p.partition))
    return inputs, outputs, tuple(donations)


def copy_slots_fn(pools: Sequence[af.Pool]):
    """The entry over (src, dst, *state pools) -> the state pools with dst[i] holding what src[i] held."""
    state = [p for p in pools if p.kind == af.PoolKind.STATE_SLOTS]

    def entry(src, dst, *bufs):
        out = []
        for p, buf in zip(state, bufs):
            rows = jnp.take(buf, jnp.clip(src, 0, p.capacity - 1), axis=p.slot_axis)
            # A skipped pair writes out of range, which the scatter drops.
            where = jnp.where((src >= 0) & (dst >= 0), dst, p.capacity)
            index = (slice(None),) * p.slot_axis + (where,)
            out.append(buf.at[index].set(rows, mode="drop"))
        return tuple(out)
    return entry


def copy_slots_entry(out: Path, pools: Sequence[af.Pool], batch: int, platform: str, mesh=None,
                     files: Mapping[str, bool] | None = None) -> af.Entry:
    """The entry that copies state slots (the runtime's state snapshots for prefix caching), `batch` pairs a call;
    on a mesh, each device copies within its blocks of the state pools."""
    name = f"copy_slots_n{batch}"
    inputs, outputs, donations = copy_slots_signature(pools, batch)
    fn, out_shardings = copy_slots_fn(pools), None
    avals = [jax.ShapeDtypeStruct(s.shape, jnp.dtype(af.numpy_dtype(s.dtype))) for s in inputs]
    if mesh is not None:
        fn, avals, out_shardings = sharded(fn, inputs, outputs, mesh)
    exp = export_fn(fn, avals, platform=platform, donate=tuple(i for _, i in donations), out_shardings=out_shardings)
    check_body(name, exp, inputs, outputs, donations, platform, mesh_size(mesh))
    return af.Entry(name=name, kind=af.EntryKind.COPY_SLOTS, batch=batch, context=0, tokens_per_seq=0,
                    **dataclasses.asdict(write_body(out, exp, **(files or {}))), inputs=tuple(inputs),
                    outputs=tuple(outputs), donations=donations, kept_inputs=tuple(exp.module_kept_var_idx))


def copy_slots_reference(buf: np.ndarray, src: Sequence[int], dst: Sequence[int], slot_axis: int) -> np.ndarray:
    """The same copy as a loop over the pairs (numpy)."""
    out = np.array(buf)
    moved = np.moveaxis(out, slot_axis, 0)
    original = np.moveaxis(np.asarray(buf), slot_axis, 0)
    for s, d in zip(src, dst):
        if s >= 0 and d >= 0:
            moved[d] = original[s]
    return out
