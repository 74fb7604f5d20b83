"""Issue 59, warm start: a preloading Runner (a server without --lazy-compile) serves the weights from their files'
mappings at once and reads them into the huge-page arena in the background once its entries have loaded (the arena's
page faults held up the loads: the Qwen3-0.6B shape's first load waited 5.5 s for them); between two runs the weights
then serve from the arena. Where each weight's buffer lies is read from /proc/self/maps: a weight file's mapping
before, anonymous memory after (each check fails on the other state). The ids are the same in both."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tlaloc_jax import artifact as af
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.runtime import sharded

PROMPT = [5, 17, 99, 3, 250, 8, 61]
SMALL_HUGE_PAGE = 16 << 10      # the test artifact's weights are KBs: arena-sized from 16 KiB here


def _mapped_file(address: int) -> str:
    """The file mapped at `address` in this process ("" for anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5].strip() if len(fields) == 6 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def _homes(engine, slots) -> dict[str, str]:
    runner = engine.runner
    return {s: _mapped_file(runner.device.device_address(runner.weights[s])) for s in slots}


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc/self/maps (Linux)")
def test_weights_move_to_the_arena_between_runs_once_the_entries_have_loaded(http_artifacts, tmp_path, monkeypatch):
    monkeypatch.setattr(sharded, "HUGE_PAGE", SMALL_HUGE_PAGE)
    monkeypatch.setattr(sharded, "huge_pages_offered", lambda: True)
    art = http_artifacts[1]
    m = af.load_manifest(art, verify_weights=False)
    big = {w.slot: w.file for w in m.weights if w.nbytes >= SMALL_HUGE_PAGE}
    assert big
    release = threading.Event()
    read = sharded.read_weights

    def held(*args, **kw):      # the background read alone (the loader's thread), not the mappings' at load
        if threading.current_thread().name.startswith("tlaloc-load"):
            assert release.wait(60), "the test never released the read"
        return read(*args, **kw)
    monkeypatch.setattr(sharded, "read_weights", held)
    with Engine.load(art, cache_dir=tmp_path / "cache", progress=False, preload=True) as engine:
        want = engine.generate([PROMPT], 6)[0]
        homes = _homes(engine, big)
        assert all(homes[s].endswith(f"/{f}") for s, f in big.items()), homes      # the files' mappings
        release.set()
        deadline = time.monotonic() + 60
        while engine.runner._arena is not None and not engine.runner._arena.done() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.generate([PROMPT], 6)[0] == want
        assert set(_homes(engine, big).values()) == {""}                              # the arena
