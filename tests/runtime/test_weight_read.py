"""Issue 59, warm start: the weight files are read at load by several threads (sharded.upload_weights), each into its
run of the huge-page arena. Every weight then holds its own file's bytes, in its own slot; the control hands the
reads back out of order (a pool that gives results as they finish) and the check catches it. Without the arena
(--map-weights) every weight is its own file's mapping, nothing read in."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tlaloc_jax import artifact as af
from tlaloc_jax.serve.runtime import Device, sharded


@pytest.fixture(scope="module")
def dev():
    with Device() as d:
        yield d


@pytest.fixture
def weights(tmp_path):
    """(folder, weight files, their values): arena-sized and small ones, each of values no other holds."""
    sizes = [1 << 20, 600_000, 1024, 700_001, 5, 1 << 19, 589_825, 3000]
    values = {f"w{i}": np.arange(n, dtype=np.float32) + 1e6 * i for i, n in enumerate(sizes)}
    for name, v in values.items():
        (tmp_path / f"{name}.bin").write_bytes(v.tobytes())
    files = [af.WeightFile(name, "float32", v.shape, v.nbytes, file=f"{name}.bin") for name, v in values.items()]
    return tmp_path, files, values


def _wrong_slots(dev, placed, values) -> list[str]:
    return [name for name, v in values.items() if not np.array_equal(dev.to_host(placed[name]), v)]


def test_weights_read_in_threads_hold_their_own_files_bytes(dev, weights, monkeypatch):
    root, files, values = weights
    threads = set()
    real = sharded._read

    def noted(*args):
        threads.add(threading.get_ident())
        return real(*args)
    monkeypatch.setattr(sharded, "_read", noted)
    monkeypatch.setattr(sharded, "READ_THREADS", 2)
    placed = sharded.upload_weights(dev, root, files, None)
    assert list(placed) == list(values)
    assert _wrong_slots(dev, placed, values) == []
    assert len(threads) == 2 and threading.get_ident() not in threads


def test_control_reads_handed_back_out_of_order_are_caught(dev, weights, monkeypatch):
    root, files, values = weights

    class Unordered(sharded.ThreadPoolExecutor):
        def map(self, fn, *its):
            return reversed(list(super().map(fn, *its)))
    monkeypatch.setattr(sharded, "ThreadPoolExecutor", Unordered)
    placed = sharded.upload_weights(dev, root, files, None)
    assert sorted(_wrong_slots(dev, placed, values)) == sorted(values)


def test_without_the_arena_every_weight_is_its_files_mapping(dev, weights, monkeypatch):
    root, files, values = weights
    monkeypatch.setattr(sharded, "huge_pages_offered", lambda: True)     # where the arena would take the large ones
    for arena in (False, True):
        before = len(dev._adopted)
        placed = sharded.upload_weights(dev, root, files, None, arena=arena)
        assert _wrong_slots(dev, placed, values) == []
        mapped = [a for a in dev._adopted[before:] if isinstance(a.base, np.memmap)]   # adopt took np.asarray
        big = sum(v.nbytes >= sharded.HUGE_PAGE for v in values.values())
        # Control (arena=True): the weights of 2 MiB or more are read into fresh memory, not their files' mappings.
        assert len(mapped) == len(values) - (big if arena else 0) and big > 0
        assert all(not a.flags.writeable for a in mapped)
