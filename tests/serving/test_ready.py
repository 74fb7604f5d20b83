"""Issue 59, ready means ready: with compile_all (`python -m tlaloc_jax.serve`'s default) the engine loop compiles
every entry before the server serves. Until then /health answers 503 with how far it got and a generation request
503 (code "not_ready") with Retry-After, as a vLLM server takes no traffic before it is up; once /health answers 200
no entry is left to compile, and the ids are the lazily compiled engine's. Control: without compile_all
(--lazy-compile) /health answers 200 while entries are still to compile, which the ready check tells apart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pypjrt
import pytest

from http_util import InProcess
from tlaloc_jax import artifact as af
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve import readiness as readiness_mod
from tlaloc_jax.serve.readiness import MAX_RETRY_AFTER_S, Readiness
from tlaloc_jax.serve.core.call_plan import covering
from tlaloc_jax.serve.runtime.runner import Runner

PROMPT = [5, 17, 99, 3, 250, 8, 61]


def _held_compile(engine):
    """Hold the engine's first compile of an entry until the returned event is set (the server stays not ready)."""
    release = threading.Event()
    executable = engine.runner.executable

    def held(e):
        if e.name not in engine.runner.executables:
            assert release.wait(60), "the test never released the compile"
        return executable(e)
    engine.runner.executable = held
    return release


