"""vLLM serves tlaloc artifacts through this platform plugin: vLLM keeps its scheduler, block manager (prefix caching,
preemption, chunked prefill), tokenizer, detokenizer, OpenAI server and metrics; the plugin's worker runs the
artifact's entries on its PJRT device and never builds a torch model.

Registered in pyproject.toml under vLLM's `vllm.platform_plugins` and `vllm.general_plugins` groups as `tlaloc`, and
active only where `VLLM_PLUGINS` names it (installing the project beside vLLM changes nothing else):

    VLLM_PLUGINS=tlaloc python -m vllm.entrypoints.openai.api_server --model ARTIFACT --port 8000
    VLLM_PLUGINS=tlaloc python -c 'import vllm; vllm.LLM("ARTIFACT", config_format="tlaloc").generate(...)'

`python -m tlaloc_jax.serve.integrations.vllm ARTIFACT [vLLM server options]` starts the same server with both set.

This package imports vLLM and torch only from its submodules: the entry points below import neither.
"""

from __future__ import annotations

import os

PLUGIN_NAME = "tlaloc"


def active() -> bool:
    """Whether VLLM_PLUGINS (vLLM's own allow-list of plugins) names this plugin."""
    names = os.environ.get("VLLM_PLUGINS")
    return names is not None and PLUGIN_NAME in [n.strip() for n in names.split(",")]


def platform_plugin() -> str | None:
    """vLLM's `vllm.platform_plugins` entry: the platform's qualified name when the plugin is active."""
    return "tlaloc_jax.serve.integrations.vllm.platform.TlalocPlatform" if active() else None


def register() -> None:
    """vLLM's `vllm.general_plugins` entry (run in every vLLM process): the artifact config format and the
    architecture its configs name."""
    if not active():
        return
    from vllm import ModelRegistry
    from vllm.transformers_utils.config import register_config_parser

    from .config import (ARCHITECTURE, CONFIG_FORMAT, ArtifactOrHFConfigParser, TlalocArtifactForCausalLM,
                         TlalocConfigParser)

    register_config_parser(CONFIG_FORMAT)(TlalocConfigParser)
    register_config_parser("hf")(ArtifactOrHFConfigParser)
    ModelRegistry.register_model(ARCHITECTURE, TlalocArtifactForCausalLM)
