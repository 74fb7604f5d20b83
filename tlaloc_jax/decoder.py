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

from .config import FULL, SLIDING, DecoderConfig
from .layers import apply_rope, embed, gated_mlp, linear, rms_norm, rope_tables, soft_cap, tied_head

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
    # With a windowed pool (sliding layers in rings): WINDOW_BLOCK_TABLES [B, M] (entry b: the ring page
    # of block b) and WINDOW_SLOT_MAPPING [B, T]. None without one.
    window_block_tables: jax.Array | None = None
    window_slot_mapping: jax.Array | None = None


def pool_of(cfg: DecoderConfig, layer_type: str, windowed: bool) -> str:
    """The pool class an attention layer's keys and values live in."""
    return "window_kv" if windowed and layer_type == SLIDING else "kv"


def pool_shapes(cfg: DecoderConfig, num_blocks: int, block_size: int,
                window_blocks: int = 0) -> dict[str, tuple[int, ...]]:
    """One buffer per pool class, its layers stacked, [L', 2, P, S, K, D] (0 = keys, 1 = values):
    "kv" (full-history pages) and, when window_blocks > 0, "window_kv" (the sliding layers' rings)."""
    out: dict[str, tuple[int, ...]] = {}
    for t in cfg.layer_types:
        if t in (FULL, SLIDING):
            name = pool_of(cfg, t, window_blocks > 0)
            n = out.get(name, (0,))[0] + 1
            out[name] = (n, 2, window_blocks if name == "window_kv" else num_blocks, block_size,
                         cfg.num_kv_heads, cfg.head_dim)
    return out


def init_pools(cfg: DecoderConfig, num_blocks: int, block_size: int, dtype=jnp.float32,
               window_blocks: int = 0) -> Pools:
    return {name: jnp.zeros(shape, dtype)
            for name, shape in pool_shapes(cfg, num_blocks, block_size, window_blocks).items()}


def layer_period(types: tuple[str, ...]) -> int:
    """The shortest p dividing the layer count with types[i] == types[i % p]: one scan step runs p layers."""
    L = len(types)
    for p in range(1, L + 1):
        if L % p == 0 and all(types[i] == types[i % p] for i in range(L)):
            return p
    return L


