"""The routed-experts op (tlaloc_jax/kernels/moe.py) against its dense reference: every router scoring, both expert
activations, the gathered (decode) and grouped (prefill) forms, padding tokens, and the custom_vjp's gradients.

Routing near-ties. Which experts a token gets is discontinuous in the router's logits: two correct computations
whose logits differ by rounding choose differently where the J-th and (J + 1)-th logits are that close, and then
their outputs differ by O(1), not by rounding. Every comparison here therefore first checks its own inputs:
the smallest router margin (kernels.moe.router_margins) must exceed twice the tolerance model's bound on the
router logits (an E-term dot), so both sides provably choose the same experts and the rest is rounding.
The seeds below give margins thousands of times that bound; a seed that did not would fail the precondition
with its own message, not a mismatch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from margins import assert_within
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.moe import (GroupedRows, MoeSpec, gathered_form, moe, moe_reference, route, router_logits,
                                    router_margins, tile_rows)
from tlaloc_jax.kernels.tolerances import relative_error

pytestmark = pytest.mark.numeric

E, F, FS = 24, 20, 12        # hidden, an expert's hidden, the shared expert's hidden

SPECS = {
    "qwen3_moe": MoeSpec(experts=8, top_k=2, scoring="softmax", normalize=False),
    "mixtral": MoeSpec(experts=8, top_k=2, scoring="softmax", normalize=True),
    "gpt_oss": MoeSpec(experts=8, top_k=3, scoring="topk_softmax", activation="swiglu_clamped", limit=1.5),
    "sigmoid": MoeSpec(experts=16, top_k=4, scoring="sigmoid", normalize=True),
}
BIASED = {"gpt_oss"}         # router and expert biases
SHARED = {"qwen3_moe"}       # a shared expert (Qwen3-Next's), here on the softmax router

# (B, T): a decode batch (B T J <= X: the gathered form) and an odd prefill length (grouped) under make test;
# one token, and a longer prefill, under make test-slow.
SHAPES = [pytest.param((1, 1), marks=pytest.mark.slow), (4, 1), (2, 37), pytest.param((3, 64), marks=pytest.mark.slow)]


def make_params(name: str, seed: int = 0):
    """Router, experts and shared expert of one spec, scaled so activations are O(1) and the clamp bites."""
    spec = SPECS[name]
    rng = np.random.default_rng(seed)
    X = spec.experts

    def normal(shape, scale):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    experts = {"gate": normal((X, E, F), 0.5), "up": normal((X, E, F), 0.5), "down": normal((X, F, E), 0.3)}
    router_bias = None
    if name in BIASED:
        experts.update(gate_bias=normal((X, F), 0.3), up_bias=normal((X, F), 0.3), down_bias=normal((X, E), 0.3))
        router_bias = normal((X,), 0.3)
    shared = None
    if name in SHARED:
        shared = {"gate": normal((E, FS), 0.3), "up": normal((E, FS), 0.3), "down": normal((FS, E), 0.3),
                  "gate_proj": normal((E, 1), 0.3)}
    return spec, dict(router=normal((E, X), 0.5), experts=experts, router_bias=router_bias, shared=shared)


def make_tokens(shape, seed: int, padding: float = 0.25):
    """x [B, T, E] and valid [B, T] (a quarter padding; padding tokens hold NaN, which must never be read)."""
    rng = np.random.default_rng(seed)
    valid = rng.random(shape) >= padding
    valid.flat[0] = True
    x = rng.standard_normal((*shape, E)).astype(np.float32)
    x[~valid] = np.nan
    return jnp.asarray(x), jnp.asarray(valid)


def bound_of(spec, params):
    return tol.bound(tol.moe_roundings(hidden=E, expert_hidden=F, experts=spec.experts, top_k=spec.top_k,
                                       shared_hidden=FS if params["shared"] is not None else 0))


def assert_routing_is_decided(spec, params, x, valid):
    """The precondition of every comparison: no live token's choice is within rounding of a tie."""
    logits = np.asarray(router_logits(x, params["router"], params["router_bias"]))[np.asarray(valid)]
    margins = np.asarray(router_margins(spec, jnp.asarray(logits)))
    need = 2 * tol.bound(E + 1) * np.abs(logits).max()
    assert margins.min() > need, (f"router margin {margins.min():.3g} is within rounding ({need:.3g}) of a tie: "
                                  "choose another seed")


