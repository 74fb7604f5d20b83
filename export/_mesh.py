"""Staging on a mesh: an entry's function run by `jax.shard_map` over a 1-D mesh, exported as one SPMD body.

Every argument and result has a split axis (the axis of its global array that is cut into N equal, contiguous
shards, one per device) or none (each device holds the whole array). The step runs on each device's shards
and says itself where the devices' values meet (`lax.psum` over the mesh axis), so the body's collectives are
exactly the ones the model wrote: nothing is left for a partitioner to infer. The mesh is abstract (a size
and an axis name): exporting for N devices needs neither N devices nor an accelerator.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from tlaloc_jax import artifact as af
from tlaloc_jax.pools import PagedKV, PoolSpec, RingKV, StateSlots
from tlaloc_jax.sharding import TP_AXIS, split_axis

from ._entries import ExportError


def abstract_mesh(mesh) -> AbstractMesh | None:
    """The 1-D abstract mesh of `mesh`: an int N (axis "tp"), a jax Mesh or AbstractMesh of one axis; None, 1:
    no mesh (one device)."""
    if mesh is None:
        return None
    if isinstance(mesh, int):
        if mesh < 1:
            raise ExportError(f"a mesh needs at least one device, got {mesh}")
        return None if mesh == 1 else AbstractMesh((mesh,), (TP_AXIS,), axis_types=(AxisType.Explicit,))
    abstract = getattr(mesh, "abstract_mesh", mesh)
    if not isinstance(abstract, AbstractMesh):
        raise ExportError(f"mesh must be a device count, a jax.sharding.Mesh or an AbstractMesh, got "
                          f"{type(mesh).__name__}")
    if len(abstract.axis_names) != 1:
        raise ExportError(f"staging splits over one mesh axis (tensor parallelism); the mesh has axes "
                          f"{dict(zip(abstract.axis_names, abstract.axis_sizes))}")
    return AbstractMesh(tuple(abstract.axis_sizes), tuple(abstract.axis_names), axis_types=(AxisType.Explicit,))


def mesh_size(mesh: AbstractMesh | None) -> int:
    return 1 if mesh is None else int(mesh.axis_sizes[0])


def pool_split_axis(spec: PoolSpec) -> int | None:
    """A declared pool's split axis in its buffer: KV pools [L, 2, P, S, K, D] over K; a state pool over the axis
    of its per-slot shape its declaration names (`StateSlots.shard_axis`), or none (each device a whole copy)."""
    if isinstance(spec, StateSlots):
        if spec.shard_axis is None:
            return None
        return (1 if spec.layers else 0) + 1 + spec.shard_axis
    return 4 if isinstance(spec, (PagedKV, RingKV)) else None


def weight_split_axes(weights: Mapping[str, object], flatten: Callable) -> dict[str, int | None]:
    """{flat slot: split axis} of the built-in decoder's weights (tlaloc_jax.sharding's table), as `flatten`
    (stage's flatten_weights) names their arrays."""
    out = {}
    for slot, w in weights.items():
        first = w[0] if isinstance(w, (tuple, list)) else w
        axis = split_axis(slot, first)
        out.update({name: axis for name in flatten({slot: w})[0]})
    return out


def partition_of(ndim: int, axis: int | None, mesh: AbstractMesh | None) -> af.Partition:
    """The manifest partition of an array of ndim dimensions split along `axis` (None: whole, ())."""
    if axis is None or mesh is None:
        return ()
    if not -ndim <= axis < ndim:
        raise ExportError(f"split axis {axis} of a {ndim}-d array")
    dims: list[str | None] = [None] * ndim
    dims[axis % ndim] = mesh.axis_names[0]
    return tuple(dims)


def check_splits(sigs: Sequence[af.TensorSig], mesh: AbstractMesh) -> None:
    """Refuse, by name, an argument whose split dimension does not divide into the mesh's devices."""
    n = mesh_size(mesh)
    for sig in sigs:
        for d, name in zip(sig.shape, sig.partition):
            if name and d % n:
                raise ExportError(f"{sig.slot or sig.role}: dimension {d} of {list(sig.shape)} does not split into "
                                  f"{n} equal shards")


def sharded(fn: Callable, inputs: Sequence[af.TensorSig], outputs: Sequence[af.TensorSig], mesh: AbstractMesh):
    """(fn run by shard_map over the mesh, the arguments' avals carrying their shardings, the results' shardings),
    each argument and result split as its partition says."""
    check_splits(inputs, mesh)
    check_splits(outputs, mesh)
    in_specs = tuple(PartitionSpec(*s.partition) for s in inputs)
    out_specs = tuple(PartitionSpec(*s.partition) for s in outputs)
    # check_vma=False: jax's replication typing would make every loop whose carry starts whole and turns per-device
    # (the experts' and the gated delta rule's) cast its carry; the step's own psums say where devices meet.
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    avals = [jax.ShapeDtypeStruct(s.shape, af.numpy_dtype(s.dtype), sharding=NamedSharding(mesh, p))
             for s, p in zip(inputs, in_specs)]
    return mapped, avals, tuple(NamedSharding(mesh, p) for p in out_specs)


COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "collective_permute",
               "collective_broadcast")
_COLLECTIVE = re.compile(r"stablehlo\.(" + "|".join(COLLECTIVES) + r")\b")


def collective_counts(mlir_text: str) -> dict[str, int]:
    """How many of each cross-device op (COLLECTIVES) a body's StableHLO text holds."""
    found = _COLLECTIVE.findall(mlir_text)
    return {op: found.count(op) for op in COLLECTIVES}
