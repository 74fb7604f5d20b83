"""KV bytes per token: DeepSeek-V3's latent pool against a GQA model of the same size, from the pools the exporter
declares (export.decoder_pools) for each config, no weights needed.

    python -m bench.latent_kv [--kv-dtype bfloat16]

The latent pool keeps per token and layer the latent (kv_lora_rank) and the rotated key (qk_rope_head_dim); the
GQA model has DeepSeek-V3's layers, hidden size and 128 query heads of 128 with 8 KV heads (keys and values, as
Llama 3's 70B and 405B); "expanded" is what caching every head's key (Dn + R) and value (Dv) would take.
"""

from __future__ import annotations

import argparse

from tlaloc_jax import artifact as af
from tlaloc_jax.export import decoder_pools
from tlaloc_jax.families import config_from_hf

# DeepSeek-V3's config.json (the keys the family reads).
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
    first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000, rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                                           beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
# A GQA model of the same size: DeepSeek-V3's layers, hidden size and query heads, 8 KV heads of 128.
GQA = dict(model_type="llama", vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
           num_attention_heads=128, num_key_value_heads=8, head_dim=128, max_position_embeddings=163840)


def bytes_per_token(hf: dict, kv_dtype: str) -> int:
    """The bytes one token's position takes in the config's paged pools, as the manifest would record them."""
    _, cfg = config_from_hf(hf)
    total = 0
    for name, spec in decoder_pools(cfg, windowed=False, kv_dtype=kv_dtype, ring_pages=0).items():
        pool = spec.to_pool(name, capacity=1, block_size=1)
        if pool.kind == af.PoolKind.PAGED_KV:
            total += pool.nbytes
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    latent = bytes_per_token(DEEPSEEK_V3, args.kv_dtype)
    gqa = bytes_per_token(GQA, args.kv_dtype)
    _, cfg = config_from_hf(DEEPSEEK_V3)
    item = af.numpy_dtype(args.kv_dtype).itemsize
    expanded = cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.mla.v_head_dim) * item
    print(f"KV bytes per token ({args.kv_dtype}), 61 layers:")
    print(f"  DeepSeek-V3 latent pool (512 + 64 per layer)      {latent:>10,}")
    print(f"  GQA, 8 KV heads of 128 (keys and values)          {gqa:>10,}   {gqa / latent:5.2f}x the latent pool")
    print(f"  every head's key and value expanded (128 heads)   {expanded:>10,}   {expanded / latent:5.2f}x")


if __name__ == "__main__":
    main()
