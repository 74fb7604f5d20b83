"""A multi-device artifact's mesh (tlaloc-serving-v4 + mesh, docs/multi-device.md) and the checks of every partition
against it: the arrays split over the devices, and how."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ManifestError
from .records import Partition, WeightFile
from .stablehlo import whole_or_split
from .vocabulary import Role


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int


@dataclass(frozen=True)
class Mesh:
    """The devices an artifact's entries run on: one SPMD body per entry, every array either whole on each device or
    split along the mesh axes its partition names, device d holding block d."""

    axes: tuple[MeshAxis, ...]

    @property
    def devices(self) -> int:
        n = 1
        for a in self.axes:
            n *= a.size
        return n

    def shards(self, partition: Partition) -> int:
        """How many blocks an array of this partition is cut into (1: whole on every device)."""
        sizes = {a.name: a.size for a in self.axes}
        n = 1
        for name in partition:
            n *= sizes[name] if name else 1
        return n

    def shard_shape(self, shape: tuple[int, ...], partition: Partition) -> tuple[int, ...]:
        """One device's block of an array of `shape` split as `partition` says."""
        sizes = {a.name: a.size for a in self.axes}
        return tuple(d // sizes[name] if name else d for d, name in zip(shape, partition or (None,) * len(shape)))


def check_partition(mesh: Mesh | None, partition: Partition, shape: tuple[int, ...], what: str) -> None:
    """A partition names a mesh axis for each split dimension, at most once, and each split dimension divides."""
    if not any(partition):
        return
    if mesh is None:
        raise ManifestError(f"{what} is split {list(partition)}, but the manifest has no mesh")
    sizes = {a.name: a.size for a in mesh.axes}
    if len(partition) != len(shape):
        raise ManifestError(f"{what}: partition {list(partition)} does not give each of its {len(shape)} dimensions")
    for d, name in zip(shape, partition):
        if name is None:
            continue
        if name not in sizes:
            raise ManifestError(f"{what} is split along {name!r}, which is not a mesh axis ({', '.join(sizes)})")
        if d % sizes[name]:
            raise ManifestError(f"{what}: dimension {d} does not split into {sizes[name]} blocks along {name!r}")
    named = [n for n in partition if n]
    if len(set(named)) != len(named):
        raise ManifestError(f"{what} is split twice along one mesh axis: {list(partition)}")


def check_mesh(m, slots: dict[str, WeightFile], pools: dict) -> None:
    """The mesh of manifest `m` (one axis: what this runtime serves) and every partition against it: weights and
    pools are taken by every entry as the manifest splits them; step inputs and results other than pools are whole
    on every device; a split weight has one shard file per block, a whole one its file."""
    if m.mesh is not None:
        axes = [a.name for a in m.mesh.axes]
        if len(axes) != 1:
            raise ManifestError(f"mesh has axes {axes}: this runtime serves a mesh of one axis (tensor parallelism)")
        if m.mesh.axes[0].size <= 0:
            raise ManifestError(f"mesh axis {axes[0]!r} size must be positive, got {m.mesh.axes[0].size}")
    for p in m.pools:
        check_partition(m.mesh, p.partition, p.shape, f"pool {p.name!r}")
    for w in m.weights:
        what = f"weight {w.slot!r}"
        check_partition(m.mesh, w.partition, w.shape, what)
        if any(w.partition):
            blocks = m.mesh.shards(w.partition)
            if w.file or len(w.shards) != blocks:
                raise ManifestError(f"{what} is split into {blocks} blocks: it needs {blocks} shard files and no "
                                    f"whole file (it has {len(w.shards)}{' and ' + repr(w.file) if w.file else ''})")
            for s in w.shards:
                if s.nbytes * blocks != w.nbytes:
                    raise ManifestError(f"{what} shard {s.file!r} has {s.nbytes} bytes, 1/{blocks} of {w.nbytes}")
        elif w.shards or not w.file:
            raise ManifestError(f"{what} is whole on every device: it needs one file and no shards")
    for e in m.entries:
        for sig in (*e.inputs, *e.outputs):
            what = f"entry {e.name!r} {sig.label}"
            check_partition(m.mesh, sig.partition, sig.shape, what)
            if sig.role == Role.WEIGHT and sig.slot in slots:
                want = slots[sig.slot].partition
            elif sig.role in (Role.POOL_IN, Role.POOL_OUT) and sig.slot in pools:
                want = pools[sig.slot].partition
            else:
                want = ()
            if whole_or_split(sig.partition) != whole_or_split(want):
                raise ManifestError(f"{what} is split {list(sig.partition)}; the manifest keeps it "
                                    f"{list(want) if any(want) else 'whole'}")
