"""docs/cli.md is the reference of both commands, and the docs' commands still parse.

Each option `python -m tlaloc_jax.export --help` and `python -m tlaloc_jax.serve --help` print is named in that
command's section of docs/cli.md, and each option that section names is one the command takes. Every command
line of README.md and docs/cli.md that runs one of the two uses only options it takes. Controls: an option
missing from the page, and a page naming an option the command lacks, are each reported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI_DOC = ROOT / "docs" / "cli.md"
COMMANDS = ("tlaloc_jax.export", "tlaloc_jax.serve")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@pytest.fixture(scope="module")
def options() -> dict[str, set[str]]:
    """The options each command's --help lists."""
    found = {}
    for cmd in COMMANDS:
        r = subprocess.run([sys.executable, "-m", cmd, "--help"], capture_output=True, text=True, timeout=300,
                           cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        found[cmd] = set(OPTION.findall(r.stdout)) - {"--help"}
    return found


def sections(text: str) -> dict[str, str]:
    """docs/cli.md's text under each `## ` heading that names one of the commands, less the lines that run the
    other command (the serve section's example exports first)."""
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {cmd: "\n".join(line for line in part.splitlines() if command_lines(line) in ([], [(cmd, line)]))
            for part in parts for cmd in COMMANDS if f"python -m {cmd}`" in part.split("\n", 1)[0]}


def mismatches(options: dict[str, set[str]], text: str) -> list[str]:
    """What docs/cli.md (text) leaves out of a command's options, or names that the command lacks."""
    by_command = sections(text)
    out = []
    for cmd, opts in options.items():
        named = set(OPTION.findall(by_command.get(cmd, "")))
        out += [f"{cmd}: {o} is not in docs/cli.md" for o in sorted(opts - named)]
        out += [f"{cmd}: docs/cli.md names {o}, which it does not take" for o in sorted(named - opts)]
    return out


def command_lines(text: str) -> list[tuple[str, str]]:
    """(command, line) for each line of text that runs `python -m tlaloc_jax.export|serve`."""
    return [(m.group(1), line) for line in text.splitlines()
            if (m := re.search(r"python -m (tlaloc_jax\.(?:export|serve))\s", line))]


def test_cli_reference_names_every_option_of_both_commands(options):
    assert mismatches(options, CLI_DOC.read_text(encoding="utf-8")) == []


def test_cli_reference_check_reports_a_missing_and_a_stale_option(options):
    """Control: the check finds an option the page leaves out, and one it names that the command lacks."""
    text = CLI_DOC.read_text(encoding="utf-8").replace("--max-waiting", "--max-waits")
    assert set(mismatches(options, text)) == {
        "tlaloc_jax.serve: --max-waiting is not in docs/cli.md",
        "tlaloc_jax.serve: docs/cli.md names --max-waits, which it does not take"}


def test_the_docs_command_lines_use_options_the_commands_take(options):
    lines = [cl for doc in ("README.md", "docs/cli.md") for cl in command_lines((ROOT / doc).read_text("utf-8"))]
    assert {cmd for cmd, _ in lines} == set(COMMANDS)
    unknown = [(line, o) for cmd, line in lines for o in OPTION.findall(line) if o not in options[cmd]]
    assert unknown == []
    planted = command_lines("python -m tlaloc_jax.serve artifact/ --no-such-flag 1\n")    # control
    assert [o for cmd, line in planted for o in OPTION.findall(line) if o not in options[cmd]] == ["--no-such-flag"]
