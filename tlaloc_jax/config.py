"""Model configuration: the frozen description of a decoder, built from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A checkpoint's config.json asks for something this project does not build; the message names it."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings.

    rope_type: "default" (plain RoPE) or "llama3" (Llama 3.1 frequency scaling).
    partial_rotary_factor: the fraction of the head that is rotated (1.0 for Llama and Qwen3).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class DecoderConfig:
    """Everything the decoder functions need to know about a model's shape and its optional steps.

    Built by a family (tlaloc_jax.families) from an HF config.json; frozen and hashable so it can be a
    static argument of jax.jit.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    name: str = ""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # (token id, config key) pairs that a server refuses: multimodal placeholders of the checkpoint.
    refused_tokens: tuple[tuple[int, str], ...] = field(default=())

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def query_scale(self) -> float:
        return self.head_dim ** -0.5

    def replace(self, **changes) -> "DecoderConfig":
        return dataclasses.replace(self, **changes)
