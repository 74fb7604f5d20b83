"""tests/support/time_breakdown.py (`make test-time`): the table charges each file's exports and compiles to that file."""

from __future__ import annotations

import re
from pathlib import Path

EXPORTS = """
import jax, jax.numpy as jnp

def test_exports_and_compiles():
    jax.export.export(jax.jit(lambda x: jnp.tanh(x) * 2))(jax.ShapeDtypeStruct((4, 8), jnp.float32))
    jax.jit(lambda x: x @ x.T)(jnp.ones((8, 8))).block_until_ready()
"""
PLAIN = "def test_plain():\n    assert sum(range(4)) == 6\n"


def _row(lines: list[str], name: str) -> dict[str, float]:
    header = next(line.split()[1:] for line in lines if line.startswith("file "))
    pattern = rf"{re.escape(name)}(\s+\d+\.\d+){{{len(header)}}}"      # the table's row, not a progress line
    row = next(line.split() for line in lines if re.fullmatch(pattern, line))
    return dict(zip(header, map(float, row[1:])))


def test_exports_and_compiles_are_charged_to_their_file(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent / "support"))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    pytester.makepyfile(test_exports=EXPORTS, test_plain=PLAIN)
    result = pytester.runpytest_subprocess("-p", "time_breakdown", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    lines = result.stdout.lines
    exports, plain = _row(lines, "test_exports.py"), _row(lines, "test_plain.py")
    assert exports["export"] > 0 and exports["trace"] + exports["lower"] > 0 and exports["xla_compile"] > 0
    assert exports["total"] >= exports["export"]
    # Control: the file that exports and compiles nothing is charged nothing but its own time.
    assert all(v == 0 for k, v in plain.items() if k != "total")
    assert abs(_row(lines, "all")["total"] - exports["total"] - plain["total"]) <= 0.02    # printed to 0.01 s
