"""The layer plan against stacks listed by hand from the layer types: each layer of each scan step reads the
stack entry that holds it."""

from __future__ import annotations

import dataclasses

import pytest

from tlaloc_jax.config import (DENSE, FULL, LINEAR, SLIDING, SPARSE, DecoderConfig, LinearAttentionConfig, MoeConfig,
                               RopeConfig)
from tlaloc_jax.decoder import pool_shapes
from tlaloc_jax.families import stack_layers
from tlaloc_jax.plan import Stacked, layer_plan

F, S, X = FULL, SLIDING, LINEAR
MIXES = [(F,) * 3, (S,) * 3, (S, F) * 2, (S, F, S, S), (X, X, X, F) * 2, (S, F, X, S) * 2, (X, S, F), (F, S, S) * 2]


def config(types: tuple[str, ...], mlps: tuple[str, ...] = ()) -> DecoderConfig:
    moe = dict(experts=MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=4)) if SPARSE in mlps else {}
    return DecoderConfig(model_type="test", vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=len(types),
                         num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope=RopeConfig(),
                         layer_types=types, sliding_window=4, mlp_types=mlps, **moe,
                         linear=LinearAttentionConfig(key_heads=1, key_dim=4, value_heads=2, value_dim=4,
                                                      conv_kernel=4))


def by_hand(types: tuple[str, ...], windowed: bool) -> dict[str, list[int]]:
    """Each stack's layers in layer order, from the layer types alone."""
    stacks = {"layers": list(range(len(types))), "attn": [i for i, t in enumerate(types) if t != X],
              "linear": [i for i, t in enumerate(types) if t == X],
              "kv": [i for i, t in enumerate(types) if t == F or (t == S and not windowed)],
              "window_kv": [i for i, t in enumerate(types) if t == S and windowed]}
    stacks["conv"] = stacks["recurrent"] = stacks["linear"]
    return {name: layers for name, layers in stacks.items() if layers}


def misplaced(plan, types, windowed) -> list[str]:
    """Every (layer, stack) whose scan-step index names another layer's entry."""
    stacks, p, bad = by_hand(types, windowed), len(plan.layers), []
    for i in range(plan.periods):
        for j, lp in enumerate(plan.layers):
            uses = [("layers", lp.layer), (lp.group, lp.weights)] + [(name, lp.pool) for name in lp.pools]
            bad += [f"layer {i * p + j} in {name}" for name, at in uses
                    if stacks[name][at.index(i):at.index(i) + 1] != [i * p + j]]
    return bad


@pytest.mark.parametrize("types", MIXES)
@pytest.mark.parametrize("windowed", [False, True])
def test_each_layer_reads_its_own_stack_entry(types, windowed):
    cfg = config(types)
    plan = layer_plan(cfg, windowed)
    assert plan.periods * len(plan.layers) == len(types)
    assert misplaced(plan, types, windowed) == []
    stacks = by_hand(types, windowed)
    assert {name: list(plan.pool_layers(name)) for name in plan.pool_names()} == {
        name: stacks[name] for name in ("kv", "window_kv", "conv", "recurrent") if name in stacks}
    for group in ("layers", "attn", "linear"):
        assert list(stack_layers(f"{group}.w", cfg)) == stacks.get(group, [])
    shapes = pool_shapes(cfg, 5, 4, window_blocks=3 if windowed else 0, state_slots=2)
    assert {name: shape[0] for name, shape in shapes.items()} == {name: len(plan.pool_layers(name))
                                                                 for name in plan.pool_names()}


def test_control_a_stride_of_the_whole_period_misplaces_layers():
    """Linear layers indexed at step * (layers per period) + rank, the "layers" stride instead of their own
    stack's, read another layer's weights from the second period on: the check sees it."""
    types = (X, X, X, F) * 2
    plan = layer_plan(config(types), windowed=False)
    wrong = dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(lp, weights=Stacked(lp.weights.rank, len(plan.layers))) if lp.kind == X else lp
        for lp in plan.layers))
    assert misplaced(wrong, types, windowed=False) == ["layer 4 in linear", "layer 5 in linear", "layer 6 in linear"]


D_, P_ = DENSE, SPARSE
MLP_MIXES = [((F,) * 3, (D_, P_, P_)), ((F,) * 4, (P_, D_) * 2), ((S, F) * 2, (D_, P_, P_, P_)),
             ((X, X, X, F) * 2, (P_, D_, P_, P_) * 2), ((F,) * 4, (D_, D_, P_, P_))]


def mlp_misplaced(plan, mlps) -> list[str]:
    """Every layer whose MLP slots' scan-step index names another layer's entry in its kind's stack."""
    stacks = {kind: [i for i, t in enumerate(mlps) if t == kind] for kind in (D_, P_)}
    p, bad = len(plan.layers), []
    for i in range(plan.periods):
        for j, lp in enumerate(plan.layers):
            at = lp.mlp_weights.index(i)
            if lp.mlp != mlps[i * p + j] or stacks[lp.mlp][at:at + 1] != [i * p + j]:
                bad.append(f"layer {i * p + j} in {lp.mlp}")
    return bad


@pytest.mark.parametrize("types, mlps", MLP_MIXES)
def test_each_mlp_reads_its_own_kind_stack_entry(types, mlps):
    """Dense and sparse MLP layers mixed: the norms stack every layer, each MLP slot only the layers of its kind
    (tlaloc_jax.plan.MLP_SLOTS), and each layer of each scan step reads its own entry of its kind's stack."""
    cfg = config(types, mlps)
    plan = layer_plan(cfg, windowed=False)
    assert mlp_misplaced(plan, mlps) == []
    assert list(stack_layers("layers.gate_proj", cfg)) == [i for i, t in enumerate(mlps) if t == D_]
    assert list(stack_layers("layers.expert_down", cfg)) == list(stack_layers("layers.router", cfg)) == [
        i for i, t in enumerate(mlps) if t == P_]
    assert list(stack_layers("layers.mlp_norm", cfg)) == list(range(len(types)))
    assert cfg.moe and cfg.dense_mlp


def test_control_mlp_slots_indexed_as_the_norms_misplace():
    """MLP slots indexed with the norms' place (every layer's stride) read another layer's MLP: the check sees it."""
    types, mlps = (X, X, X, F) * 2, (P_, D_, P_, P_) * 2
    plan = layer_plan(config(types, mlps), windowed=False)
    wrong = dataclasses.replace(plan, layers=tuple(dataclasses.replace(lp, mlp_weights=lp.layer) for lp in plan.layers))
    assert mlp_misplaced(wrong, mlps) != []