def _period_stacks(cfg: DecoderConfig, weights: Weights, p: int) -> dict[str, Weights]:
    """Stacked slots regrouped per scan step: "layers.*" [n, p, ...] and "attn.*" [n, c, ...] (c = the
    attention layers of one period), n = L // p."""
    n = cfg.num_layers // p
    out: dict[str, Weights] = {"layers": {}, "attn": {}}
    for name, w in weights.items():
        group, _, slot = name.partition(".")
        if group in out:
            out[group][slot] = w.reshape(n, w.shape[0] // n, *w.shape[1:])
    return out


def _attention(cfg: DecoderConfig, w: Weights, x: jax.Array, kv: jax.Array, layer: jax.Array, inputs: StepInputs,
               rope: tuple[jax.Array, jax.Array], window: int, key_block: int,
               ring_pages: int = 0) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, E] (normed) -> (attention output [B, T, E], kv pool with this layer's keys and values written).

    ring_pages > 0: the layer's pool is the windowed pool; it writes through the window slot mapping and
    scores only the first ring_pages entries of the window block table (the ring), whatever the bucket.
    """
    B, T, _ = x.shape
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(x, w["q_proj"]).reshape(B, T, H, D)
    k = linear(x, w["k_proj"]).reshape(B, T, K, D)
    v = linear(x, w["v_proj"]).reshape(B, T, K, D)
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    cos, sin = rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if ring_pages:
        slots, tables = inputs.window_slot_mapping, inputs.window_block_tables[:, :ring_pages]
    else:
        slots, tables = inputs.slot_mapping, inputs.block_tables
    kv = kv_cache_write(kv, k, v, slots, layer)
    o = paged_attention(q, kv, layer, tables, inputs.positions, inputs.seq_lens,
                        scale=cfg.query_scale, window=window or None, soft_cap=cfg.attn_softcap or None,
                        key_block=key_block, ring=bool(ring_pages))
    return linear(o.reshape(B, T, H * D), w["o_proj"]), kv


def final_hidden(cfg: DecoderConfig, weights: Weights, pools: Pools, inputs: StepInputs, *,
                 key_block: int = DEFAULT_KEY_BLOCK, ring_pages: int = 0) -> tuple[jax.Array, Pools]:
    """Run every layer over the call's tokens: -> (final-normed hidden state of each row's last token [B, E], pools).

    ring_pages > 0 puts the sliding layers in the windowed pool ("window_kv"), each sequence's ring of
    ring_pages pages; 0 keeps every attention layer in the full-history pool ("kv").
    """
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    types = cfg.layer_types
    h = embed(weights["embed"], inputs.token_ids)
    if cfg.embed_scale:
        h = h * jnp.float32(cfg.hidden_size ** 0.5)
    tables = {FULL: rope_tables(cfg.rope, cfg.head_dim, inputs.positions)}
    tables[SLIDING] = (rope_tables(cfg.rope_sliding, cfg.head_dim, inputs.positions)
                       if cfg.rope_sliding is not None else tables[FULL])
    p = layer_period(types)
    attn_rank = {j: r for r, j in enumerate(j for j in range(p) if types[j] in (FULL, SLIDING))}
    # Each attention layer's index in its pool: the scan step i holds per_pool[name] of the pool's layers.
    pool_name = {j: pool_of(cfg, types[j], ring_pages > 0) for j in attn_rank}
    pool_rank = {j: sum(pool_name[i] == pool_name[j] for i in attn_rank if i < j) for j in attn_rank}
    per_pool = {name: sum(n == name for n in pool_name.values()) for name in set(pool_name.values())}

    def period(carry, xs):
        h, pools = carry
        w, i = xs
        for j in range(p):         # the layers of one period: p is small (1 for Llama, 2 for Gemma 2)
            lw = {k: v[j] for k, v in w["layers"].items()}
            a = rms_norm(h, lw["attn_norm"], eps, off)
            r = attn_rank[j]
            aw = {k: v[r] for k, v in w["attn"].items()}
            name = pool_name[j]
            a, kv = _attention(cfg, aw, a, pools[name], i * per_pool[name] + pool_rank[j], inputs,
                               tables[types[j]], cfg.layer_window(j), key_block,
                               ring_pages if name == "window_kv" else 0)
            pools = {**pools, name: kv}
            if cfg.sandwich_norms:
                a = rms_norm(a, lw["post_attn_norm"], eps, off)
            h = h + a
            m = rms_norm(h, lw["mlp_norm"], eps, off)
            m = gated_mlp(m, lw["gate_proj"], lw["up_proj"], lw["down_proj"], cfg.hidden_act)
            if cfg.sandwich_norms:
                m = rms_norm(m, lw["post_mlp_norm"], eps, off)
            h = h + m
        return (h, pools), None

    # A scan over periods keeps one copy of the period's layers in the graph (compile time, body size);
    # the pools ride in the carry so each layer's scatter writes the donated buffers in place.
    n = cfg.num_layers // p
    (h, pools), _ = lax.scan(period, (h, pools), (_period_stacks(cfg, weights, p), jnp.arange(n)))
    # Rows are right-aligned, so every row's last token is at T - 1.
    return rms_norm(h[:, -1], weights["final_norm"], eps, off), pools


def logits_from_hidden(cfg: DecoderConfig, weights: Weights, x: jax.Array) -> jax.Array:
    """x: [B, E] -> logits [B, V] f32."""
    logits = tied_head(x, weights["embed"]) if cfg.tie_word_embeddings else linear(x, weights["head"])
    return soft_cap(logits, cfg.final_softcap)


def forward(cfg: DecoderConfig, weights: Weights, pools: Pools, inputs: StepInputs, *,
            key_block: int = DEFAULT_KEY_BLOCK, ring_pages: int = 0) -> tuple[jax.Array, Pools]:
    """One call: -> (logits of each row's last token [B, V] f32, updated pools)."""
    x, pools = final_hidden(cfg, weights, pools, inputs, key_block=key_block, ring_pages=ring_pages)
    return logits_from_hidden(cfg, weights, x), pools


def prefill(cfg: DecoderConfig, weights: Weights, pools: Pools, inputs: StepInputs, *,
            key_block: int = DEFAULT_KEY_BLOCK, ring_pages: int = 0) -> tuple[jax.Array, Pools]:
    """A chunk of up to T tokens per sequence, rows right-aligned (padding first)."""
    return forward(cfg, weights, pools, inputs, key_block=key_block, ring_pages=ring_pages)


def decode(cfg: DecoderConfig, weights: Weights, pools: Pools, inputs: StepInputs, *,
           key_block: int = DEFAULT_KEY_BLOCK, ring_pages: int = 0) -> tuple[jax.Array, Pools]:
    """One new token per sequence (T = 1)."""
    if inputs.token_ids.shape[1] != 1:
        raise ValueError(f"decode takes one token per sequence, got token_ids of shape {inputs.token_ids.shape}")
    return forward(cfg, weights, pools, inputs, key_block=key_block, ring_pages=ring_pages)
