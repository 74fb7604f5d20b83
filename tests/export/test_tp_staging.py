"""Tensor-parallel staging, JAX side: how the built-in decoder's weights are split (shard-major fused projections
against a per-shard construction), refusals by name, a shard's experts adding up to the whole mixture, and the
collectives of every exported body: exactly one all-reduce per attention and one per MLP, nothing else, and
nothing left for a partitioner to add (controls: a body without its all-reduces, one that gathers a weight)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import build_checkpoint
from margins import assert_within
from tlaloc_jax import artifact as af
from tlaloc_jax.config import LINEAR
from tlaloc_jax.export import ExportError, export_checkpoint
from tlaloc_jax.export._mesh import collective_counts
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.moe import MoeSpec, moe
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.sharding import ShardingError, check_divisible, shard_major

TINY_LADDER = dict(batch_ladder=(1,), context_ladder=(32,), prefill_chunk=8, prefill_long_chunk=0, block_size=8,
                   progress=False, mlir=True)


# --- the split -------------------------------------------------------------------------------------------


def test_shard_major_against_per_shard_construction():
    """Shard d of the reordered fused array is shard d of each part, in part order."""
    rng = np.random.default_rng(0)
    parts = (8, 4, 4)                            # q | k | v of 4 heads, 2 KV heads, head size 2
    a = rng.standard_normal((sum(parts), 5))
    for n in (1, 2, 4):
        got = shard_major(a, 0, parts, n)
        pieces = np.split(a, np.cumsum(parts)[:-1], axis=0)
        for d, shard in enumerate(np.split(got, n, axis=0)):
            want = np.concatenate([p[d * len(p) // n:(d + 1) * len(p) // n] for p in pieces])
            np.testing.assert_array_equal(shard, want)
    # The last axis too (an [I, O] projection), and a vector (a fused bias).
    np.testing.assert_array_equal(shard_major(a.T, -1, parts, 2), shard_major(a, 0, parts, 2).T)
    b = np.arange(16.0)
    np.testing.assert_array_equal(shard_major(b, -1, parts, 2), [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15])


def test_refusals_name_the_count(llama_tp2, tmp_path):
    from tlaloc_jax.checkpoint import load_checkpoint
    _, ck, _ = llama_tp2                                     # 4 heads, 2 KV heads, MLP 96
    cfg, _ = load_checkpoint(ck, "float32")
    check_divisible(cfg, 2)
    with pytest.raises(ShardingError, match="num_key_value_heads=2 .* 4 tensor-parallel"):
        check_divisible(cfg, 4)
    with pytest.raises(ShardingError, match="num_attention_heads=4 .* 3 tensor-parallel"):
        check_divisible(cfg.replace(num_kv_heads=1), 3)
    with pytest.raises(ShardingError, match="num_experts=6"):
        check_divisible(cfg.replace(num_kv_heads=4, mlp_types=(),
                                    experts=dict(num_experts=6, experts_per_token=2, intermediate_size=8)), 4)
    with pytest.raises(ShardingError, match="linear_num_key_heads=2"):
        check_divisible(cfg.replace(num_kv_heads=4, layer_types=(LINEAR,) * 3,
                                    linear=dict(key_heads=2, value_heads=4, key_dim=8, value_dim=8, conv_kernel=4)), 4)
    with pytest.raises(ShardingError, match="latent attention"):
        check_divisible(cfg.replace(head_dim=4, mla=dict(kv_lora_rank=8, v_head_dim=4, qk_nope_head_dim=4)), 2)
    with pytest.raises(ExportError, match="num_key_value_heads=2"):
        export_checkpoint(ck, tmp_path / "out", tensor_parallel=4, **TINY_LADDER)
    assert not (tmp_path / "out").exists(), "a refused export wrote files"


@pytest.mark.numeric
@pytest.mark.parametrize("tokens", [1, 12], ids=["gathered", "grouped"])
def test_a_shards_experts_add_up_to_the_whole(tokens):
    """moe over each shard's contiguous X / n experts (first_expert = d X / n), summed over the shards, is the
    whole mixture; the shared expert split over its width likewise."""
    X, J, E, F, Fs = 8, 2, 12, 6, 8
    rng = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)  # noqa: E731
    x, router = f(1, tokens, E), f(E, X)
    experts = {"gate": f(X, E, F), "up": f(X, E, F), "down": f(X, F, E), "down_bias": f(X, E)}
    shared = {"gate": f(E, Fs), "up": f(E, Fs), "down": f(Fs, E), "gate_proj": f(E, 1)}
    spec = MoeSpec(experts=X, top_k=J, normalize=True)
    run = jax.jit(lambda experts, shared, first: moe(spec, x, router, experts, shared=shared, first_expert=first))
    whole = run(experts, shared, 0)
    # The shards add the same products in another order: the whole mixture's rounding bound.
    bound = tol.bound(tol.moe_roundings(hidden=E, expert_hidden=F, experts=X, top_k=J, shared_hidden=Fs))
    for n in (2, 4):
        Xl, Fl = X // n, Fs // n

        def shard(d):
            return ({k: v[d * Xl:(d + 1) * Xl] for k, v in experts.items()},
                    {"gate": shared["gate"][:, d * Fl:(d + 1) * Fl], "up": shared["up"][:, d * Fl:(d + 1) * Fl],
                     "down": shared["down"][d * Fl:(d + 1) * Fl], "gate_proj": shared["gate_proj"]})
        assert_within(relative_error(sum(run(*shard(d), d * Xl) for d in range(n)), whole), bound,
                      f"moe over {n} shards of experts, {tokens} tokens")
        # Control: shards that all claim to hold the first experts do not add up.
        assert relative_error(sum(run(*shard(d), 0) for d in range(n)), whole) > bound


# --- the collectives of the bodies ---------------------------------------------------------------------------


def _arg_shardings(header: str) -> list[str]:
    return re.findall(r"%arg\d+: tensor<[^>]*>\s*\{sdy\.sharding = (#sdy\.sharding<@mesh, \[[^\]]*\]>)", header)


def check_collectives(text: str, layers: int) -> None:
    """One all-reduce per attention (or linear attention) and one per MLP, no other collective, and the whole
    @main one manual computation whose operands arrive sharded as it takes them (nothing to reshard)."""
    counts = collective_counts(text)
    others = {op: c for op, c in counts.items() if op != "all_reduce" and c}
    assert not others, f"unexpected collectives {others}"
    assert counts["all_reduce"] == 2 * layers, f"{counts['all_reduce']} all-reduces for {layers} layers"
    header = re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S).group(1)
    manual = re.search(r"sdy\.manual_computation\((.*?)\) in_shardings=\[(.*?)\] out_shardings", text, re.S)
    assert manual, "the body's @main is not a manual computation"
    operands = [o.strip() for o in manual.group(1).split(",")]
    takes = dict(zip(operands, re.findall(r"<@mesh, \[[^\]]*\]>", manual.group(2))))
    given = {f"%arg{i}": s.removeprefix("#sdy.sharding") for i, s in enumerate(_arg_shardings(header))}
    assert set(given) <= set(takes), "an argument of @main does not enter the manual computation"
    wrong = [a for a in given if given[a] != takes[a]]
    assert not wrong, f"arguments {wrong} arrive sharded otherwise than the manual computation takes them"
    assert "sdy.reshard" not in text and "sharding_constraint" not in text


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-staging")
    ck = build_checkpoint(root / "ck", "llama")
    m = export_checkpoint(ck, root / "tp2", tensor_parallel=2, decode_steps=2, **TINY_LADDER)
    return root, ck, m


def test_each_body_all_reduces_once_per_attention_and_mlp(llama_tp2):
    root, _, m = llama_tp2
    assert {e.kind for e in m.entries} == {af.EntryKind.DECODE, af.EntryKind.PREFILL, af.EntryKind.DECODE_STEPS,
                                          af.EntryKind.MIXED}
    for e in m.entries:
        text = (root / "tp2" / e.body).read_text()
        assert re.search(r"mhlo\.num_partitions = 2 ", text)
        check_collectives(text, layers=3)


def test_control_a_body_without_its_all_reduces_fails_the_check(llama_tp2, tmp_path, monkeypatch):
    _, ck, _ = llama_tp2
    import tlaloc_jax.decoder as decoder
    monkeypatch.setattr(decoder, "reduce_shards", lambda cfg, x: x)
    m = export_checkpoint(ck, tmp_path / "no-reduce", tensor_parallel=2, **TINY_LADDER)
    with pytest.raises(AssertionError, match="0 all-reduces for 3 layers"):
        check_collectives((tmp_path / "no-reduce" / m.entries[0].body).read_text(), layers=3)


def test_control_a_gathered_weight_fails_the_check(llama_tp2, tmp_path, monkeypatch):
    """A row-parallel projection that gathers its weight back whole (and so needs no all-reduce) is flagged."""
    _, ck, _ = llama_tp2
    import tlaloc_jax.decoder as decoder
    from tlaloc_jax.layers import OutMajor
    real = decoder.linear

    def attention_output(cfg, w, x, o, gate_delta=None):
        B, T, H, D = o.shape
        whole = jax.lax.all_gather(w["o_proj"].out_in, cfg.shard_axis, axis=1, tiled=True)
        o_all = jax.lax.all_gather(o.reshape(B, T, H * D), cfg.shard_axis, axis=2, tiled=True)
        return real(o_all, OutMajor(whole))
    monkeypatch.setattr(decoder, "attention_output", attention_output)
    m = export_checkpoint(ck, tmp_path / "gather", tensor_parallel=2, **TINY_LADDER)
    with pytest.raises(AssertionError, match="all_gather"):
        check_collectives((tmp_path / "gather" / m.entries[0].body).read_text(), layers=3)
