"""An artifact's arrays on the devices of a mesh (docs/multi-device.md): what the runner holds per argument.

On one device an argument is a `Buffer`, as always. On N devices (a manifest with a mesh) it is a tuple of N
buffers, device d's at index d: its d-th block along the dimension its partition names, or, whole on every
device, a copy of it. A weight split over the devices is read from its shard files, each device's alone; step
inputs are whole on every device; results other than the pools are whole too, and are read from device 0.
"""

from __future__ import annotations

import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np

from tlaloc_jax import artifact as af

from .handles import Buffer, Executable
from .pjrt import Device

Placed = Buffer | tuple[Buffer, ...]
HUGE_PAGE = 2 << 20
#: Threads reading the weight files at load.
READ_THREADS = min(2, os.cpu_count() or 1)


def device_count_mismatch(m: af.Manifest, devices: int) -> str:
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


def zeros(device: Device, dtype: str, shape: tuple[int, ...], partition: af.Partition, mesh: af.Mesh | None) -> Placed:
    """A zeroed array of `shape` split as `partition` says: each device's block (a pool), adopted where the device
    can (the CPU plugin): its pages are zeroed by the OS when first written, not all at load."""
    block = shape if device.devices == 1 else mesh.shard_shape(shape, partition)
    return _on_each(device, lambda d: device.adopt(host_zeros(block, af.numpy_dtype(dtype)), d))


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


def host_arena(sizes: Sequence[int]) -> list[np.ndarray]:
    """Byte arrays of `sizes`, each starting on a page, cut in order from one private anonymous mapping that starts on
    a 2 MiB boundary and is marked for huge pages: arrays read into it lie wholly in huge pages, where a mapping of
    each array's own would leave its unaligned ends (and a 2.25 MiB weight almost all of it) in 4 KiB pages."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
    if not end:
        return [np.zeros(n, np.uint8) for n in sizes]
    memory = mmap.mmap(-1, -(-end // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(memory, np.uint8)
    skip = -whole.ctypes.data % HUGE_PAGE      # the pages before the boundary are never touched
    return [whole[skip + o:skip + o + n] for o, n in zip(offsets, sizes)]


def _nbytes(w: af.WeightFile, shape: tuple[int, ...]) -> int:
    """The bytes of weight w's array of `shape` (the whole weight's, or a shard's)."""
    return int(np.prod(shape, dtype=np.int64)) * af.numpy_dtype(w.dtype).itemsize


def _read(path: Path, w: af.WeightFile, shape: tuple[int, ...], into: np.ndarray | None) -> np.ndarray:
    """A weight file's array: read with one call into `into` (its bytes, from host_arena), or, with no `into`, the
    file mapped read-only (on the CPU plugin, that mapping is the weight's device memory)."""
    dtype = af.numpy_dtype(w.dtype).newbyteorder("<")
    nbytes = _nbytes(w, shape)
    if not nbytes:
        return np.zeros(shape, dtype)
    if into is None:
        return np.memmap(path, dtype=dtype, mode="r", shape=shape)
    with open(path, "rb") as f:
        got = f.readinto(memoryview(into))
    if got != nbytes:
        raise af.ManifestError(f"weight file {path} holds {got} bytes where {w.slot} {list(shape)} {w.dtype} takes "
                               f"{nbytes}")
    return into.view(dtype).reshape(shape)


def upload_weights(device: Device, root: Path, weights: Sequence[af.WeightFile],
                   mesh: af.Mesh | None, arena: bool = True) -> dict[str, Placed]:
    """The weights from their files, by slot: each onto every device, or, split, device d's shard from shard file d.
    On a device whose memory is host memory, each is adopted (no copy by the plugin), and every array of 2 MiB or
    more is read into one host_arena where the kernel offers huge pages: a decode step reads every weight, and 4 KiB
    pages cost it a page walk every 4 KiB (per-weight mappings: the 100M Llama's batch-1 step 1.06x faster on the
    Sapphire Rapids; one arena for them all: about 1% more, docs/cpu.md). Smaller ones stay their files' mappings.
    arena=False: every weight is its file's mapping, read-only (no fresh memory: a load in well under a second where
    the files are in the page cache, and no second copy of them, on a host short of free memory)."""
    return adopt_weights(device, weights, read_weights(root, weights, mesh, arena and device.host_memory))


def arena_pays(weights: Sequence[af.WeightFile], mesh: af.Mesh | None) -> bool:
    """Whether upload_weights' arena would hold any of these weights (one of 2 MiB or more, huge pages offered)."""
    return huge_pages_offered() and any(_nbytes(w, shape) >= HUGE_PAGE for w, _, shape in _weight_files(
        Path(), weights, mesh))


def _weight_files(root: Path, weights: Sequence[af.WeightFile], mesh: af.Mesh | None):
    """(weight, file, shape) of each array: a whole weight, or each shard of a split one."""
    files = []
    for w in weights:
        if w.shards:
            files += [(w, root / s.file, mesh.shard_shape(w.shape, w.partition)) for s in w.shards]
        else:
            files.append((w, root / w.file, w.shape))
    return files


def read_weights(root: Path, weights: Sequence[af.WeightFile], mesh: af.Mesh | None,
                 arena: bool, stopped=lambda: False) -> list[np.ndarray]:
    """Each weight file's array, in order (upload_weights): those of 2 MiB or more read into one host_arena where
    `arena` and the kernel offers huge pages, the others their files' read-only mappings. stopped(): checked before
    each file (true: RuntimeError)."""
    files = _weight_files(root, weights, mesh)
    sizes = [_nbytes(w, shape) for w, _, shape in files]
    huge = arena and huge_pages_offered()
    read_in = [huge and n >= HUGE_PAGE for n in sizes]
    cut = iter(host_arena([n for n, r in zip(sizes, read_in) if r]))
    jobs = [(path, w, shape, next(cut) if r else None) for (w, path, shape), r in zip(files, read_in)]
    # Reads in threads (readinto releases the GIL): the fresh memory's page faults, and the reclaim a host short of
    # free memory does in them, run on more than one CPU. map keeps the files' order.
    with ThreadPoolExecutor(READ_THREADS) as pool:
        return list(pool.map(lambda job: _read(*job) if not stopped() else _stop(), jobs))


def _stop():
    raise RuntimeError("reading the weights was stopped")


def adopt_weights(device: Device, weights: Sequence[af.WeightFile], arrays: Sequence[np.ndarray]) -> dict[str, Placed]:
    """read_weights' arrays as the weights' buffers, by slot (a split weight's shards one a device)."""
    arrays = iter(arrays)
    placed: dict[str, Placed] = {}
    for w in weights:
        if w.shards:
            placed[w.slot] = tuple(device.adopt(next(arrays), d) for d in range(len(w.shards)))
        else:
            array = next(arrays)
            placed[w.slot] = _on_each(device, lambda d: device.adopt(array, d))
    return placed


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


def bytes_per_device(m: af.Manifest) -> tuple[int, int]:
    """(weight bytes, pool bytes) one device holds: a split array's block, a whole one entire."""
    def share(nbytes: int, partition: af.Partition) -> int:
        return nbytes // m.mesh.shards(partition) if m.mesh and any(partition) else nbytes
    return (sum(share(w.nbytes, w.partition) for w in m.weights), sum(share(p.nbytes, p.partition) for p in m.pools))
