"""The layer plan against stacks listed by hand from the layer types: each layer of each scan step reads the
stack entry that holds it."""

from __future__ import annotations

import dataclasses

import pytest

from tlaloc_jax.config import FULL, LINEAR, SLIDING, DecoderConfig, RopeConfig
from tlaloc_jax.decoder import pool_shapes
from tlaloc_jax.families import stack_layers
from tlaloc_jax.plan import Stacked, layer_plan

F, S, X = FULL, SLIDING, LINEAR
MIXES = [(F,) * 3, (S,) * 3, (S, F) * 2, (S, F, S, S), (X, X, X, F) * 2, (S, F, X, S) * 2, (X, S, F), (F, S, S) * 2]


def config(types: tuple[str, ...]) -> DecoderConfig:
    return DecoderConfig(model_type="test", vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=len(types),
                         num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope=RopeConfig(),
                         layer_types=types, sliding_window=4, linear_key_heads=1, linear_key_dim=4,
                         linear_value_heads=2, linear_value_dim=4, linear_conv_kernel=4)


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
