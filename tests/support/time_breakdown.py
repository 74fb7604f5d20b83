"""Where the suite's time goes (TLALOC_TIME_BREAKDOWN=1, which `make test-time` sets): per test file, the time its
tests took and how much of it was jax.export, JAX's tracing, lowering and XLA compiles (jax.monitoring's events),
the runtime's PJRT compiles and loads from its cache (Device.compile), and waits on subprocesses. pytest-xdist's
workers hand their sums to the controller, which prints one table (the run's sums, then the TLALOC_TIME_ROWS
slowest files, 30 by default). Times overlap (an export traces and lowers), so the columns do not add up."""

from __future__ import annotations

import collections
import functools
import os
import time

import pytest

COLUMNS = ("total", "export", "trace", "lower", "xla_compile", "pjrt_compile", "pjrt_cached", "subprocess")
_JAX_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
               "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
               "/jax/core/compile/backend_compile_duration": "xla_compile"}
_TIMES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_CURRENT = ["(outside tests)"]
_INSIDE: collections.Counter = collections.Counter()   # nested calls of one kind count once


def _charge(column: str, seconds: float) -> None:
    _TIMES[_CURRENT[0].split("::")[0]][column] += seconds


def _timed(column, f):
    @functools.wraps(f)
    def timed(*args, **kwargs):
        if _INSIDE[column]:
            return f(*args, **kwargs)
        _INSIDE[column] += 1
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            _INSIDE[column] -= 1
            _charge(column, time.perf_counter() - t0)
    return timed


def _pjrt_compile(compile_):
    @functools.wraps(compile_)
    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        exe = compile_(self, *args, **kwargs)
        _charge("pjrt_cached" if exe.cache == "hit" else "pjrt_compile", time.perf_counter() - t0)
        return exe
    return timed


def pytest_configure(config):
    import subprocess

    import jax.export
    import jax.monitoring

    from tlaloc_jax.serve.runtime import pjrt

    export = jax.export.export
    jax.export.export = functools.wraps(export)(lambda *a, **k: _timed("export", export(*a, **k)))
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: _charge(_JAX_EVENTS[event], seconds) if event in _JAX_EVENTS else None)
    pjrt.Device.compile = _pjrt_compile(pjrt.Device.compile)
    subprocess.Popen.wait = _timed("subprocess", subprocess.Popen.wait)
    subprocess.Popen.communicate = _timed("subprocess", subprocess.Popen.communicate)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _CURRENT[0] = item.nodeid
    t0 = time.perf_counter()
    yield
    _charge("total", time.perf_counter() - t0)
    _CURRENT[0] = "(outside tests)"


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)
    if out is not None:                    # a pytest-xdist worker: hand the sums to the controller
        out["time_breakdown"] = {f: dict(c) for f, c in _TIMES.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for f, c in getattr(node, "workeroutput", {}).get("time_breakdown", {}).items():
        _TIMES[f].update(c)


def pytest_terminal_summary(terminalreporter):
    if not _TIMES:
        return
    rows = sorted(_TIMES.items(), key=lambda kv: -kv[1]["total"])
    sums = sum((c for _, c in rows), collections.Counter())
    write = terminalreporter.write_line
    terminalreporter.section("time breakdown (seconds, summed over workers; columns overlap)")
    write(f"{'file':44s}" + "".join(f"{c:>13s}" for c in COLUMNS))
    for f, c in [("all", sums)] + rows[:int(os.environ.get("TLALOC_TIME_ROWS", "30"))]:
        write(f"{f.removeprefix('tests/'):44.44s}" + "".join(f"{c[k]:13.2f}" for k in COLUMNS))