def live_part(out, valid):
    return np.asarray(out)[np.asarray(valid)]


fast = jax.jit(moe, static_argnums=(0,))
reference = jax.jit(moe_reference, static_argnums=(0,))


@pytest.mark.parametrize("shape", SHAPES, ids=["B1T1", "B4T1", "B2T37", "B3T64"])
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference(name, shape):
    spec, params = make_params(name)
    x, valid = make_tokens(shape, seed=hash(shape) % 1000)
    assert_routing_is_decided(spec, params, x, valid)
    got = fast(spec, x, valid=valid, **params)
    want = reference(spec, jnp.where(valid[..., None], x, 0.0), valid=valid, **params)
    assert np.all(np.isfinite(np.asarray(got))), "a padding token's NaN reached an output"
    np.testing.assert_array_equal(np.asarray(got)[~np.asarray(valid)], 0.0)
    assert_within(relative_error(live_part(got, valid), live_part(want, valid)), bound_of(spec, params),
                  f"moe {name} {shape} ({'gathered' if gathered_form(math.prod(shape), spec) else 'grouped'})")


@pytest.mark.parametrize("shape", [(4, 1), (2, 37)], ids=["gathered", "grouped"])
def test_experts_no_token_chose_are_never_read(shape):
    """Fill the experts that no live token chose with NaN: both forms' outputs stay finite and equal the
    reference's with the real weights (the dense reference reads every expert; it would be NaN). A router
    bias keeps two experts out of every choice so the prefill has unchosen experts too."""
    spec, params = make_params("mixtral", seed=1)
    params["router_bias"] = jnp.asarray([0.0] * (spec.experts - 2) + [-30.0, -30.0])
    x, valid = make_tokens(shape, seed=3)
    assert_routing_is_decided(spec, params, x, valid)
    idx, _ = route(spec, router_logits(x, params["router"], params["router_bias"]))
    chosen = np.zeros(spec.experts, bool)
    chosen[np.unique(np.asarray(idx)[np.asarray(valid)])] = True
    assert not chosen.all(), "every expert is chosen: nothing to check"
    poisoned = {k: jnp.where(chosen.reshape(-1, *[1] * (v.ndim - 1)), v, jnp.nan)
                for k, v in params["experts"].items()}
    got = fast(spec, x, valid=valid, **{**params, "experts": poisoned})
    want = reference(spec, jnp.where(valid[..., None], x, 0.0), valid=valid, **params)
    assert np.all(np.isfinite(np.asarray(got)))
    assert_within(relative_error(live_part(got, valid), live_part(want, valid)), bound_of(spec, params),
                  f"moe with unchosen experts NaN {shape}")


def test_stacked_layers_read_in_place():
    """Experts stacked over layers [L, X, ...] with a layer index give that layer's result, in both forms."""
    spec, params = make_params("gpt_oss", seed=2)
    other = make_params("gpt_oss", seed=5)[1]["experts"]
    stacked = {k: jnp.stack([other[k], v, other[k]]) for k, v in params["experts"].items()}
    for shape in [(4, 1), (2, 37)]:
        x, valid = make_tokens(shape, seed=7)
        one = fast(spec, x, valid=valid, **params)
        layered = jax.jit(moe, static_argnums=(0,))(spec, x, valid=valid, layer=jnp.int32(1),
                                                    **{**params, "experts": stacked})
        np.testing.assert_array_equal(np.asarray(layered), np.asarray(one))


def test_stacked_layers_gradient_lands_in_its_layer():
    spec, params = make_params("qwen3_moe", seed=2)
    x, valid = make_tokens((2, 37), seed=7, padding=0.0)
    stacked = {k: jnp.stack([v, v, v]) for k, v in params["experts"].items()}

    def loss(experts, layer):
        return jnp.sum(jnp.sin(moe(spec, x, params["router"], experts, shared=params["shared"], layer=layer)))

    one = jax.jit(jax.grad(loss), static_argnums=1)(params["experts"], None)
    layered = jax.jit(jax.grad(loss))(stacked, jnp.int32(1))
    for k in one:
        np.testing.assert_array_equal(np.asarray(layered[k][1]), np.asarray(one[k]))
        np.testing.assert_array_equal(np.asarray(layered[k][0]), 0.0)


