"""Issue 59, compiles in worker processes (serve/runtime/compile_workers.py): the export's compile-cache/ filled by
two processes has the one-process fill's index and serves as it does, every entry shipped; a server whose caches
miss compiles those entries in workers into its compile cache, then loads them as hits, and its next start is all
hits; a worker that fails leaves its entry to compile in the server's own process. Control: workers that report
different facts fail the fill, naming the fact, and write no index.
"""

from __future__ import annotations

import logging
import re
import shutil

import pytest

from http_util import InProcess
from step_spy import count_compiles
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.runtime import compile_workers, shipped_cache

PROMPT = [5, 17, 99, 3, 250, 8, 61]


@pytest.fixture(scope="module")
def want(http_artifacts, serve_cache_dir):
    """The ids an engine that compiled in process gives."""
    with Engine.load(http_artifacts[1], cache_dir=serve_cache_dir, progress=False) as engine:
        return engine.generate([PROMPT], 6)[0]


@pytest.fixture
def started(monkeypatch):
    """Two cores whatever the host has, and the Workers each start made (their facts, pids), in a list."""
    monkeypatch.setattr(compile_workers, "cores", lambda: 2)
    made = []
    real = compile_workers.start

    def start(*args, **kw):
        made.append(real(*args, **kw))
        return made[-1]
    monkeypatch.setattr(compile_workers, "start", start)
    return made


def _index(art) -> str:
    return (art / shipped_cache.FOLDER / shipped_cache.INDEX).read_text()


def _files(folder) -> set[str]:
    return {p.name for p in folder.glob("*.pypjrta")}


def test_a_fill_in_two_processes_ships_what_one_process_does(http_artifacts, want, started, tmp_path, monkeypatch):
    one, two = tmp_path / "one", tmp_path / "two"
    for art in (one, two):
        shutil.copytree(http_artifacts[1], art)
    n, _ = shipped_cache.fill(one, processes=1)
    assert shipped_cache.fill(two, processes=2)[0] == n > 2
    assert [len(w.facts) for w in started] == [1, 2] and started[1].facts[0]["pid"] != started[1].facts[1]["pid"]
    assert _index(two) == _index(one)
    assert _files(two / shipped_cache.FOLDER) == _files(one / shipped_cache.FOLDER)
    assert len(_files(one / shipped_cache.FOLDER)) == n
    counts = count_compiles(monkeypatch)
    with Engine.load(two, cache_dir=tmp_path / "empty", progress=False) as engine:
        engine.compile_all()
        how = {name: exe.cache for name, exe in engine.runner.executables.items()}
        assert set(how.values()) == {"shipped"} and len(how) == n
        assert engine.generate([PROMPT], 6)[0] == want
    assert counts["compile"] == 0


def test_control_workers_that_report_different_facts_fail_the_fill(http_artifacts, started, tmp_path, monkeypatch):
    art = tmp_path / "art"
    shutil.copytree(http_artifacts[1], art)
    real = compile_workers.start

    def start(*args, **kw):
        work = real(*args, **kw)
        wait = work.wait

        def waited():               # the second worker says it loaded another native kernel variant
            wait()
            work.facts[1]["facts"]["kernels"] = {"some_kernel": "another variant"}
        work.wait = waited
        return work
    monkeypatch.setattr(compile_workers, "start", start)
    with pytest.raises(compile_workers.WorkerError, match=r"report different kernels"):
        shipped_cache.fill(art, processes=2)
    assert not (art / shipped_cache.FOLDER / shipped_cache.INDEX).exists()


def _until_healthy(srv, seen: set[str]) -> None:
    while (r := srv.client.get("/health")).status_code != 200:
        assert r.status_code == 503, r.text
        seen.add(r.json()["error"]["message"])


def test_a_server_compiles_its_cache_misses_in_workers(http_artifacts, want, started, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    counts = count_compiles(monkeypatch)
    with Engine.load(http_artifacts[1], cache_dir=cache, progress=False, preload=True) as engine:
        names = {e.name for e in engine.manifest.entries}
        assert len(started) == 1 and len(started[0].done) == len(names) and len(started[0].facts) <= 2
        with InProcess(engine, compile_all=True) as srv:
            seen: set[str] = set()
            _until_healthy(srv, seen)
            assert all(re.fullmatch(rf"loading or compiling entries: \d+/{len(names)}", m) for m in seen), seen
            assert engine.compile_report() == {"hit": len(names)}
            r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                             "return_token_ids": True})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
    assert counts["compile"] == 0 and len(_files(cache)) == len(names)
    assert len({w["pid"] for w in started[0].facts}) == 2
    with Engine.load(http_artifacts[1], cache_dir=cache, progress=False, preload=True) as engine:
        for e in engine.manifest.entries:
            engine.runner.executable(e)
        assert engine.compile_report() == {"hit": len(names)}
    assert len(started) == 1 and counts["compile"] == 0         # no worker started: nothing missed


def test_an_entry_whose_worker_fails_compiles_in_the_server(http_artifacts, want, started, tmp_path, monkeypatch,
                                                             caplog):
    real = compile_workers.start
    broken = {}

    bad = tmp_path / "bad.mlirbc"
    bad.write_bytes(b"not a StableHLO body")

    def start(entries, *args, **kw):          # the worker is given another body for the first entry, which it refuses
        broken["name"] = entries[0][0]
        return real([(entries[0][0], str(bad)), *entries[1:]], *args, **kw)
    monkeypatch.setattr(compile_workers, "start", start)
    counts = count_compiles(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tlaloc_jax.serve"):
        with Engine.load(http_artifacts[1], cache_dir=tmp_path / "cache", progress=False, preload=True) as engine:
            for e, _ in engine.runner.loading():
                engine.runner.executable(e)
            how = {name: exe.cache for name, exe in engine.runner.executables.items()}
            assert engine.generate([PROMPT], 6)[0] == want
    assert how.pop(broken["name"]) == "miss" and set(how.values()) == {"hit"} and counts["compile"] == 1
    lines = [r.getMessage() for r in caplog.records if "in a worker failed" in r.getMessage()]
    assert len(lines) == 1 and broken["name"] in lines[0] and "compiling it here" in lines[0], lines


def test_a_server_closed_while_its_workers_compile_stops_them(http_artifacts, started, tmp_path, monkeypatch):
    """A server stopped during its start kills its compile workers and compiles nothing in its own process."""
    counts = count_compiles(monkeypatch)
    engine = Engine.load(http_artifacts[1], cache_dir=tmp_path / "cache", progress=False, preload=True)
    engine.close()
    assert len(started) == 1 and all(p.poll() is not None for p in started[0].procs)
    assert all(f.done() for f in started[0].done.values()) and counts["compile"] == 0
