"""Routed experts (a sparse mixture of experts): the experts in a gathered form for few tokens and a grouped
form for many, a custom_vjp, and a dense reference.

Dimensions (docs/glossary.md): B, T, E as everywhere; X experts, J experts chosen per token (the router's
top-k), F an expert's hidden size; in the grouped form, R rows in tiles of Tr rows. Einsum letters: n (a
token of the flattened B * T), j, x, e, f, r.

Routing (the router's scores, the choice of J experts and their weights) is moe_routing.py's.

Experts. Expert i maps a token x [E] to

    "silu"              down_i(silu(x Wg_i) * (x Wu_i))                   SwiGLU (Qwen3-MoE, Mixtral, Qwen3-Next)
    "swiglu_clamped"    g = min(x Wg_i + bg_i, limit), u = clip(x Wu_i + bu_i, -limit, limit),
                        down_i((u + 1) * g * sigmoid(alpha g)) + bd_i    GPT-OSS

(a bias only where the family has it), and the token's output is sum_j w_j expert_{idx_j}(x). Expert weights
are stacked [X, E, F] (gate, up) and [X, F, E] (down), linears [in, out]. A shared expert (Qwen3-Next) is a
dense SwiGLU every token runs, scaled by sigmoid(x Ws), added to the routed sum.

Two forms of the routed sum, chosen by the call's static size (`gathered_form`):

- gathered (few tokens: B T J <= X, a decode step): a while loop over the live tokens' (token, expert)
  pairs reads each chosen expert's weights in place (a dynamic slice) and runs [1, E] x [E, F] products. No
  expert that no token chose is read, and what is read is never more than all X experts. (A gather of the
  chosen weights into [BT, J, E, F] for one batched product measured twice as slow on CPU: it writes a copy of
  everything it reads.)
- grouped (prefill, training): the B T J (token, expert) assignments are sorted by expert (a stable argsort);
  each expert's run of rows is padded to whole tiles of Tr rows, so a tile holds one expert's tokens; a
  while loop over the tiles in use reads the tile's expert's weights in place and runs [Tr, E] x [E, F]
  products. Experts no token chose cost nothing; padding tokens (valid False) are not laid out.

jax.lax.ragged_dot is the textbook grouped matmul, but on CPU it lowers to a dense masked product over all X
experts (X / J times the arithmetic of this form), so it is not used.

`routed_experts` carries a custom_vjp whose backward runs the grouped form tile by tile (recomputing each
tile's activations rather than saving them): dx, the experts' weight and bias gradients, and the routing
weights' gradient, from which jax differentiates the router. The chosen indices are integers: no gradient.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

# MoeSpec and the router's functions are this module's API too (tlaloc_jax.kernels.moe names them).
from .moe_routing import (HIGHEST, MoeSpec, as_f32, reference_choice, route, router_logits,  # noqa: F401
                          router_margins, weight_dot)

# The grouped form's largest tile: [Tr, E] x [E, F] products of 64 rows keep CPU matmuls efficient while an
# expert's last tile wastes at most 63 rows.
MAX_TILE = 64


def activation(spec: MoeSpec, g: jax.Array, u: jax.Array) -> jax.Array:
    """The experts' gated activation: g, u [..., F] (gate and up projections, biases added) -> [..., F]."""
    if spec.activation == "silu":
        return jax.nn.silu(g) * u
    g = jnp.minimum(g, spec.limit)
    u = jnp.clip(u, -spec.limit, spec.limit)
    return (u + 1.0) * (g * jax.nn.sigmoid(spec.alpha * g))


# --- the grouped form ---------------------------------------------------------------------------------


def gathered_form(tokens: int, spec: MoeSpec) -> bool:
    """Whether a call of `tokens` tokens (B * T, static) runs the gathered form: when its J chosen experts per
    token, all distinct, are at most the X experts."""
    return tokens * spec.top_k <= spec.experts