def _until_healthy(client, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while (r := client.get("/health")).status_code != 200:
        assert r.status_code == 503 and time.monotonic() < deadline, (r.status_code, r.text)
        time.sleep(0.05)
    return r


def _later_entries(entries) -> list[af.Entry]:
    """The entries a load does not compile (the first of each kind compiles at load, Runner._compile_kinds), less
    the scoring prefills (compiled on first use): their cache files can be missing or damaged and stay to compile.
    Which entry comes first depends on the bodies' hashes, which hold the checkout's paths."""
    first = {}
    for e in entries:
        first.setdefault(e.kind, e)
    return [e for e in entries if first[e.kind] is not e and e.kind != af.EntryKind.PREFILL_SCORED]


def _cache_file(engine, entry) -> Path:
    device = engine.runner.device
    body = engine.runner._body(entry)
    digest = hashlib.sha256(body).hexdigest()
    path = device._cache._path(device._cache.key(digest, device.compile_options_bytes(body)))
    assert path.is_file(), entry.name
    return path


@dataclass(frozen=True)
class Filled:
    """A compile cache holding every entry of the ids artifact: its folder, each entry's file in it, three entries a
    load leaves to compile (their files unshared), and the ids of PROMPT's 6 greedy tokens."""

    path: Path
    files: dict
    later: tuple
    want: list

    def copy(self, dest: Path, drop=()) -> Path:
        """A copy of the cache at dest without the files of the entries `drop`: they are to compile again."""
        shutil.copytree(self.path, dest)
        for name in drop:
            (dest / self.files[name]).unlink()
        return dest


@pytest.fixture(scope="module")
def filled(http_artifacts, tmp_path_factory) -> Filled:
    """Every entry compiled once for the module: each test copies the cache and removes or damages what it checks,
    rather than compiling the artifact from nothing again."""
    path = tmp_path_factory.mktemp("filled-cache")
    with Engine.load(http_artifacts[1], cache_dir=path, progress=False) as engine:
        engine.compile_all()
        want = engine.generate([PROMPT], 6)[0]
        files = {e.name: _cache_file(engine, e).relative_to(path) for e in engine.manifest.entries}
        later = tuple(e.name for e in _later_entries(engine.manifest.entries)[:3])
    assert len(later) == 3 and len({files[n] for n in later}) == 3
    return Filled(path, files, later, want)


def test_health_is_503_until_every_entry_is_compiled(http_artifacts, filled, tmp_path):
    # A cache without three entries a load does not compile: they are still to compile when the server starts.
    cache = filled.copy(tmp_path / "cache", drop=filled.later)
    want = filled.want
    with Engine.load(http_artifacts[1], cache_dir=cache, progress=False) as engine:
        cold = len(engine.entries_to_compile())
        assert cold == len(filled.later)
        release = _held_compile(engine)
        with InProcess(engine, compile_all=True) as srv:
            r = srv.client.get("/health")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["message"] == f"compiling entries: 0/{cold}"
            r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "not_ready"
            assert f"compiling entries: 0/{cold}" in r.json()["error"]["message"]
            assert 1 <= int(r.headers["Retry-After"]) <= MAX_RETRY_AFTER_S
            release.set()
            _until_healthy(srv.client)
            # Ready means ready: nothing is left to compile (the cached entries load on first use or while idle).
            assert engine.entries_to_compile() == []
            assert set(filled.later) <= set(engine.runner.executables)
            r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                             "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want


def test_lazy_compile_answers_health_at_once_with_entries_to_compile(http_artifacts, filled, tmp_path):
    """Control (today's behaviour, --lazy-compile): /health is 200 while entries are still to compile."""
    with Engine.load(http_artifacts[1], cache_dir=filled.copy(tmp_path / "cache", drop=filled.later),
                     progress=False) as engine:
        engine.warm_up = lambda e: None             # the idle warm-up would compile them
        with InProcess(engine) as srv:
            assert srv.client.get("/health").status_code == 200
            assert len(engine.entries_to_compile()) == len(filled.later)
            assert srv.server.loop.readiness is None


def test_a_stop_while_compiling_ends_the_loop_between_entries(http_artifacts, filled, tmp_path):
    """A server stopped while it compiles stops after the entry it is in, not after all of them."""
    with Engine.load(http_artifacts[1], cache_dir=filled.copy(tmp_path / "cache", drop=filled.later),
                     progress=False) as engine:
        cold = len(engine.entries_to_compile())
        release = _held_compile(engine)
        with InProcess(engine, compile_all=True) as srv:
            assert srv.client.get("/health").status_code == 503
            threading.Timer(0.5, release.set).start()       # the stop is queued by then
        loop = srv.server.loop
        assert not loop.alive and loop.readiness.done == 1 < cold
        assert len(engine.entries_to_compile()) == cold - 1


def _count_pjrt(monkeypatch) -> dict[str, int]:
    """Count the plugin's compiles and deserializations (every Device's client) from here on."""
    counts = {"compile": 0, "deserialize_executable": 0}
    for name in counts:
        real = getattr(pypjrt.Client, name)

        def counted(self, *args, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(self, *args, **kw)
        monkeypatch.setattr(pypjrt.Client, name, counted)
    return counts


def test_a_warm_start_compiles_nothing_and_is_ready_at_once(http_artifacts, filled, tmp_path, monkeypatch):
    """With every entry in the compile cache the server is ready before it has loaded any (each loads on first use
    or while idle, like its first run): no compile, no 503. Control: the entries missing from a cache compile before
    /health answers 200."""
    counts = _count_pjrt(monkeypatch)
    with Engine.load(http_artifacts[1], cache_dir=filled.copy(tmp_path / "warm"), progress=False) as engine:
        srv = InProcess(engine, compile_all=True)
        srv.server.loop.warm_up = False                         # nothing loads while idle: on first use only
        with srv:
            r = srv.client.get("/health")
            assert r.status_code == 200, r.text
            assert srv.server.loop.readiness.total == 0 and engine.runner.executables == {}
            r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                             "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == filled.want
        assert counts["compile"] == 0 and counts["deserialize_executable"] == len(engine.runner.executables) > 0
        assert "hit" in engine.compile_report() and set(engine.compile_report()) <= {"hit", "cached"}
    partial = filled.copy(tmp_path / "partial", drop=filled.later)
    with Engine.load(http_artifacts[1], cache_dir=partial, progress=False) as engine:
        assert counts["compile"] == 0                           # the first entry of each kind is in the cache
        with InProcess(engine, compile_all=True) as srv:
            _until_healthy(srv.client)
            assert srv.server.loop.readiness.total == len(filled.later)
            assert set(filled.later) <= set(engine.runner.executables)
        assert counts["compile"] == len(filled.later)


def _held_loads(monkeypatch, held) -> threading.Event:
    """Hold a preloading Runner's background loads of the entries `held(entry)` picks until the event returned is
    set."""
    release = threading.Event()
    load = Runner._load

    def hold(self, e):
        if held(e):
            assert release.wait(60), "the test never released the load"
        return load(self, e)
    monkeypatch.setattr(Runner, "_load", hold)
    return release


def _ready_on_the_largest(monkeypatch, m: af.Manifest) -> dict:
    """Make each kind's largest entry the ones a server waits for (they hold every call of this ladder, checked);
    -> them by kind."""
    largest = {kind: max((e for e in m.entries if e.kind == kind), key=lambda e: e.size_key) for kind in
               {e.kind for e in m.entries}}
    assert all(largest[e.kind].holds(e.batch, e.context, e.tokens_per_seq) for e in m.entries)
    monkeypatch.setattr(sys.modules[Engine.__module__], "covering", lambda entries: list(largest.values()))
    return largest


def _until_loaded(engine, timeout: float = 60.0) -> None:
    """Wait for a preloading engine's background loads to end."""
    deadline = time.monotonic() + timeout
    while engine.runner.still_loading() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.runner.still_loading() == 0


@pytest.mark.parametrize("control", [False, True])
def test_a_warm_start_is_ready_once_the_covering_entries_are_loaded(http_artifacts, filled, tmp_path, monkeypatch,
                                                                     control):
    """A preloading server (`python -m tlaloc_jax.serve` without --lazy-compile) on a filled cache answers /health
    503 until the entries that hold every call (call_plan.covering) have loaded, each from the cache (nothing
    compiles). Control: a loop that does not wait for the loads (the bug) answers 200 with one of them still loading,
    which the check catches. --lazy-compile's side is test_a_warm_start_compiles_nothing_and_is_ready_at_once."""
    counts = _count_pjrt(monkeypatch)
    m = af.load_manifest(http_artifacts[1], verify_weights=False)
    first = [e.name for e in covering(m.entries)]
    release = _held_loads(monkeypatch, lambda e: e.name == first[-1])
    if control:
        monkeypatch.setattr(Runner, "loading", lambda self: [])
    with Engine.load(http_artifacts[1], cache_dir=filled.copy(tmp_path / "warm"), progress=False,
                     preload=True) as engine:
        names = {e.name for e in engine.manifest.entries}
        with InProcess(engine, compile_all=True) as srv:
            if control:
                assert srv.client.get("/health").status_code == 200
                assert not engine.runner.loaded(engine.manifest.entry(first[-1]))   # what the check below refuses
                release.set()
                return
            r = srv.client.get("/health")
            assert r.status_code == 503, r.text
            assert re.fullmatch(rf"loading or compiling entries: \d+/{len(names)}", r.json()["error"]["message"])
            release.set()
            _until_healthy(srv.client)
            assert set(first) <= set(engine.runner.executables) and engine.entries_to_compile() == []
            r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                             "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == filled.want
            _until_loaded(engine)
        assert counts["compile"] == 0 and engine.compile_report() == {"hit": len(names)}


def test_a_server_serves_with_loaded_entries_while_the_others_load(http_artifacts, filled, tmp_path, monkeypatch):
    """Ready once each kind's largest entry is loaded (they hold every call of this ladder), the others held back
    from loading: PROMPT alone, whose smallest entries are held, takes the loaded ones that hold it, padded, with the
    ids it has with every entry loaded; no held entry runs. Control: once the others have loaded, its calls take
    the smallest entries again, which are not the largest."""
    m = af.load_manifest(http_artifacts[1], verify_weights=False)
    largest = _ready_on_the_largest(monkeypatch, m)
    first = {e.name for e in largest.values()}
    release = _held_loads(monkeypatch, lambda e: e.name not in first)
    with Engine.load(http_artifacts[1], cache_dir=filled.copy(tmp_path / "warm"), progress=False,
                     preload=True) as engine:
        with InProcess(engine, compile_all=True) as srv:
            _until_healthy(srv.client)
            assert engine.runner.still_loading() == len(m.entries) - len(first) > 0
            ran = engine.runner.stats["executions_by_entry"]
            for control in (False, True):
                ran.clear()
                r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                 "return_token_ids": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == filled.want
                if not control:
                    assert ran and set(ran) <= first, set(ran) - first
                    release.set()
                    _until_loaded(engine)
                else:
                    assert set(ran) - first


@pytest.mark.parametrize("within", [1e9, 0.0])
def test_a_young_server_waits_for_the_other_entries_too(http_artifacts, filled, tmp_path, monkeypatch, within):
    """While its process is younger than READY_WITHIN_S a server waits for every load, not only the covering ones
    (a small artifact then serves its first requests with every entry loaded); older, it is ready without them.
    A test process is older than 5 s, so READY_WITHIN_S is set: huge (503 until the held load ends), or 0 (200)."""
    monkeypatch.setattr(readiness_mod, "READY_WITHIN_S", within)
    m = af.load_manifest(http_artifacts[1], verify_weights=False)
    largest = _ready_on_the_largest(monkeypatch, m)
    held = next(e.name for e in m.entries if e not in largest.values())
    release = _held_loads(monkeypatch, lambda e: e.name == held)
    with Engine.load(http_artifacts[1], cache_dir=filled.copy(tmp_path / "warm"), progress=False,
                     preload=True) as engine:
        with InProcess(engine, compile_all=True) as srv:
            if within:
                time.sleep(0.5)
                r = srv.client.get("/health")
                assert r.status_code == 503, r.text
                message = r.json()["error"]["message"]
                done = re.fullmatch(rf"loading or compiling entries: (\d+)/{len(m.entries)}", message)
                assert done and len(largest) <= int(done.group(1)) < len(m.entries), r.text
                release.set()
                _until_healthy(srv.client)
                assert engine.runner.loaded(engine.manifest.entry(held))
            else:
                _until_healthy(srv.client)
                assert not engine.runner.loaded(engine.manifest.entry(held))
                release.set()


def test_a_damaged_cache_entry_is_compiled_before_ready(http_artifacts, filled, tmp_path):
    """A cache file that fails its check does not count as compiled: that entry compiles before /health answers 200
    (the others, intact, load on first use)."""
    cache = filled.copy(tmp_path / "cache")
    damaged = cache / filled.files[filled.later[0]]
    damaged.write_bytes(damaged.read_bytes()[:-64] + bytes(64))
    with Engine.load(http_artifacts[1], cache_dir=cache, progress=False) as engine:
        assert len(engine.entries_to_compile()) == 1
        release = _held_compile(engine)
        with InProcess(engine, compile_all=True) as srv:
            assert srv.client.get("/health").json()["error"]["message"] == "compiling entries: 0/1"
            release.set()
            _until_healthy(srv.client)
            assert engine.entries_to_compile() == []


def test_progress_is_a_plain_line_in_a_log(monkeypatch, caplog):
    monkeypatch.setattr(readiness_mod, "LOG_EVERY_S", 0.0)
    ready = Readiness(3, "log")
    assert ready.reason() == "compiling entries: 0/3" and ready.retry_after() == 1
    with caplog.at_level(logging.INFO, logger="tlaloc_jax.serve"):
        ready.start()
        ready.advance("decode_b1_c64")
        assert 1 <= ready.retry_after() <= MAX_RETRY_AFTER_S
        ready.advance("decode_b4_c64")
        ready.advance("prefill_b1_c64")
        ready.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("compiling entries: 1/3 (") for line in lines), lines
    assert any(line.startswith("compiling entries: 2/3 (") for line in lines), lines
    assert re.match(r"ready: 3 entries compiled in [0-9.]+ s$", lines[-2]), lines
    assert re.match(r"start-up: compiling 3 entries [0-9.]+ s; ready [0-9.]+ s after the process started$",
                    lines[-1]), lines
    assert ready.reason() is None and ready._bar is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_logs_its_start_up_in_plain_lines(http_artifacts, filled, tmp_path):
    """`python -m tlaloc_jax.serve` (compile_all by default) with its log in a file: no progress bar's carriage
    returns, the ready line before /health answers 200, and no entry compiled on a first request after it."""
    port = _free_port()
    log_path = tmp_path / "serve.log"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with open(log_path, "wb") as log_file:
        cache = filled.copy(tmp_path / "cache", drop=filled.later)        # three entries to compile
        proc = subprocess.Popen([sys.executable, "-m", "tlaloc_jax.serve", str(http_artifacts[1]), "--port", str(port),
                                 "--cache-dir", str(cache)], stdout=log_file, stderr=log_file, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        deadline = time.monotonic() + 10        # the lines are written just after the last entry counts as ready
        while "start-up: " not in (text := log_path.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "\r" not in text and "entry/s" not in text, text      # no bar's redraws
        # Every entry loads (from the cache) or compiles (the three dropped) before ready.
        assert re.search(r"ready: \d+ entries loaded or compiled in", text), text
        # One line of the start-up's phases (after the ready line, which the phases' line follows at once).
        assert re.search(r"start-up: Python and imports [0-9.]+ s, artifact checked [0-9.]+ s, engine loaded [0-9.]+ s, "
                         r"server set up [0-9.]+ s, loading or compiling \d+ entries [0-9.]+ s; ready [0-9.]+ s after",
                         text), text
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert "compiled" not in log_path.read_text().split("ready: ", 1)[1].split("\n", 1)[1]


@pytest.mark.parametrize("given", ["missing", "file"])
def test_an_artifact_path_that_is_not_a_folder_is_named(tmp_path, capsys, given):
    """Issue 59: a wrong artifact path exits 2 naming it and saying what it is, without a traceback."""
    from tlaloc_jax.serve.__main__ import main as serve_main
    path = tmp_path / "no-such-artifact"
    if given == "file":
        path.write_text("{}")
    for cache in ("none", str(tmp_path / "cache")):
        assert serve_main([str(path), "--cache-dir", cache, "--port", str(_free_port())]) == 2
        err = capsys.readouterr().err
        what = "is a file, not a directory" if given == "file" else "does not exist"
        assert err.startswith(f"error: {path}: {what}; give the artifact directory that python -m tlaloc_jax.export"), err
        assert "Traceback" not in err