@pytest.mark.parametrize("shape", [(4, 1), (2, 37)], ids=["gathered", "grouped"])
def test_bf16_experts(shape):
    """bf16 expert weights: the op rounds each expert product's input to bf16 (as tlaloc_jax.layers.linear does)
    and accumulates in f32; the reference widens the same bf16 weights to f32 and keeps f32 inputs. Two rounding
    points in bf16 (the token before the gate and up products, the activation before the down) on top of the
    f32 path. The router stays f32, so the choice is the f32 one on both sides."""
    spec, params = make_params("gpt_oss", seed=37)
    params["experts"] = {k: v.astype(jnp.bfloat16) for k, v in params["experts"].items()}
    x, valid = make_tokens(shape, seed=41)
    assert_routing_is_decided(spec, params, x, valid)
    got = fast(spec, x, valid=valid, **params)
    want = reference(spec, jnp.where(valid[..., None], x, 0.0), valid=valid, **params)
    forward = tol.moe_roundings(hidden=E, expert_hidden=F, experts=spec.experts, top_k=spec.top_k)
    bound = tol.bound({"bfloat16": 2, "float32": forward})
    assert_within(relative_error(live_part(got, valid), live_part(want, valid)), bound, f"moe bf16 experts {shape}")
    # Control: the f32 bound is too tight for bf16 experts (the rounding is real and seen).
    assert relative_error(live_part(got, valid), live_part(want, valid)) > tol.bound(forward)


# --- the reference itself ------------------------------------------------------------------------------


def test_reference_hand_worked():
    """Three experts with one hidden unit each, E = 1, x = 1: router logits 0, ln 3, ln 6 give softmax
    weights 1/10, 3/10, 6/10; the top 2 are experts 2 and 1. Expert i's output is silu(g_i) u_i d_i."""
    g, u, d = [0.5, -1.0, 2.0], [1.0, 3.0, -0.5], [2.0, 1.0, 4.0]
    experts = {"gate": jnp.array(g).reshape(3, 1, 1), "up": jnp.array(u).reshape(3, 1, 1),
               "down": jnp.array(d).reshape(3, 1, 1)}
    router = jnp.log(jnp.array([[1.0, 3.0, 6.0]]))
    x = jnp.ones((1, 1, 1))
    silu = [gi / (1 + math.exp(-gi)) for gi in g]
    y = [s * ui * di for s, ui, di in zip(silu, u, d)]
    cases = {MoeSpec(3, 2, "softmax"): 0.6 * y[2] + 0.3 * y[1],
             MoeSpec(3, 2, "softmax", normalize=True): (6 * y[2] + 3 * y[1]) / 9,
             MoeSpec(3, 2, "topk_softmax"): (6 * y[2] + 3 * y[1]) / 9,
             MoeSpec(3, 1, "sigmoid"): (6 / 7) * y[2]}
    rtol = tol.bound(tol.moe_roundings(hidden=1, expert_hidden=1, experts=3, top_k=2))
    for spec, want in cases.items():
        for f in (moe_reference, moe):
            got = jax.jit(f, static_argnums=0)(spec, x, router, experts)
            np.testing.assert_allclose(float(got[0, 0, 0]), want, rtol=rtol, err_msg=f"{f.__name__} {spec}")