def tile_rows(assignments: int, experts: int) -> int:
    """Tr: a power of two near the mean rows per expert, at most MAX_TILE."""
    mean = -(-assignments // experts)
    return min(MAX_TILE, 1 << max(0, (mean - 1).bit_length()))


class GroupedRows:
    """Rows of the grouped form: the assignments (a = n * J + j) sorted by expert, each expert's run padded
    to whole tiles of Tr rows. Padding rows hold assignment A (= none).

    row_assignment: [R] int32, the assignment on each row (A: none); assignment_row: [A] int32, the row of
    each assignment (R: none, a padding token's); tile_expert: [R / Tr] int32, the expert of each tile;
    used: int32 scalar, the tiles in use (the first `used` tiles).
    """

    def __init__(self, idx: jax.Array, live: jax.Array, experts: int):
        A = idx.size
        X = experts
        self.tile = Tr = tile_rows(A, X)
        # At most floor((A + m (Tr - 1)) / Tr) tiles, m = min(X, A) experts in use, each wasting < Tr rows.
        tiles = (A + min(X, A) * (Tr - 1)) // Tr
        self.rows = R = tiles * Tr
        e = jnp.where(live, idx, X).reshape(A)                        # X: a padding token's, laid out nowhere
        order = jnp.argsort(e, stable=True).astype(jnp.int32)         # assignments by expert
        sorted_e = e[order]
        counts = jnp.zeros(X + 1, jnp.int32).at[e].add(1)[:X]
        first = jnp.cumsum(counts) - counts                           # each expert's first place in `order`
        tiles_of = (counts + Tr - 1) // Tr
        tile_end = jnp.cumsum(tiles_of)
        start_row = (tile_end - tiles_of) * Tr
        e_c = jnp.minimum(sorted_e, X - 1)
        rank = jnp.arange(A, dtype=jnp.int32) - first[e_c]
        row = jnp.where(sorted_e < X, start_row[e_c] + rank, R)
        self.row_assignment = jnp.full(R, A, jnp.int32).at[row].set(order, mode="drop")
        self.assignment_row = jnp.zeros(A, jnp.int32).at[order].set(row)
        self.tile_expert = jnp.sum(tile_end[None, :] <= jnp.arange(tiles, dtype=jnp.int32)[:, None],
                                   axis=1).astype(jnp.int32)
        self.used = tile_end[-1]

    def rows_of(self, per_assignment: jax.Array) -> jax.Array:
        """[A, ...] -> [R, ...]: each row's assignment's entry (zeros on padding rows)."""
        return per_assignment.at[self.row_assignment].get(mode="fill", fill_value=0)

    def assignments_of(self, per_row: jax.Array) -> jax.Array:
        """[R, ...] -> [A, ...]: each assignment's row (zeros for a padding token's)."""
        return per_row.at[self.assignment_row].get(mode="fill", fill_value=0)


def _expert_weights(experts: dict, layer, i) -> dict:
    """Expert i's weights and biases, read in place (a dynamic slice) from the stacked [X, ...] arrays, or from
    [L, X, ...] at `layer`. (Slicing the layer first, w[layer][i], makes XLA copy all X experts of the layer.)"""
    if layer is None:
        return {k: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), v)
                for k, v in experts.items()}
    # A quantized expert's codes and scales are sliced alike (kernels.quantized_matmul.QuantizedWeight).
    return {k: jax.tree.map(lambda a: lax.dynamic_slice(a, (layer, i) + (0,) * (a.ndim - 2),
                                                        (1, 1) + a.shape[2:])[0, 0], v)
            for k, v in experts.items()}


def _expert_pre(x: jax.Array, w: dict) -> tuple[jax.Array, jax.Array]:
    """x: [r, E] -> the gate and up projections [r, F] of one expert, biases added."""
    g, u = weight_dot("re,ef->rf", x, w["gate"]), weight_dot("re,ef->rf", x, w["up"])
    if "gate_bias" in w:
        g, u = g + as_f32(w["gate_bias"]), u + as_f32(w["up_bias"])
    return g, u


def _expert_out(h: jax.Array, w: dict) -> jax.Array:
    y = weight_dot("rf,fe->re", h, w["down"])
    return y + as_f32(w["down_bias"]) if "down_bias" in w else y


def _expert(spec: MoeSpec, x: jax.Array, w: dict) -> jax.Array:
    """x: [r, E] -> [r, E], one expert on r tokens."""
    return _expert_out(activation(spec, *_expert_pre(x, w)), w)


