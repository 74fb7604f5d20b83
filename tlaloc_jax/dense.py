"""The decoder run densely over whole windows, no pages: the forward that training differentiates.

The same layers (tlaloc_jax.layers) and the same Weights slots as the paged decoder (tlaloc_jax.decoder),
stacked slots scanned over layers; only the attention differs: the keys are the window's own tokens,
so it is a plain causal attention (kernels.causal_attention, whose custom_vjp is the training backward,
or its dense reference form for checking gradients). Every row starts at position 0.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from tlaloc_jax.kernels import causal_attention

from .config import FULL, SLIDING, ConfigError, DecoderConfig
from .decoder import (Weights, attention_input, attention_output, embed_tokens, logits_from_hidden, project_qkv,
                      residual_mlp)
from .layers import rms_norm, rope_tables

# attention(q [B, T, H, D], k, v [B, T, K, D], *, scale, window, soft_cap) -> [B, T, H, D] f32
Attention = Callable[..., jax.Array]


def training_attention(key_block: int = 512) -> Attention:
    """The blockwise causal attention with its custom_vjp backward, at a fixed key block."""
    return functools.partial(causal_attention, key_block=key_block)


def _per_layer(cfg: DecoderConfig, weights: Weights) -> Weights:
    """Every stacked slot by its name within a layer ("layers.mlp_norm" -> "mlp_norm", "attn.q_proj" ->
    "q_proj"), each [L, ...]: with no linear-attention layers, the attention stacks hold every layer."""
    linear_layers = [i for i, t in enumerate(cfg.layer_types) if t not in (FULL, SLIDING)]
    if linear_layers:
        raise ConfigError(f"the dense forward has no linear-attention layers (layers {linear_layers} of "
                          f"{cfg.model_type} are {cfg.layer_types[linear_layers[0]]!r})")
    if cfg.attention.sinks:
        raise ConfigError(f"the dense forward has no attention sinks ({cfg.model_type} config); its training "
                          "attention (kernels.causal_attention) would drop them")
    if cfg.latent:
        raise ConfigError(f"the dense forward has no latent attention ({cfg.model_type} config; kernels.mla_causal "
                          "is its training form)")
    if len(set(cfg.mlp_types)) > 1:
        raise ConfigError(f"the dense forward scans every layer alike; {cfg.model_type} mixes MLP kinds "
                          f"{list(cfg.mlp_types)}")
    return {name.split(".", 1)[1]: w for name, w in weights.items() if "." in name}


def dense_hidden(cfg: DecoderConfig, weights: Weights, token_ids: jax.Array, *,
                 attention: Attention) -> jax.Array:
    """token_ids: [B, T], every row at positions 0..T-1 -> final-normed hidden states [B, T, E] f32."""
    B, T = token_ids.shape
    D = cfg.head_dim
    eps, off = cfg.rms_norm_eps, cfg.residual.norm_offset
    h = embed_tokens(cfg, weights, token_ids)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    full_rope = rope_tables(cfg.rope, D, positions)
    sliding_rope = rope_tables(cfg.rope_sliding, D, positions) if cfg.rope_sliding is not None else None
    windows = jnp.asarray([cfg.layer_window(i) for i in range(cfg.num_layers)], jnp.int32)
    soft_cap = cfg.attention.softcap or None

    def layer(h, xs):
        w, window = xs
        # The window is a traced scalar (0 = full); a sliding layer may have its own RoPE (Gemma 3).
        cos, sin = full_rope
        if sliding_rope is not None:
            cos, sin = (jnp.where(window > 0, s, f) for s, f in zip(sliding_rope, (cos, sin)))
        x = attention_input(cfg, w, h)
        q, k, v = project_qkv(cfg, w, x, (cos, sin))
        o = attention(q, k, v, scale=cfg.query_scale, window=window, soft_cap=soft_cap)
        return residual_mlp(cfg, w, h, attention_output(cfg, w, x, o)), None

    # One copy of the layer body in the graph; its backward is a scan too.
    h, _ = lax.scan(layer, h, (_per_layer(cfg, weights), windows))
    return rms_norm(h, weights["final_norm"], eps, off)


def dense_logits(cfg: DecoderConfig, weights: Weights, token_ids: jax.Array, *,
                 attention: Attention) -> jax.Array:
    """token_ids: [B, T] -> logits [B, T, V] f32, through the decoder's own head (tied or not, soft-capped)."""
    B, T = token_ids.shape
    x = dense_hidden(cfg, weights, token_ids, attention=attention)
    return logits_from_hidden(cfg, weights, x.reshape(B * T, -1)).reshape(B, T, -1)


def next_token_loss(cfg: DecoderConfig, weights: Weights, batch: jax.Array, *, attention: Attention) -> jax.Array:
    """batch: [B, T + 1] token ids -> mean cross entropy (nats) of the B * T next-token predictions."""
    logits = dense_logits(cfg, weights, batch[:, :-1], attention=attention)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))
