"""A run that skipped a test fails: a skip hides whatever the test would have found. The one exception is a module
whose tests need an environment another make target builds (RUN_ELSEWHERE), and that exception is off where the
target that runs them sets TLALOC_NO_SKIPS=1 (`make test-engines`, `make test-vllm`, `make test-serve-env`). Loaded by
conftest.py."""

from __future__ import annotations

import os
from pathlib import PurePosixPath

import pytest

# Modules whose environment another target builds and runs them in: Triton and Ray Serve (`make test-engines`),
# vLLM (`make test-vllm`), the serving install without JAX (`make test-serve-env`).
RUN_ELSEWHERE = frozenset({"test_triton.py", "test_ray_serve.py", "test_vllm.py", "test_serve_env.py"})


def refused_skips(reports, strict: bool) -> list[str]:
    """The skip reports that fail the run, each as "nodeid: reason"."""
    out = []
    for rep in reports:
        module = PurePosixPath(rep.nodeid.split("::")[0]).name
        if not strict and module in RUN_ELSEWHERE:
            continue
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        out.append(f"{rep.nodeid}: {reason}")
    return out


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """On the process that reports (pytest-xdist's controller, not its workers): a refused skip fails the run."""
    if hasattr(session.config, "workerinput"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    refused = refused_skips(reporter.stats.get("skipped", []), os.environ.get("TLALOC_NO_SKIPS") == "1")
    if not refused:
        return
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporter.ensure_newline()
    reporter.write_line(f"skip_policy: {len(refused)} skipped test(s) fail this run (tests/support/skip_policy.py):", red=True)
    for line in refused:
        reporter.write_line(f"  {line}", red=True)
