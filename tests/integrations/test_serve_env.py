"""Issue 59, a serving install without JAX: .venv-serve (`make serve-env`: `pip install -e .`, whose dependencies are
the runtime's, then the CPU plugin with --no-deps) has no JAX, and `python -m tlaloc_jax.serve` there serves the demo
artifact (exported here, in the project's environment) with the greedy ids `Engine` gives in this one.
`make test-serve-env` builds the environment and runs this module ($TLALOC_SERVE_PYTHON names another)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from process_util import wait_ready
from tlaloc_jax.serve import Engine
from tlaloc_jax.tools.demo import export_demo, free_port

ROOT = Path(__file__).resolve().parents[2]
SERVE_PYTHON = Path(os.environ.get("TLALOC_SERVE_PYTHON", ROOT / ".venv-serve" / "bin" / "python"))
if not SERVE_PYTHON.exists():
    pytest.skip(f"no serving environment at {SERVE_PYTHON} (`make serve-env` builds .venv-serve; $TLALOC_SERVE_PYTHON "
                "names another)", allow_module_level=True)

pytestmark = pytest.mark.slow        # an export and a server start: `make test-serve-env` runs it

PROMPT = [1, 414, 1028, 25, 2341, 11]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SERVE_PYTHON), *args], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def test_there_is_no_jax_and_pip_finds_only_the_plugins_named_jax():
    for module in ("jax", "jaxlib", "flax"):
        r = _run("-c", f"import {module}")
        assert r.returncode != 0 and f"No module named '{module}'" in r.stderr, (module, r.stderr[-500:])
    r = _run("-c", "import tlaloc_jax.serve, tlaloc_jax.serve.openai.app, sys; "
                   "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')]")
    assert r.returncode == 0, r.stderr[-2000:]
    # The project's own requirements are met; what pip still reports is the CPU plugin's metadata naming jax.
    r = _run("-m", "pip", "check")
    complaints = [line for line in r.stdout.splitlines() if line.strip()]
    assert all(line.startswith("lammps-jax-pjrt-cpu ") and " requires jax" in line for line in complaints), \
        r.stdout


def test_it_serves_the_demo_artifact_with_engines_ids(tmp_path):
    art = tmp_path / "artifact"
    export_demo(art)
    with Engine.load(art, cache_dir=None, progress=False) as engine:
        want = engine.generate([PROMPT], 24)[0]
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([str(SERVE_PYTHON), "-m", "tlaloc_jax.serve", str(art), "--port", str(port),
                             "--cache-dir", str(tmp_path / "executables")],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_PLATFORMS")})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, log,
                   "the server in .venv-serve", errors=(httpx.TransportError,))
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    finally:
        proc.terminate()
        proc.wait(30)
