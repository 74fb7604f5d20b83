"""tests/support/skip_policy.py: a skipped test fails the run, but for a module another make target runs, and not even
that one where the target sets TLALOC_NO_SKIPS=1."""

from __future__ import annotations

import sys

import pytest

SKIPS = "import pytest\n\ndef test_skips():\n    pytest.skip('no engine here')\n"
PASSES = "def test_passes():\n    assert 1 + 1 == 2\n"


@pytest.fixture
def run(pytester, monkeypatch):
    """(files by module name, no_skips) -> the inner run's result, with the policy plugin as conftest loads it."""
    def go(files: dict[str, str], no_skips: bool = False):
        if no_skips:
            monkeypatch.setenv("TLALOC_NO_SKIPS", "1")
        else:
            monkeypatch.delenv("TLALOC_NO_SKIPS", raising=False)
        for name in files:      # a suite module of that name imported in this worker would clash with the file
            monkeypatch.delitem(sys.modules, name, raising=False)
        pytester.makepyfile(**files)
        return pytester.runpytest_inprocess("-p", "skip_policy", "-p", "no:cacheprovider")
    return go


def test_a_run_that_passes_and_skips_nothing_passes(run):
    result = run({"test_plain": PASSES})
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK


def test_a_skip_fails_the_run_and_is_named(run):
    result = run({"test_plain": PASSES, "test_other": SKIPS})
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*skip_policy: 1 skipped test(s) fail this run*",
                                 "*test_other.py::test_skips: *no engine here*"])


def test_a_module_level_skip_fails_the_run(run):
    module_skip = "import pytest\npytest.skip('nothing', allow_module_level=True)\n"
    result = run({"test_plain": PASSES, "test_other": module_skip})
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*test_other.py: *nothing*"])


def test_a_module_another_target_runs_may_skip_unless_that_target_forbids_it(run):
    files = {"test_plain": PASSES, "test_triton": SKIPS}
    assert run(files).ret == pytest.ExitCode.OK
    # Control: make test-engines sets TLALOC_NO_SKIPS=1, and there the same skip fails the run.
    result = run(files, no_skips=True)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*test_triton.py::test_skips: *no engine here*"])


def test_a_failing_run_keeps_its_own_exit_status(run):
    result = run({"test_plain": "def test_fails():\n    assert False\n", "test_other": SKIPS})
    assert result.ret == pytest.ExitCode.TESTS_FAILED
