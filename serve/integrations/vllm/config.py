"""What vLLM's configuration layer reads of an artifact: a Hugging Face config made from its manifest (vLLM's
`--config-format tlaloc`), and the architecture that config names.

vLLM sizes its scheduler and block manager from a `PretrainedConfig` and resolves the config's architecture in its
model registry. An artifact has no `config.json`: the manifest says everything vLLM needs (layers, heads, head size,
vocabulary, the largest context, the dtype), so the parser writes the config from it. The architecture,
`TlalocArtifactForCausalLM`, is registered so that vLLM sees a plain text-generation model (no hybrid, multimodal or
pooling interfaces); its torch module is never built, since the worker runs the artifact's entries instead.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm.transformers_utils.config import HFConfigParser
from vllm.transformers_utils.config_parser_base import ConfigParserBase

from tlaloc_jax import artifact as af

CONFIG_FORMAT = "tlaloc"
ARCHITECTURE = "TlalocArtifactForCausalLM"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float8_e4m3fn": torch.float8_e4m3fn}


class TlalocArtifactConfig(PretrainedConfig):
    """The Hugging Face view of an artifact's manifest (`artifact_dir` names the artifact)."""

    model_type = "tlaloc_artifact"

    def __init__(self, artifact_dir: str = "", **kwargs):
        self.artifact_dir = artifact_dir
        super().__init__(**kwargs)


def config_from_manifest(artifact_dir: str | Path) -> TlalocArtifactConfig:
    """The config of an artifact, from its manifest alone (the worker validates every file when it loads)."""
    m = af.load_manifest(artifact_dir, verify_files=False)
    paged = m.pools_of(af.PoolKind.PAGED_KV)
    # Authored artifacts (tlaloc_jax.stage) may leave the model's dimensions unset: the paged pool's shape
    # [L, 2, P, S, K, D] says the layers, KV heads and head size vLLM counts KV bytes with.
    layers, _, _, _, kv_heads, head_dim = paged[0].shape if paged else (m.model.layers, 2, 0, 0, 1, 1)
    layers, kv_heads, head_dim = m.model.layers or layers, m.model.kv_heads or kv_heads, m.model.head_dim or head_dim
    heads = m.model.heads or kv_heads
    eos = list(m.model.eos_token_ids)
    return TlalocArtifactConfig(
        artifact_dir=str(Path(artifact_dir).resolve()), architectures=[ARCHITECTURE],
        vocab_size=m.model.vocab, hidden_size=m.model.hidden or heads * head_dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max(m.buckets.context_ladder), dtype=m.model.weight_dtype,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None), tie_word_embeddings=False)


class TlalocConfigParser(ConfigParserBase):
    """vLLM's `--config-format tlaloc`: the model path is an artifact directory."""

    def parse(self, model, trust_remote_code: bool, revision=None, code_revision=None, **kwargs):
        config = config_from_manifest(model)
        return config.to_dict(), config


class TlalocArtifactForCausalLM(nn.Module):
    """The registry entry of an artifact. vLLM reads its interfaces (a text-generation model, nothing more); the
    plugin's worker runs the artifact's entries, so constructing it is a configuration error."""

    def __init__(self, *, vllm_config=None, prefix: str = ""):
        super().__init__()
        raise RuntimeError("a tlaloc artifact is served by the tlaloc platform's worker (VLLM_PLUGINS=tlaloc), "
                           "which runs its entries; vLLM's own model runner cannot build it")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(ARCHITECTURE)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(ARCHITECTURE)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(ARCHITECTURE)


class ArtifactOrHFConfigParser(HFConfigParser):
    """vLLM's "hf" format, reading an artifact directory's manifest instead of a config.json. vLLM's tokenizer
    loader asks the "hf" parser for the model's config; without this it fails (and retries) on an artifact."""

    def parse(self, model, trust_remote_code: bool, revision=None, code_revision=None, **kwargs):
        if (Path(model) / af.MANIFEST_NAME).is_file():
            return TlalocConfigParser().parse(model, trust_remote_code, revision, code_revision, **kwargs)
        return super().parse(model, trust_remote_code, revision, code_revision, **kwargs)