def test_reference_hand_worked_clamped_swiglu():
    """GPT-OSS's expert with limit 1: gate 3 clamps to 1, up -4 clamps to -1 (so (u + 1) = 0 kills it); gate 0.5
    and up 0.5 give 1.5 * 0.5 * sigmoid(alpha * 0.5). Biases add before the clamp and after the down."""
    spec = MoeSpec(2, 1, "topk_softmax", activation="swiglu_clamped", alpha=2.0, limit=1.0)
    experts = {"gate": jnp.array([2.0, 0.25]).reshape(2, 1, 1), "up": jnp.array([-5.0, 0.25]).reshape(2, 1, 1),
               "down": jnp.array([1.0, 2.0]).reshape(2, 1, 1), "gate_bias": jnp.array([[1.0], [0.25]]),
               "up_bias": jnp.array([[1.0], [0.25]]), "down_bias": jnp.array([[0.5], [-0.25]])}
    x = jnp.ones((1, 1, 1))
    for first, want in ((True, 0.0 + 0.5), (False, 2.0 * 1.5 * 0.5 / (1 + math.exp(-1.0)) - 0.25)):
        router = jnp.array([[1.0, -1.0]]) if first else jnp.array([[-1.0, 1.0]])
        for f in (moe_reference, moe):
            got = jax.jit(f, static_argnums=0)(spec, x, router, experts)
            np.testing.assert_allclose(float(got[0, 0, 0]), want, rtol=1e-6)


# --- gradients -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,shape", [
    (name, shape) if name in ("qwen3_moe", "gpt_oss") or shape[1] > 1 else
    pytest.param(name, shape, marks=pytest.mark.slow) for name in SPECS for shape in [(4, 1), (2, 37)]],
    ids=lambda v: v if isinstance(v, str) else ("gathered" if v[1] == 1 else "grouped"))
def test_gradient_matches_reference(name, shape):
    """jax.grad through the custom_vjp (x, the router and its bias, every expert weight and bias, the shared
    expert) against jax.grad of the dense reference."""
    spec, params = make_params(name, seed=11)
    x, valid = make_tokens(shape, seed=13, padding=0.0)
    assert_routing_is_decided(spec, params, x, valid)
    cotangent = jnp.asarray(np.random.default_rng(17).standard_normal((*shape, E)), jnp.float32)

    def loss(f):
        return lambda x, p: jnp.sum(cotangent * f(spec, x, **p))

    got = jax.jit(jax.grad(loss(moe), argnums=(0, 1)))(x, params)
    want = jax.jit(jax.grad(loss(moe_reference), argnums=(0, 1)))(x, params)
    forward = tol.moe_roundings(hidden=E, expert_hidden=F, experts=spec.experts, top_k=spec.top_k,
                                shared_hidden=FS if params["shared"] is not None else 0)
    bound = tol.bound(tol.backward_roundings(forward, math.prod(shape)))
    flat_got, flat_want = jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)
    assert len(flat_got) == len(flat_want)
    for (path, g), w in zip(flat_got, flat_want):
        what = f"moe {name} {shape} d{jax.tree_util.keystr(path)}"
        assert_within(relative_error(g, w), bound, what)


def test_padding_tokens_get_no_gradient():
    spec, params = make_params("mixtral", seed=19)
    x, valid = make_tokens((2, 37), seed=23)
    x = jnp.where(valid[..., None], x, 1.0)
    dx = jax.jit(jax.grad(lambda x: jnp.sum(moe(spec, x, valid=valid, **params))))(x)
    np.testing.assert_array_equal(np.asarray(dx)[~np.asarray(valid)], 0.0)


