"""The tests of this folder need no model: they, tests/conftest.py that pytest loads for them, and the modules they
test import no JAX (tlaloc_jax.export would), so `make test-fast` starts no compiler or PJRT client. Checked in a
subprocess under the serving path's import guard (tests/support/import_guard.py); control: the same subprocess fails on an
import of the export package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from import_guard import guarded

UNIT = Path(__file__).resolve().parent
MODULES = sorted(p.stem for p in UNIT.glob("test_*.py") if p.stem != "test_model_free")


def _imports(extra: str = "") -> subprocess.CompletedProcess:
    script = guarded(f"sys.path[:0] = [{str(UNIT)!r}, {str(UNIT.parent)!r}]\n"
                     f"import conftest, {', '.join(MODULES)}\n{extra}")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_the_unit_tests_import_no_jax():
    assert MODULES, "no test modules found beside this one"
    r = _imports()
    assert r.returncode == 0, r.stderr[-3000:]
    control = _imports("import tlaloc_jax.export")
    assert control.returncode != 0 and "the serving path imported jax" in control.stderr, control.stderr[-3000:]
