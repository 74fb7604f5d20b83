"""DecoderConfig's groups: each validates its own fields, the flat keywords are gone, replace() changes a group."""

import dataclasses

import pytest

from tlaloc_jax.config import (GROUPS, LINEAR, AttentionConfig, ConfigError, DecoderConfig, LatentConfig,
                               LinearAttentionConfig, MoeConfig, ResidualConfig, RopeConfig)

CORE = dict(model_type="test", vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
            num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope=RopeConfig())


def test_each_group_refuses_its_own_bad_fields():
    with pytest.raises(ConfigError, match="num_experts_per_tok=5 must be between 1 and num_experts=4"):
        MoeConfig(num_experts=4, experts_per_token=5, intermediate_size=8)
    with pytest.raises(ConfigError, match="positive moe_intermediate_size"):
        MoeConfig(num_experts=4, experts_per_token=2)
    with pytest.raises(ConfigError, match="latent attention needs a positive qk_nope_head_dim"):
        LatentConfig(kv_lora_rank=8, v_head_dim=4)
    with pytest.raises(ConfigError, match="positive linear_key_heads"):
        DecoderConfig(**CORE, layer_types=(LINEAR, LINEAR))
    with pytest.raises(ConfigError, match=r"linear value heads \(3\) are not a multiple of linear key heads \(2\)"):
        LinearAttentionConfig(key_heads=2, key_dim=4, value_heads=3, value_dim=4, conv_kernel=4).check()
    # Unset groups are valid: a dense full-attention model needs none of them.
    cfg = DecoderConfig(**CORE)
    assert (cfg.attention, cfg.residual, cfg.mla, cfg.linear, cfg.experts) == (
        AttentionConfig(), ResidualConfig(), LatentConfig(), LinearAttentionConfig(), MoeConfig())


def test_the_flat_keywords_are_refused():
    top = {f.name for f in dataclasses.fields(DecoderConfig)}
    for name in ("num_experts", "kv_lora_rank", "linear_key_heads", "attn_sinks", "residual_multiplier", "qk_norm"):
        assert name not in top
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            DecoderConfig(**CORE, **{name: 1})
    assert set(GROUPS) <= top


def test_replace_changes_one_group_and_keeps_the_rest():
    cfg = DecoderConfig(**CORE, attention=AttentionConfig(qk_norm=True, bias=True))
    out = cfg.replace(attention=dict(sinks=True), num_heads=4)
    assert out.attention == AttentionConfig(qk_norm=True, bias=True, sinks=True) and out.num_heads == 4
    assert cfg.attention.sinks is False                         # the original is untouched (frozen)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        cfg.replace(experts=dict(nope=1))
    with pytest.raises(ConfigError, match="num_experts_per_tok=0"):
        cfg.replace(experts=dict(num_experts=4))                # the changed group validates again
