"""`python -m tlaloc_jax.serve.integrations.vllm ARTIFACT [vLLM server options]`: vLLM's OpenAI server on a tlaloc
artifact, the plugin enabled (VLLM_PLUGINS gains "tlaloc"), from any working directory.

`python -m` puts the working directory first on sys.path; the project is importable through its installation, so
the working directory is taken off sys.path before vLLM is imported: a folder where the server is started never
stands in for a package vLLM imports.
"""

from __future__ import annotations

import os
import runpy
import sys

from . import PLUGIN_NAME, active


def main(argv: list[str]) -> None:
    if not argv or argv[0].startswith("-"):
        sys.exit("usage: python -m tlaloc_jax.serve.integrations.vllm ARTIFACT [vLLM server options]")
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", cwd)]
    if not active():
        names = os.environ.get("VLLM_PLUGINS")
        os.environ["VLLM_PLUGINS"] = f"{names},{PLUGIN_NAME}" if names else PLUGIN_NAME
    sys.argv = ["vllm.entrypoints.openai.api_server", "--model", argv[0], *argv[1:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