# --- the grouped form and what each form reads -----------------------------------------------------------


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 1), (37, 8, 2), (256, 8, 2), (300, 64, 8)])
def test_grouped_rows(tokens, experts, top_k):
    rng = np.random.default_rng(tokens)
    # Skewed routing: most tokens to a few experts, so tiles of one expert follow each other.
    idx = np.stack([rng.choice(experts, top_k, replace=False, p=np.arange(experts, 0, -1) / (experts * (experts + 1) / 2))
                    for _ in range(tokens)]).astype(np.int32)
    live = rng.random(tokens) > 0.2
    lay = GroupedRows(jnp.asarray(idx), jnp.asarray(np.repeat(live[:, None], top_k, 1)), experts)
    A, Tr = tokens * top_k, lay.tile
    assert Tr == tile_rows(A, experts) and lay.rows % Tr == 0
    row_assignment, assignment_row = np.asarray(lay.row_assignment), np.asarray(lay.assignment_row)
    tile_expert, used = np.asarray(lay.tile_expert), int(lay.used)
    flat, live_a = idx.reshape(-1), np.repeat(live, top_k)
    # Each live assignment has exactly one row, in a tile of its expert; a padding token's have none.
    assert np.all(assignment_row[~live_a] == lay.rows)
    rows = assignment_row[live_a]
    assert len(set(rows.tolist())) == rows.size and np.all(row_assignment[rows] == np.flatnonzero(live_a))
    assert np.all(tile_expert[rows // Tr] == flat[live_a])
    # Tiles in use: each expert's ceil(count / Tr), in expert order; no row past them holds an assignment.
    counts = np.bincount(flat[live_a], minlength=experts)
    assert used == int(np.sum(-(-counts // Tr)))
    assert np.all(row_assignment[used * Tr:] == A) and np.all(np.diff(tile_expert[:used]) >= 0)
    # Within an expert, assignments keep their order (a stable sort): rows follow token order.
    for e in range(experts):
        mine = np.flatnonzero(live_a & (flat == e))
        np.testing.assert_array_equal(np.sort(assignment_row[mine]), assignment_row[mine])


def _dots(eqns):
    return [e for e in eqns if e.primitive.name == "dot_general"]


def test_decode_reads_only_the_chosen_experts(jaxpr_eqns):
    """The gathered form: no product or gather touches more than one expert's [E, F] at a time (every dot has a
    2-D weight operand), experts are read by dynamic slices of the stacked [L, X, ...] arrays, and there is no
    sort. Control: the dense reference has [X, E, F] operands."""
    spec, params = make_params("qwen3_moe")
    X = spec.experts
    stacked = {k: jnp.stack([v, v]) for k, v in params["experts"].items()}
    x, valid = make_tokens((4, 1), seed=1)
    eqns = jaxpr_eqns(lambda x, ex: moe(spec, x, params["router"], ex, valid=valid, layer=1), x, stacked)
    names = {e.primitive.name for e in eqns}
    assert "sort" not in names and "while" in names
    for e in _dots(eqns):
        shapes = [v.aval.shape for v in e.invars]
        assert not any(X in s[:1] and len(s) >= 3 for s in shapes), f"an all-experts product: {shapes}"
    slices = [e for e in eqns if e.primitive.name == "dynamic_slice"]
    assert any(e.outvars[0].aval.shape == (1, 1, E, F) for e in slices)
    gathers = [e for e in eqns if e.primitive.name == "gather"]
    assert all(math.prod(e.outvars[0].aval.shape) < E * F for e in gathers)
    dense = jaxpr_eqns(lambda x, ex: moe_reference(spec, x, params["router"], ex), x, params["experts"])
    assert any(v.aval.shape[:1] == (X,) and v.aval.ndim == 3 for e in _dots(dense) for v in e.invars)


def test_prefill_groups_tokens_by_expert(jaxpr_eqns):
    """The grouped form sorts the assignments by expert and runs [Tr, E] x [E, F] products in a while loop."""
    spec, params = make_params("qwen3_moe")
    x, valid = make_tokens((2, 64), seed=1)
    eqns = jaxpr_eqns(lambda x: moe(spec, x, valid=valid, **params), x)
    assert {"sort", "while"} <= {e.primitive.name for e in eqns}
    Tr = tile_rows(2 * 64 * spec.top_k, spec.experts)
    shapes = [tuple(v.aval.shape for v in e.invars) for e in _dots(eqns)]
    assert ((Tr, E), (E, F)) in shapes and ((Tr, F), (F, E)) in shapes
    assert not any(s[:1] == (spec.experts,) and len(s) >= 3 for pair in shapes for s in pair)


def test_ragged_dot_is_still_dense_on_cpu():
    """Why the grouped form exists: jax.lax.ragged_dot lowers (on CPU) to one product over every group with the
    rows masked, [X, R, E] x [X, E, F]. When this fails, ragged_dot has become a real grouped matmul here and
    can replace the tile loop."""
    X, R = 8, 32
    text = jax.jit(lax.ragged_dot).lower(jnp.zeros((R, E)), jnp.zeros((X, E, F)),
                                         jnp.full((X,), R // X, jnp.int32)).as_text()
    assert f"tensor<{X}x{R}x{E}xf32>" in text and "dot_general" in text