def _grouped_forward(spec: MoeSpec, x: jax.Array, grouped: GroupedRows, experts: dict, layer) -> jax.Array:
    """x: [N, E] -> each assignment's expert output [A, E] (zeros for padding tokens)."""
    Tr, J = grouped.tile, spec.top_k
    xr = x.at[grouped.row_assignment // J].get(mode="fill", fill_value=0)      # [R, E]

    def tile(i, y):
        w = _expert_weights(experts, layer, grouped.tile_expert[i])
        yt = _expert(spec, lax.dynamic_slice_in_dim(xr, i * Tr, Tr), w)
        return lax.dynamic_update_slice_in_dim(y, yt, i * Tr, axis=0)

    y = lax.fori_loop(0, grouped.used, tile, jnp.zeros(xr.shape, jnp.float32))
    return grouped.assignments_of(y)


def _gathered_forward(spec: MoeSpec, x: jax.Array, idx: jax.Array, live: jax.Array, experts: dict,
                      layer) -> jax.Array:
    """x: [N, E], idx: [N, J], live: [N, J] -> each assignment's expert output [A, E]: a while loop over the live
    (token, expert) pairs, each reading its expert's weights in place. Only the chosen experts are read, and
    none is copied (a gather of [N, J, E, F] would write what it reads: twice the bytes on CPU)."""
    N, E = x.shape
    J = spec.top_k
    A = N * J
    flat = live.reshape(A)
    # The live assignments, in order (entries past them unused).
    pairs = jnp.zeros(A, jnp.int32).at[jnp.where(flat, jnp.cumsum(flat) - 1, A)].set(
        jnp.arange(A, dtype=jnp.int32), mode="drop")

    def pair(p, y):
        a = pairs[p]
        n = a // J
        w = _expert_weights(experts, layer, idx.reshape(A)[a])
        yt = _expert(spec, lax.dynamic_slice_in_dim(x, n, 1), w)
        return lax.dynamic_update_slice_in_dim(y, yt, a, axis=0)

    return lax.fori_loop(0, jnp.sum(flat), pair, jnp.zeros((A, E), jnp.float32))


# --- the routed sum with its custom_vjp ---------------------------------------------------------------


def routed_experts(spec: MoeSpec, x: jax.Array, idx: jax.Array, weights: jax.Array, experts: dict,
                   valid: jax.Array | None = None, layer=None, first_expert=0) -> jax.Array:
    """sum_j weights[..., j] * expert_{idx[..., j]}(x).

    x: [B, T, E]; idx: [B, T, J] int32; weights: [B, T, J] f32; experts: {"gate": [X, E, F], "up": [X, E, F],
    "down": [X, F, E]} and, with biases, {"gate_bias": [X, F], "up_bias": [X, F], "down_bias": [X, E]}, or
    each stacked over layers [L, X, ...] with `layer` (int or int32 scalar) the one to use; valid: [B, T] bool
    or None (all live); a padding token's output is 0. -> [B, T, E] f32.
    first_expert (int or int32 scalar): experts holds experts first_expert .. first_expert + X' - 1 of the
    router's (a tensor-parallel shard's); the sum then runs over the chosen experts it holds, and the sums of
    the shards add up to the whole. Differentiable in x, weights and experts (custom_vjp).
    """
    lead, E = x.shape[:-1], x.shape[-1]
    N = math.prod(lead)
    J = spec.top_k
    live = jnp.ones(lead, bool) if valid is None else valid.astype(bool)
    idx = idx.reshape(N, J)
    live = jnp.broadcast_to(live.reshape(N, 1), (N, J))
    held = _held(experts)
    if not (isinstance(first_expert, int) and first_expert == 0 and held == spec.experts):
        idx = idx - first_expert
        mine = (idx >= 0) & (idx < held)
        live, idx = live & mine, jnp.where(mine, idx, 0)
    layer = None if layer is None else jnp.asarray(layer, jnp.int32)
    out = _routed(spec, x.reshape(N, E), idx, weights.reshape(N, J), live, experts, layer)
    return out.reshape(*lead, E)


def _held(experts: dict) -> int:
    """X': the experts `experts` holds (all X, or a tensor-parallel shard's)."""
    return jax.tree.leaves(experts["down"])[0].shape[-3]


def _routed_forward(spec, x, idx, weights, live, experts, layer):
    """live: [N, J], the assignments to run (a padding token's, and on a shard those of experts it lacks, not)."""
    N = x.shape[0]
    J = spec.top_k
    if gathered_form(N, spec):
        y = _gathered_forward(spec, x, idx, live, experts, layer)
    else:
        y = _grouped_forward(spec, x, GroupedRows(idx, live, _held(experts)), experts, layer)
    # Select, not multiply: a padding token's rows are never computed and hold zeros, but say so here.
    y = jnp.where(live.reshape(N * J)[:, None], y, 0.0)
    w = jnp.where(live, weights.astype(jnp.float32), 0.0)
    return jnp.einsum("nj,nje->ne", w, y.reshape(N, J, -1), precision=HIGHEST), y


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _routed(spec, x, idx, weights, live, experts, layer):
    return _routed_forward(spec, x, idx, weights, live, experts, layer)[0]


def _routed_fwd(spec, x, idx, weights, live, experts, layer):
    out, y = _routed_forward(spec, x, idx, weights, live, experts, layer)
    return out, (x, idx, weights, live, experts, layer, y)


def _routed_bwd(spec, residuals, d_out):
    """The grouped form tile by tile, whatever form ran forward: recompute the tile's gate and up
    projections, then dWd = h^T dy, dh = dy Wd^T, (dg, du) through the activation, dWg = x^T dg,
    dWu = x^T du, dx = dg Wg^T + du Wu^T; each tile's dx rows are summed back to their tokens."""
    x, idx, weights, live, experts, layer, y = residuals
    N, E = x.shape
    J = spec.top_k
    d_out = d_out.astype(jnp.float32)
    d_weights = jnp.einsum("ne,nje->nj", d_out, y.reshape(N, J, E), precision=HIGHEST)
    d_weights = jnp.where(live, d_weights, 0.0)
    dy = jnp.where(live[..., None], weights.astype(jnp.float32)[..., None] * d_out[:, None, :], 0.0)
    grouped = GroupedRows(idx, live, _held(experts))
    Tr = grouped.tile
    xr = x.at[grouped.row_assignment // J].get(mode="fill", fill_value=0).astype(jnp.float32)
    dyr = grouped.rows_of(dy.reshape(N * J, E))

    def tile(i, carry):
        dx_rows, grads = carry
        e = grouped.tile_expert[i]
        w = _expert_weights(experts, layer, e)
        xt = lax.dynamic_slice_in_dim(xr, i * Tr, Tr)
        dyt = lax.dynamic_slice_in_dim(dyr, i * Tr, Tr)
        h, act_vjp = jax.vjp(functools.partial(activation, spec), *_expert_pre(xt, w))
        dg, du = act_vjp(jnp.einsum("re,fe->rf", dyt, as_f32(w["down"]), precision=HIGHEST))
        tile_grads = {"down": jnp.einsum("rf,re->fe", h, dyt, precision=HIGHEST),
                      "gate": jnp.einsum("re,rf->ef", xt, dg, precision=HIGHEST),
                      "up": jnp.einsum("re,rf->ef", xt, du, precision=HIGHEST),
                      "down_bias": jnp.sum(dyt, axis=0), "gate_bias": jnp.sum(dg, axis=0),
                      "up_bias": jnp.sum(du, axis=0)}
        dxt = (jnp.einsum("rf,ef->re", dg, as_f32(w["gate"]), precision=HIGHEST)
               + jnp.einsum("rf,ef->re", du, as_f32(w["up"]), precision=HIGHEST))
        at = e if layer is None else (layer, e)
        grads = {k: g.at[at].add(tile_grads[k]) for k, g in grads.items()}
        return lax.dynamic_update_slice_in_dim(dx_rows, dxt, i * Tr, axis=0), grads

    grads = {k: jnp.zeros(v.shape, jnp.float32) for k, v in experts.items()}
    dx_rows, grads = lax.fori_loop(0, grouped.used, tile, (jnp.zeros(xr.shape, jnp.float32), grads))
    # Padding rows carry token N (assignment A, A // J = N): dropped.
    dx = jnp.zeros((N, E), jnp.float32).at[grouped.row_assignment // J].add(dx_rows, mode="drop")
    return (dx.astype(x.dtype), None, d_weights.astype(weights.dtype), None,
            {k: g.astype(experts[k].dtype) for k, g in grads.items()}, None)


_routed.defvjp(_routed_fwd, _routed_bwd)


# --- the layer ----------------------------------------------------------------------------------------


def shared_expert(x: jax.Array, shared: dict) -> jax.Array:
    """A shared expert: down(silu(x Wg) * (x Wu)), times sigmoid(x Ws) where it has a gate (Qwen3-Next; DeepSeek's
    has none). x: [..., E]; shared: "gate", "up" [E, Fs], "down" [Fs, E], and "gate_proj" [E, 1] or not -> [..., E]."""
    h = jax.nn.silu(weight_dot("...e,ef->...f", x, shared["gate"])) * weight_dot("...e,ef->...f", x, shared["up"])
    out = weight_dot("...f,fe->...e", h, shared["down"])
    return jax.nn.sigmoid(weight_dot("...e,eo->...o", x, shared["gate_proj"])) * out if "gate_proj" in shared else out


def moe(spec: MoeSpec, x: jax.Array, router: jax.Array, experts: dict, *, router_bias: jax.Array | None = None,
        correction: jax.Array | None = None, shared: dict | None = None, valid: jax.Array | None = None,
        layer=None, first_expert=0) -> jax.Array:
    """A mixture-of-experts MLP: route, the routed sum, and the shared expert where there is one.

    x: [B, T, E]; router: [E, X]; router_bias: [X] or None (added to the logits: GPT-OSS); correction: [X] or
    None (DeepSeek's bias for the choice only); experts (and layer, first_expert) as routed_experts; shared as
    shared_expert, or None; valid: [B, T] bool or None. -> [B, T, E] f32.
    """
    idx, w = route(spec, router_logits(x, router, router_bias), correction)
    out = routed_experts(spec, x, idx, w, experts, valid, layer, first_expert)
    if shared is not None:
        out = out + shared_expert(x, shared)
    return out if valid is None else jnp.where(valid[..., None], out, 0.0)


# --- reference ----------------------------------------------------------------------------------------


def moe_reference(spec: MoeSpec, x: jax.Array, router: jax.Array, experts: dict, *,
                  router_bias: jax.Array | None = None, correction: jax.Array | None = None,
                  shared: dict | None = None, valid: jax.Array | None = None) -> jax.Array:
    """Dense, for tests and the bench's baseline: every expert runs on every token, and a [B, T, X] weight that
    is zero off each token's J chosen experts sums them. Same arguments and result as moe."""
    logits = jnp.einsum("bte,ex->btx", x, as_f32(router), precision=HIGHEST)
    if router_bias is not None:
        logits = logits + as_f32(router_bias)
    X = spec.experts
    chosen = reference_choice(spec, logits, correction)                                   # [B, T, X]
    if spec.scoring == "sigmoid":
        dense = jnp.where(chosen, jax.nn.sigmoid(logits), 0.0)
    else:
        scores = jnp.where(chosen | (spec.scoring == "softmax"), logits, -jnp.inf)
        dense = jnp.where(chosen, jax.nn.softmax(scores, axis=-1), 0.0)
    if spec.normalize and spec.scoring != "topk_softmax":
        guard = 1e-20 if spec.scoring == "sigmoid" else 0.0
        dense = dense / (jnp.sum(dense, axis=-1, keepdims=True) + guard)
    dense = dense * spec.scale
    f = {k: as_f32(v) for k, v in experts.items()}
    # Every expert on every token: tokens broadcast along X, so each product is a batch of X plain matmuls
    # (contracting "bte,xef" directly makes XLA transpose all the experts' weights first on CPU).
    xs = jnp.broadcast_to(x[None], (X, *x.shape))                                              # [X, B, T, E]
    g = jnp.einsum("xbte,xef->xbtf", xs, f["gate"], precision=HIGHEST)
    u = jnp.einsum("xbte,xef->xbtf", xs, f["up"], precision=HIGHEST)
    if "gate_bias" in f:
        g, u = g + f["gate_bias"][:, None, None], u + f["up_bias"][:, None, None]
    y = jnp.einsum("xbtf,xfe->xbte", activation(spec, g, u), f["down"], precision=HIGHEST)
    if "down_bias" in f:
        y = y + f["down_bias"][:, None, None]
    out = jnp.einsum("btx,xbte->bte", dense, y, precision=HIGHEST)
    if shared is not None:
        s = {k: as_f32(v) for k, v in shared.items()}
        h = jax.nn.silu(jnp.einsum("bte,ef->btf", x, s["gate"], precision=HIGHEST)) * jnp.einsum(
            "bte,ef->btf", x, s["up"], precision=HIGHEST)
        y = jnp.einsum("btf,fe->bte", h, s["down"], precision=HIGHEST)
        if "gate_proj" in s:
            y = jax.nn.sigmoid(jnp.einsum("bte,eo->bto", x, s["gate_proj"], precision=HIGHEST)) * y
        out = out + y
    if valid is not None:
        out = jnp.where(valid[..., None], out, 0.0)
    return out
