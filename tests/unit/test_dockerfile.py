"""The Dockerfile's serving stage keeps the container recipe's promises (no Docker daemon here to build it; the
conditions it sets are reproduced by tests/runtime/test_native_variants.py): a slim base, no compiler installed, the
serving install without JAX, a non-root user, a HEALTHCHECK on /health, and a command the server's parser takes."""

from __future__ import annotations

import re
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def stages(text: str) -> list[str]:
    """The Dockerfile's stages, each its lines (continuations joined), comments dropped."""
    lines = re.sub(r"\\\n\s*", " ", text).splitlines()
    out: list[list[str]] = []
    for line in (x.strip() for x in lines):
        if line.startswith("FROM "):
            out.append([])
        if line and not line.startswith("#") and out:
            out[-1].append(line)
    return ["\n".join(s) for s in out]


def serving_stage_faults(text: str) -> list[str]:
    final = stages(text)[-1]
    faults = []
    if not re.match(r"FROM python:3\.\d+-slim\b", final):
        faults.append("the serving stage is not a slim Python base")
    if re.search(r"\b(gcc|clang|build-essential|cc)\b", final.split("\n", 1)[1]):
        faults.append("the serving stage installs a compiler")
    if re.search(r"\bjax(lib)?\b|\[(export|serve)", final.replace("lammps-jax-pjrt-cpu", "")):
        faults.append("the serving stage installs JAX (or an extra that pulls it)")
    if "--no-deps lammps-jax-pjrt-cpu" not in final:
        faults.append("the CPU plugin is not installed without the jax its metadata names")
    user = re.search(r"^USER (\S+)", final, re.MULTILINE)
    if not user or user[1] in ("root", "0"):
        faults.append("the server runs as root")
    if not re.search(r"^HEALTHCHECK .*?/health", final, re.MULTILINE):
        faults.append("no HEALTHCHECK on /health")
    return faults


def test_the_serving_stage_keeps_the_recipe():
    assert serving_stage_faults(DOCKERFILE.read_text()) == []


def test_the_check_finds_a_compiler_root_and_jax():
    """Controls: a serving stage with a compiler, run as root, installing the export extra fails each check."""
    bad = DOCKERFILE.read_text().replace("USER tlaloc", "USER root").replace(
        "RUN pip install --no-cache-dir /wheels/tlaloc_jax-*.whl", "RUN apt-get install -y gcc && pip install "
        "--no-cache-dir '/wheels/tlaloc_jax-0.1.0.whl[export]'")
    assert serving_stage_faults(bad) == ["the serving stage installs a compiler",
                                         "the serving stage installs JAX (or an extra that pulls it)",
                                         "the server runs as root"]


def test_its_command_is_one_the_server_takes():
    """The ENTRYPOINT runs the server with options its --help lists."""
    import json
    import subprocess
    import sys

    entry = re.search(r"^ENTRYPOINT (\[.*\])$", stages(DOCKERFILE.read_text())[-1], re.MULTILINE)
    argv = json.loads(entry[1])
    assert argv[:3] == ["python", "-m", "tlaloc_jax.serve"]
    usage = subprocess.run([sys.executable, "-m", "tlaloc_jax.serve", "--help"], capture_output=True, text=True,
                           check=True).stdout
    options = [a for a in argv[3:] if a.startswith("--")]
    assert options and [o for o in options if not re.search(rf"^\s+{o}\b", usage, re.MULTILINE)] == []
