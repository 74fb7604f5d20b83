"""A multi-head latent attention layer (DeepSeek-V3): projections around tlaloc_jax/kernels/mla.py's paged op.

Slots (tlaloc_jax/families.py): q_proj [E, H (Dn + R)], or q_a_proj [E, Q], q_a_norm [Q], q_b_proj [Q, H (Dn + R)]
through the q_lora_rank bottleneck Q; kv_a_proj [E, C + R] (the latent before its norm, then the rotated key's
input); kv_a_norm [C]; k_b_proj [C, H Dn] and v_b_proj [C, H Dv] (kv_b_proj's key and value halves); o_proj
[H Dv, E]. Letters as tlaloc_jax/kernels/mla.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlaloc_jax.kernels import mla_cache_write, paged_mla

from .config import DecoderConfig
from .inputs import StepInputs
from .layers import apply_rope, linear, rms_norm

# transformers' DeepSeek-V3 builds the q_a and kv_a norms with RMSNorm's default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def latent_queries(cfg: DecoderConfig, w: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, E] (normed) -> the queries' parts expanded against the latent [B, T, H, Dn] and rotated [B, T, H, R]
    (not yet rotated)."""
    B, T, _ = x.shape
    if cfg.q_lora:
        q = linear(rms_norm(linear(x, w["q_a_proj"]), w["q_a_norm"], LATENT_NORM_EPS), w["q_b_proj"])
    else:
        q = linear(x, w["q_proj"])
    q = q.reshape(B, T, cfg.num_heads, cfg.qk_head_dim)
    return q[..., :cfg.mla.qk_nope_head_dim], q[..., cfg.mla.qk_nope_head_dim:]


def latent_keys(cfg: DecoderConfig, w: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, E] (normed) -> each position's normed latent [B, T, C] and its key's rotated part [B, T, R] (not
    yet rotated)."""
    kv = linear(x, w["kv_a_proj"])
    C = cfg.mla.kv_lora_rank
    return rms_norm(kv[..., :C], w["kv_a_norm"], LATENT_NORM_EPS), kv[..., C:]


def expansions(cfg: DecoderConfig, w: dict) -> tuple[jax.Array, jax.Array]:
    """(Wk [C, H, Dn], Wv [C, H, Dv]) from the k_b_proj and v_b_proj slots."""
    C, H = cfg.mla.kv_lora_rank, cfg.num_heads
    return w["k_b_proj"].reshape(C, H, cfg.mla.qk_nope_head_dim), w["v_b_proj"].reshape(C, H, cfg.mla.v_head_dim)


def latent_attention(cfg: DecoderConfig, w: dict, x: jax.Array, pool: jax.Array, layer, inputs: StepInputs,
                     rope: tuple[jax.Array, jax.Array], key_block: int) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, E] (normed) -> (attention output [B, T, E], the latent pool [L', 1, P, S, 1, C + R] with this
    layer's latents and rotated keys written through the slot mapping). key_block: the paged op's (a multiple of
    the page size)."""
    B, T, _ = x.shape
    cos, sin = rope
    q_nope, q_rope = latent_queries(cfg, w, x)
    latent, k_rope = latent_keys(cfg, w, x)
    q_rope = apply_rope(q_rope, cos, sin, cfg.rope.interleaved)
    k_rope = apply_rope(k_rope[:, :, None], cos, sin, cfg.rope.interleaved)[:, :, 0]
    pool = mla_cache_write(pool, latent, k_rope, inputs.slot_mapping, layer)
    w_k, w_v = expansions(cfg, w)
    o = paged_mla(q_nope, q_rope, pool, layer, inputs.block_tables, inputs.positions, inputs.seq_lens, w_k, w_v,
                  scale=cfg.query_scale, key_block=key_block)
    return linear(o.reshape(B, T, -1).astype(jnp.float32), w["o_proj"]), pool
