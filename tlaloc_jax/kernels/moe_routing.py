"""A mixture-of-experts layer's shape (MoeSpec) and its router: the scores, the J experts each token chooses,
and their weights.

Routing. The router scores each token's experts, logits = x Wr (+ br), keeps the J largest and weighs them:

    "softmax"       softmax over all X logits, the J chosen kept; renormalised to sum 1 with `normalize`
                    (Qwen3-MoE and Qwen3-Next with norm_topk_prob; Mixtral always)
    "topk_softmax"  softmax over the J chosen logits only (GPT-OSS): "softmax" renormalised, another way round
    "sigmoid"       sigmoid of each chosen logit; renormalised with `normalize` (DeepSeek-V3, whose
                    denominator adds 1e-20)

Every scoring is monotone in the logit, so the choice is the J largest logits (lax.top_k) whatever the
scoring: a rounding in the scores cannot reorder two experts that the logits order. DeepSeek-V3 chooses
otherwise (`grouped_choice`): a correction bias [X] is added to the sigmoid scores for the choice only, the X
experts form `groups` groups of which the `top_groups` with the largest sums of their two best biased scores
are kept, and the J best biased scores of the kept groups are chosen; the weights are the chosen experts'
unbiased scores. Every scoring's weights are then multiplied by `scale` (routed_scaling_factor; 1 elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from .quantized_matmul import QuantizedWeight, quantized_matmul

HIGHEST = lax.Precision.HIGHEST
SCORINGS = ("softmax", "topk_softmax", "sigmoid")
ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class MoeSpec:
    """The static shape of a mixture-of-experts layer (hashable: a static argument under jit)."""

    experts: int                      # X
    top_k: int                        # J
    scoring: str = "softmax"          # SCORINGS
    normalize: bool = False           # renormalise the J chosen weights to sum 1 ("softmax", "sigmoid")
    activation: str = "silu"          # ACTIVATIONS
    alpha: float = 1.702              # "swiglu_clamped": the sigmoid's gain
    limit: float = 7.0                # "swiglu_clamped": the clamp
    groups: int = 1                   # DeepSeek's n_group: the experts in `groups` groups of X / groups
    top_groups: int = 1               # DeepSeek's topk_group: the groups whose experts may be chosen
    scale: float = 1.0                # routed_scaling_factor: the weights' factor

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring {self.scoring!r} is not one of {SCORINGS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r} is not one of {ACTIVATIONS}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} must be between 1 and the {self.experts} experts")
        if self.experts % self.groups or not 1 <= self.top_groups <= self.groups:
            raise ValueError(f"{self.groups} groups must divide the {self.experts} experts and keep 1 to "
                             f"{self.groups} of them, not {self.top_groups}")
        if self.groups > 1 and (self.experts // self.groups < 2 or self.top_groups * self.experts // self.groups
                                < self.top_k):
            raise ValueError(f"{self.groups} groups of {self.experts // self.groups} experts (a group is scored by "
                             f"its two best) keeping {self.top_groups} cannot offer top_k {self.top_k}")


def weight_dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """A product with a weight: f32 at HIGHEST; a bf16 weight stays bf16 and the input is rounded to it
    (as tlaloc_jax.layers.linear). A quantized weight (x @ W specs only) is read as its codes."""
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(x, w)
    if w.dtype != jnp.float32:
        x = x.astype(w.dtype)
    return jnp.einsum(spec, x, w, precision=HIGHEST, preferred_element_type=jnp.float32)


def as_f32(w):
    return w.astype(jnp.float32)


# --- routing -----------------------------------------------------------------------------------------


def router_logits(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """x: [..., E], weight: [E, X], bias: [X] or None -> logits [..., X] f32."""
    logits = weight_dot("...e,ex->...x", x, weight)
    return logits if bias is None else logits + as_f32(bias)


def grouped_choice(spec: MoeSpec, scores: jax.Array, correction: jax.Array | None) -> jax.Array:
    """DeepSeek-V3's choice quantity: scores [..., X] (sigmoid) plus the correction bias [X], -inf outside the
    top_groups groups whose two best biased scores sum highest. -> [..., X] f32."""
    choice = scores if correction is None else scores + as_f32(correction)
    if spec.groups == 1:
        return choice
    grouped = choice.reshape(*choice.shape[:-1], spec.groups, spec.experts // spec.groups)
    group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)                              # [..., groups]
    kept = jnp.sum(jax.nn.one_hot(lax.top_k(group_scores, spec.top_groups)[1], spec.groups), axis=-2) > 0
    return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)


def route(spec: MoeSpec, logits: jax.Array, correction: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """logits: [..., X], correction: [X] or None (DeepSeek's bias for the choice, with "sigmoid") -> (idx
    [..., J] int32, the chosen experts, in descending order of the choice; weights [..., J] f32).
    Differentiable in the logits (through the chosen ones)."""
    if spec.scoring == "sigmoid" and (correction is not None or spec.groups > 1):
        scores = jax.nn.sigmoid(logits)
        idx = lax.top_k(grouped_choice(spec, scores, correction), spec.top_k)[1]
        return idx.astype(jnp.int32), _normalized(spec, jnp.take_along_axis(scores, idx, axis=-1))
    top, idx = lax.top_k(logits, spec.top_k)
    if spec.scoring == "topk_softmax":
        return idx.astype(jnp.int32), jax.nn.softmax(top, axis=-1)
    if spec.scoring == "softmax":
        # The chosen experts' probabilities: exp(top - max) / sum over all X (the max is the first chosen).
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        w = jnp.exp(top - lse)
    else:
        w = jax.nn.sigmoid(top)
    return idx.astype(jnp.int32), _normalized(spec, w)


def _normalized(spec: MoeSpec, w: jax.Array) -> jax.Array:
    """The chosen weights [..., J] renormalised with `normalize` (sigmoid: over their sum + 1e-20, DeepSeek's
    guard), times `scale`."""
    if spec.normalize:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    return w * spec.scale if spec.scale != 1.0 else w


def router_margins(spec: MoeSpec, logits: jax.Array, correction: jax.Array | None = None) -> jax.Array:
    """logits: [..., X] -> [...]: the gap a rounding would have to close to change the choice (inf with J = X):
    how far the J-th largest logit is above the (J + 1)-th; with DeepSeek's grouped choice, the least of that gap
    in the choice quantity (grouped_choice) and of how far the last kept group's score is above the next one's."""
    grouped = spec.scoring == "sigmoid" and (correction is not None or spec.groups > 1)
    values = grouped_choice(spec, jax.nn.sigmoid(logits), correction) if grouped else logits
    if spec.top_k == spec.experts:
        gap = jnp.full(logits.shape[:-1], jnp.inf, jnp.float32)
    else:
        top, _ = lax.top_k(values, spec.top_k + 1)
        gap = top[..., -2] - top[..., -1]
    if grouped and spec.top_groups < spec.groups:
        choice = jax.nn.sigmoid(logits) + (0.0 if correction is None else as_f32(correction))
        parts = choice.reshape(*choice.shape[:-1], spec.groups, spec.experts // spec.groups)
        group_top, _ = lax.top_k(jnp.sum(lax.top_k(parts, 2)[0], axis=-1), spec.top_groups + 1)
        gap = jnp.minimum(gap, group_top[..., -2] - group_top[..., -1])
    return gap


def reference_choice(spec: MoeSpec, logits: jax.Array, correction: jax.Array | None) -> jax.Array:
    """[B, T, X] -> [B, T, X] bool, the chosen experts, by sorting: the J largest logits; or DeepSeek's rule read
    literally (biased sigmoid scores; each group scored by its two best; the experts of the best top_groups
    groups ranked)."""
    X, J = spec.experts, spec.top_k
    rank = lambda v: jnp.argsort(jnp.argsort(-v, axis=-1, stable=True), axis=-1, stable=True)  # noqa: E731 (0 = best)
    if not (spec.scoring == "sigmoid" and (correction is not None or spec.groups > 1)):
        return rank(logits) < J
    choice = jax.nn.sigmoid(logits) + (0.0 if correction is None else as_f32(correction))
    per_group = choice.reshape(*choice.shape[:-1], spec.groups, X // spec.groups)
    best_two = jnp.sort(per_group, axis=-1)[..., -2:].sum(axis=-1)                          # [B, T, groups]
    kept = jnp.repeat(rank(best_two) < spec.top_groups, X // spec.groups, axis=-1)         # [B, T, X]
    return rank(jnp.where(kept, choice, -jnp.inf)) < J
