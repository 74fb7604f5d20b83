"""The decoder as pure functions over (weights, pools, step inputs).

`forward` serves both entry kinds: a decode step is a call with T = 1, a prefill call has T > 1 with
right-aligned rows. It returns the logits of each row's last token and the updated pools. The same
function runs under jax.jit in-process, inside jax.export for the artifact, and (compiled from the
artifact) under the JAX-free runtime.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tlaloc_jax.kernels import kv_cache_write, paged_attention

from .config import DecoderConfig
from .layers import apply_rope, embed, linear, rms_norm, rope_tables, swiglu, tied_head

Weights = dict[str, jax.Array]
Pools = dict[str, jax.Array]

DEFAULT_KEY_BLOCK = 2048


class StepInputs(NamedTuple):
    """The integer inputs of one call, named by their manifest roles (docs/glossary.md)."""

    token_ids: jax.Array     # TOKEN_IDS    [B, T] int32
    positions: jax.Array     # POSITIONS    [B, T] int32, -1 = padding
    block_tables: jax.Array  # BLOCK_TABLES [B, M] int32
    seq_lens: jax.Array      # SEQ_LENS     [B] int32
    slot_mapping: jax.Array  # SLOT_MAPPING [B, T] int32, -1 = write nothing


def pool_shapes(cfg: DecoderConfig, num_blocks: int, block_size: int) -> dict[str, tuple[int, ...]]:
    """One buffer per pool class, layers stacked: kv [L, 2, P, S, K, D] (0 = keys, 1 = values)."""
    return {"kv": (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)}


def init_pools(cfg: DecoderConfig, num_blocks: int, block_size: int, dtype=jnp.float32) -> Pools:
    return {name: jnp.zeros(shape, dtype) for name, shape in pool_shapes(cfg, num_blocks, block_size).items()}


def _layer_weights(weights: Weights) -> Weights:
    return {k.removeprefix("layers."): v for k, v in weights.items() if k.startswith("layers.")}


def _attention_block(cfg: DecoderConfig, w: Weights, h: jax.Array, kv: jax.Array, layer: jax.Array,
                     inputs: StepInputs, cos: jax.Array, sin: jax.Array, key_block: int):
    """h: [B, T, E] -> (attention output [B, T, E], kv pool with this layer's keys and values written)."""
    B, T, _ = h.shape
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = rms_norm(h, w["attn_norm"], cfg.rms_norm_eps)
    q = linear(x, w["q_proj"]).reshape(B, T, H, D)
    k = linear(x, w["k_proj"]).reshape(B, T, K, D)
    v = linear(x, w["v_proj"]).reshape(B, T, K, D)
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv = kv_cache_write(kv, k, v, inputs.slot_mapping, layer)
    o = paged_attention(q, kv, layer, inputs.block_tables, inputs.positions, inputs.seq_lens,
                        scale=cfg.query_scale, key_block=key_block)
    return linear(o.reshape(B, T, H * D), w["o_proj"]), kv


def final_hidden(cfg: DecoderConfig, weights: Weights, pools: Pools, inputs: StepInputs, *,
                 key_block: int = DEFAULT_KEY_BLOCK) -> tuple[jax.Array, Pools]:
    """Run every layer over the call's tokens: -> (final-normed hidden state of each row's last token [B, E], pools)."""
    h = embed(weights["embed"], inputs.token_ids)
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, inputs.positions)

    def layer(carry, xs):
        h, kv = carry
        w, idx = xs
        a, kv = _attention_block(cfg, w, h, kv, idx, inputs, cos, sin, key_block)
        h = h + a
        m = rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps)
        h = h + swiglu(m, w["gate_proj"], w["up_proj"], w["down_proj"])
        return (h, kv), None

    # A scan over layers keeps one copy of the layer body in the graph (compile time, body size);
    # the pool rides in the carry so each layer's scatter writes the donated buffer in place.
    (h, kv), _ = lax.scan(layer, (h, pools["kv"]), (_layer_weights(weights), jnp.arange(cfg.num_layers)))
    # Rows are right-aligned, so every row's last token is at T - 1.
    return rms_norm(h[:, -1], weights["final_norm"], cfg.rms_norm_eps), {**pools, "kv": kv}


def logits_from_hidden(cfg: DecoderConfig, weights: Weights, x: jax.Array) -> jax.Array:
    """x: [B, E] -> logits [B, V] f32."""
    if cfg.tie_word_embeddings:
        return tied_head(x, weights["embed"])
    return linear(x, weights["head"])


def forward(cfg: DecoderConfig, weights: Weights, pools: Pools, inputs: StepInputs, *,
            key_block: int = DEFAULT_KEY_BLOCK) -> tuple[jax.Array, Pools]:
    """One call: -> (logits of each row's last token [B, V] f32, updated pools)."""
    x, pools = final_hidden(cfg, weights, pools, inputs, key_block=key_block)
    return logits_from_hidden(cfg, weights, x), pools


def prefill(cfg: DecoderConfig, weights: Weights, pools: Pools, inputs: StepInputs, *,
            key_block: int = DEFAULT_KEY_BLOCK) -> tuple[jax.Array, Pools]:
    """A chunk of up to T tokens per sequence, rows right-aligned (padding first)."""
    return forward(cfg, weights, pools, inputs, key_block=key_block)


def decode(cfg: DecoderConfig, weights: Weights, pools: Pools, inputs: StepInputs, *,
           key_block: int = DEFAULT_KEY_BLOCK) -> tuple[jax.Array, Pools]:
    """One new token per sequence (T = 1)."""
    if inputs.token_ids.shape[1] != 1:
        raise ValueError(f"decode takes one token per sequence, got token_ids of shape {inputs.token_ids.shape}")
    return forward(cfg, weights, pools, inputs, key_block=key_block)
