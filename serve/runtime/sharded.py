"""An artifact's arrays on the devices of a mesh (docs/multi-device.md): what the runner holds per argument.

On one device an argument is a `Buffer`, as always. On N devices (a manifest with a mesh) it is a tuple of N
buffers, device d's at index d: its d-th block along the dimension its partition names, or, whole on every
device, a copy of it. A weight split over the devices is read from its shard files, each device's alone; step
inputs are whole on every device; results other than the pools are whole too, and are read from device 0.
"""

from __future__ import annotations

import functools
import mmap
from pathlib import Path
from typing import Sequence

import numpy as np

from tlaloc_jax import artifact as mf

from .handles import Buffer, Executable
from .pjrt import Device

Placed = Buffer | tuple[Buffer, ...]
HUGE_PAGE = 2 << 20


def device_count_mismatch(m: mf.Manifest, devices: int) -> str:
    """Why an artifact cannot run on a client of `devices` devices (its mesh asks for another count)."""
    mesh = ", ".join(f"{a.name}={a.size}" for a in m.mesh.axes) if m.mesh else "none"
    return (f"the artifact runs on {m.devices} device(s) (mesh {mesh}); the client has {devices}: nothing was "
            "compiled or allocated")


def _on_each(device: Device, place) -> Placed:
    """place(d) for every device d: one Buffer on one device, else a tuple."""
    placed = tuple(place(d) for d in range(device.devices))
    return placed[0] if device.devices == 1 else placed


def upload_whole(device: Device, array: np.ndarray) -> Placed:
    """The array on every device (one Buffer on one device)."""
    return _on_each(device, lambda d: device.upload(array, d))


def zeros(device: Device, dtype: str, shape: tuple[int, ...], partition: mf.Partition, mesh: mf.Mesh | None) -> Placed:
    """A zeroed array of `shape` split as `partition` says: each device's block (a pool), adopted where the device
    can (the CPU plugin): its pages are zeroed by the OS when first written, not all at load."""
    block = shape if device.devices == 1 else mesh.shard_shape(shape, partition)
    return _on_each(device, lambda d: device.adopt(host_zeros(block, mf.numpy_dtype(dtype)), d))


def host_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros in fresh private anonymous memory (page-aligned, no page touched yet), in huge pages where the kernel
    offers them on request (transparent_hugepage 'madvise'): a pool's first writes then fault 2 MiB at a time. (A
    shared anonymous mapping, Python's mmap default, is shmem, which takes huge pages only by shmem_enabled.)"""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if not nbytes:
        return np.zeros(shape, dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, dtype).reshape(shape)


@functools.cache
def huge_pages_offered() -> bool:
    """Whether the kernel backs memory marked MADV_HUGEPAGE with 2 MiB pages (transparent_hugepage 'always' or
    'madvise'; not 'never', nor a system without the setting)."""
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def _read(path: Path, w: mf.WeightFile, shape: tuple[int, ...], host_memory: bool) -> np.ndarray:
    """A weight file's array. For a device whose memory is host memory, in private memory marked for huge pages where
    the kernel offers them (read with one call, not faulted in 4 KiB at a time through a mapping): a decode step
    reads every weight, and a mapped file's 4 KiB pages cost it a page walk every 4 KiB (the 100M Llama's batch-1
    step 1.06x faster on the Sapphire Rapids). Else, and for a weight under one huge page, the file mapped
    read-only (on the CPU plugin, that mapping is the weight's device memory)."""
    dtype = mf.numpy_dtype(w.dtype).newbyteorder("<")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not nbytes:
        return np.zeros(shape, dtype)
    if not (host_memory and nbytes >= HUGE_PAGE and huge_pages_offered()):
        return np.memmap(path, dtype=dtype, mode="r", shape=shape)
    array = host_zeros(shape, dtype)
    with open(path, "rb") as f:
        got = f.readinto(memoryview(array.reshape(-1).view(np.uint8)))
    if got != nbytes:
        raise mf.ManifestError(f"weight file {path} holds {got} bytes where {w.slot} {list(shape)} {w.dtype} takes "
                               f"{nbytes}")
    return array


def upload_weight(device: Device, root: Path, w: mf.WeightFile, mesh: mf.Mesh | None) -> Placed:
    """A weight from its file onto every device, or, split, device d's shard from shard file d: on a device whose
    memory is host memory, adopted (no copy by the plugin), in huge pages where the kernel offers them (_read)."""
    if not w.shards:
        array = _read(root / w.file, w, w.shape, device.host_memory)
        return _on_each(device, lambda d: device.adopt(array, d))
    shape = mesh.shard_shape(w.shape, w.partition)
    return tuple(device.adopt(_read(root / s.file, w, shape, device.host_memory), d) for d, s in enumerate(w.shards))


def execute(device: Device, exe: Executable, args: Sequence[Placed], donate: set[int],
            keep: set[int]) -> list[Placed | None]:
    """One execution on all the devices; each result as its arguments are held (a tuple per result on N)."""
    if device.devices == 1:
        return device.execute(exe, args, donate=donate, keep=keep)
    n = device.devices
    per_device = device.execute_sharded(exe, [[a[d] for a in args] for d in range(n)], donate=donate, keep=keep)
    return [None if per_device[0][j] is None else tuple(per_device[d][j] for d in range(n))
            for j in range(len(per_device[0]))]


def address(device: Device, placed: Placed) -> int | tuple[int, ...]:
    """The device address of each of its buffers (equal before and after a run: updated in place)."""
    if isinstance(placed, tuple):
        return tuple(device.device_address(b) for b in placed)
    return device.device_address(placed)


def first(placed: Placed) -> Buffer:
    """Device 0's buffer: a whole result's copy (every device computes the same)."""
    return placed[0] if isinstance(placed, tuple) else placed


def close(placed: Placed) -> None:
    for b in placed if isinstance(placed, tuple) else (placed,):
        b.close()


def bytes_per_device(m: mf.Manifest) -> tuple[int, int]:
    """(weight bytes, pool bytes) one device holds: a split array's block, a whole one entire."""
    def share(nbytes: int, partition: mf.Partition) -> int:
        return nbytes // m.mesh.shards(partition) if m.mesh and any(partition) else nbytes
    return (sum(share(w.nbytes, w.partition) for w in m.weights), sum(share(p.nbytes, p.partition) for p in m.pools))
