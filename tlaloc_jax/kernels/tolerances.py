"""The tolerance model: every numeric test's bound, derived from the dtype's unit roundoff and the number of
roundings between the inputs and the compared value, never from a number that one machine printed.

Why a model. XLA's CPU code and torch's CPU kernels change with the instruction set (AVX, AVX2, AVX-512,
AVX512-BF16, AMX, Arm NEON/SVE): sums are blocked and vectorised in another order, transcendental
functions use other polynomials, bf16 rounds at other points. Two correct computations of the same math
then differ by their rounding errors, and a bound read off one machine's output fails on the next.

The model (first order, as in Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., ch. 2-4,
and Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019):

* Every floating-point operation rounds its exact result x to x (1 + d), |d| <= u, the dtype's unit
  roundoff (2^-24 for f32, 2^-8 for bf16). Round-to-nearest makes d close to uniform on [-u, u]: mean
  zero, standard deviation u / sqrt(3); roundings at different operations are treated as independent.
* A value at the end of a path of N roundings then carries a relative error of standard deviation
  u sqrt(N / 3). Counting: an n-term sum or dot product is n roundings (its rounded partial sums give a
  relative error of standard deviation about u sqrt(n / 3) for terms of one sign, u sqrt(n / 2) for random
  signs); an elementwise op is one; a transcendental function is TRANSCENDENTAL_ULPS; rounding a whole
  tensor to a narrower dtype (bf16 keys in a pool, a projection's bf16 input) is one rounding point,
  since the independent errors of its elements average out in the sums that read them. Two computations of the same math that round differently
  (another order, another kernel) differ by at most the sum of their errors: a standard deviation of
  u sqrt(2 N / 3) relative to the value's scale.
* A test compares many values and must pass on every machine, so the bound is CONFIDENCE standard
  deviations: `bound = CONFIDENCE * u * sqrt(2 N / 3)`. The scale is the largest |expected| of the
  compared tensor (`relative_error`), or its RMS for long recurrences (`relative_rms`).
* The paths here are well conditioned (normalised residual layers, softmax weights that sum to one,
  decays <= 1), so no amplification factor is applied; where one is (a triangular inverse, a backward
  pass), its test says why.

When the two sides round at different points in different dtypes (bf16 activations on one side, f32 on
the other), `bound` takes the roundings of each dtype separately and adds their variances.
The controls that every comparison keeps (a wrong axis, a ring one page short, a KV slot one off) break
the compared values by 1e-3 to 1e-1 of their scale, far above these bounds.
"""

from __future__ import annotations

import math
from typing import Mapping

import ml_dtypes
import numpy as np

# A standard normal deviate beyond 5 has probability 5.7e-7 per compared value; the counts below are
# worst-case paths, so the real spread is smaller still.
CONFIDENCE = 5.0
# exp, log, tanh, rsqrt, logistic: XLA and torch approximate them by polynomials that differ by ISA; each
# is correct to a few ulps, counted as this many roundings.
TRANSCENDENTAL_ULPS = 4


def unit_roundoff(dtype) -> float:
    """u = eps / 2 of a floating dtype: 2^-24 for float32, 2^-8 for bfloat16, 2^-11 for float16."""
    name = np.dtype(dtype).name
    info = ml_dtypes.finfo(np.dtype(name)) if name == "bfloat16" else np.finfo(np.dtype(name))
    return float(info.eps) / 2.0


def bound(roundings: Mapping[str, float] | float, dtype="float32", *, confidence: float = CONFIDENCE) -> float:
    """Relative bound on the difference of two computations of one value that round differently.

    roundings: N, the roundings on the longest path to the value in `dtype`; or {dtype name: N} when the
    path rounds in several dtypes (variances add).
    """
    if not isinstance(roundings, Mapping):
        roundings = {np.dtype(dtype).name: roundings}
    variance = sum(unit_roundoff(name) ** 2 * n for name, n in roundings.items())
    return confidence * math.sqrt(2.0 * variance / 3.0)


# -- path lengths -----------------------------------------------------------------------------------
# Each function counts the roundings on the longest path from the inputs to one output value.


def attention_roundings(head_dim: int, keys: int) -> int:
    """One attention output: a score (a head_dim dot, the scale), the softmax (max, subtract, exp, a keys-term
    sum, the divide) and the keys-term P.V sum."""
    return head_dim + 1 + 2 + TRANSCENDENTAL_ULPS + keys + 1 + keys


def attention_grad_roundings(head_dim: int, keys: int) -> int:
    """A gradient of attention: the forward recomputed, dP = dO.V and rowsum(dO * O) (head_dim-term dots),
    dS = P (dP - rowsum), and the keys-term sum of dS times K (or Q, for dK)."""
    return attention_roundings(head_dim, keys) + 2 * head_dim + 2 + keys


def latent_attention_roundings(*, latent: int, rope: int, nope: int, keys: int) -> int:
    """One output of multi-head latent attention (tlaloc_jax/kernels/mla.py), either form: the query absorbed into the latent
    (a nope-term dot) or each key expanded from it (a latent-term dot), attention over keys of latent + rope (the
    absorbed form's score, the longer), and the value's latent-term expansion (or the output's)."""
    return max(latent, nope) + attention_roundings(latent + rope, keys) + latent


def latent_attention_grad_roundings(*, latent: int, rope: int, nope: int, value: int, keys: int, heads: int,
                                    tokens: int) -> int:
    """A gradient of latent attention: the attention's backward over the expanded heads, then the expansion's:
    a latent's gradient sums every head's key and value gradients (heads * (nope + value) terms), a weight's sums
    the batch's tokens."""
    expanded = attention_grad_roundings(max(nope + rope, value), keys) + latent
    return expanded + heads * (nope + value) + tokens


def gated_delta_roundings(tokens: int, key_dim: int, chunk: int = 64) -> int:
    """A gated delta rule output or state after `tokens` tokens: each token adds to the state's chain the
    l2 norm of its key (a key_dim sum, rsqrt), its decay (exp), k^T S (a key_dim dot), v - k^T S, beta times
    it, the outer product and the add; the chunked form also solves each chunk's unit lower-triangular
    system by forward substitution, whose last row sums over every earlier one: chunk (chunk + 1) / 2 more."""
    per_token = (key_dim + 1 + TRANSCENDENTAL_ULPS) + TRANSCENDENTAL_ULPS + key_dim + 4
    c = min(tokens, chunk)
    return tokens * per_token + (key_dim + 1 + TRANSCENDENTAL_ULPS) + key_dim + c * (c + 1) // 2


def rms_norm_roundings(width: int) -> int:
    """x * rsqrt(mean(x^2) + eps) * w: a width-term sum of squares, the mean, rsqrt, two products."""
    return width + 1 + TRANSCENDENTAL_ULPS + 2


def moe_roundings(*, hidden: int, expert_hidden: int, experts: int, top_k: int, shared_hidden: int = 0) -> int:
    """One output of a mixture-of-experts MLP (tlaloc_jax/kernels/moe.py): the longer of an expert's path (its gate and up
    projections, a bias, the activation, the product, the down projection, a bias) and its routing weight's
    (the router's hidden-term dot, a bias, the softmax: exp, an experts-term sum and the divide, then the
    top_k-term renormalisation and its divide); then the weight's product and the top_k-term sum over the
    chosen experts. A shared expert runs beside them (its projections, activation, sigmoid gate and product)
    and adds one rounding. Which experts are chosen is not a rounding: two computations that choose
    differently (router logits within rounding of a tie) differ by far more than this, so a comparison holds
    only where the router's margins exceed the bound on its logits (see kernels.moe.router_margins)."""
    expert = 2 * hidden + 1 + TRANSCENDENTAL_ULPS + 1 + expert_hidden + 1
    weight = hidden + 1 + TRANSCENDENTAL_ULPS + experts + 1 + top_k + 1
    path = max(expert, weight) + 1 + top_k
    if shared_hidden:
        shared = 2 * hidden + TRANSCENDENTAL_ULPS + 1 + shared_hidden + hidden + TRANSCENDENTAL_ULPS + 1
        path = max(path, shared) + 1
    return path


def decoder_roundings(*, hidden: int, intermediate: int, heads: int, head_dim: int,
                      mixers: "list[int]", mlp: int | None = None) -> int:
    """A decoder's logit. mixers: per layer, the roundings of its token mixer (attention over its keys,
    or a linear-attention layer's conv and state chain). Each layer adds a norm, the mixer's input
    projection and rope, the mixer, its output projection and the residual, a norm, the MLP (`mlp`: its
    roundings from its normed input to its output; None: the gated MLP's gate and up projections, the
    activation, the product and the down projection) and the residual; then the final norm and the head
    (a `hidden`-term dot)."""
    if mlp is None:
        mlp = 2 * hidden + TRANSCENDENTAL_ULPS + 1 + intermediate
    per_layer = (rms_norm_roundings(hidden) + hidden + 3                 # norm, projection, rope
                 + heads * head_dim + 1                                  # output projection, residual
                 + rms_norm_roundings(hidden) + mlp + 1)                 # norm, MLP, residual
    return sum(per_layer + mixer for mixer in mixers) + rms_norm_roundings(hidden) + hidden


def decoder_roundings_of(cfg, context: int) -> int:
    """decoder_roundings for a DecoderConfig whose calls reach `context`
    positions: a full attention layer reads them all, a sliding one at most its window, a linear-attention
    layer runs its conv and carries its state over all of them. Attention sinks add a term to each softmax's
    sum; projection biases and YaRN's scaled rotation add a rounding each, Granite's multipliers a few; latent
    attention counts latent_attention_roundings and its projections; mixture-of-experts MLPs count
    moe_roundings instead of the gated MLP's (the longer of the two where dense layers mix with them)."""
    mixers = []
    sinks = 1 if cfg.attention.sinks else 0
    extra = (2 * int(cfg.attention.bias) + int(cfg.rope.attention_factor != 1.0)
             + 3 * int(cfg.residual.multiplier != 1.0 or cfg.residual.embedding_multiplier != 1.0))
    for layer_type in cfg.layer_types:
        if layer_type == "linear_attention":
            conv = cfg.linear.conv_kernel + 1 + TRANSCENDENTAL_ULPS + 2
            mixers.append(conv + gated_delta_roundings(context, cfg.linear.key_dim)
                          + rms_norm_roundings(cfg.linear.value_dim) + TRANSCENDENTAL_ULPS + 2)
        elif cfg.mla.kv_lora_rank:
            # Latent attention: the query's bottleneck (a dot and a norm), the latent's norm, the op, and the
            # output projection's heads * v_head_dim inputs.
            q = cfg.mla.q_lora_rank + rms_norm_roundings(cfg.mla.q_lora_rank) if cfg.mla.q_lora_rank else 0
            mixers.append(q + rms_norm_roundings(cfg.mla.kv_lora_rank) + cfg.num_heads * cfg.mla.v_head_dim + extra
                          + latent_attention_roundings(latent=cfg.mla.kv_lora_rank, rope=cfg.head_dim,
                                                       nope=cfg.mla.qk_nope_head_dim, keys=context))
        else:
            keys = min(context, cfg.sliding_window) if layer_type == "sliding_attention" else context
            mixers.append(attention_roundings(cfg.head_dim, keys + sinks) + extra)
    mlp = None
    if cfg.experts.num_experts:
        # Sigmoid scoring (and DeepSeek's routed_scaling_factor) rounds less than the softmax counted here.
        mlp = moe_roundings(hidden=cfg.hidden_size, expert_hidden=cfg.experts.intermediate_size,
                            experts=cfg.experts.num_experts, top_k=cfg.experts.experts_per_token,
                            shared_hidden=cfg.experts.shared_intermediate_size)
        if "dense" in cfg.mlp_types:     # dense layers among them: the longer of the two paths
            mlp = max(mlp, 2 * cfg.hidden_size + TRANSCENDENTAL_ULPS + 1 + cfg.intermediate_size)
    return decoder_roundings(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, heads=cfg.num_heads,
                             head_dim=cfg.head_dim, mixers=mixers, mlp=mlp)


def lora_roundings(cfg, rank: int) -> int:
    """What LoRA adapters on every projection of every layer add to decoder_roundings_of's path, against the
    adapter merged into the weights (W + scale B A): per projection of I inputs, x A (I terms), its product with B
    (rank terms), the scale and the add; per layer the longest such chain of the attention's input projection, its
    output projection (a linear-attention layer's may be wider), the gate or up projection and the down
    projection."""
    E, F, HD = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    out = max(HD, cfg.linear.value_heads * cfg.linear.value_dim)
    per_layer = sum(i + rank + 2 for i in (E, out, E, F))
    return cfg.num_layers * per_layer


def lora_storage_roundings(projections: int, dtype) -> dict[str, int]:
    """What holding adapters' A and B in `dtype` adds to a path through `projections` adapted projections (a
    decoder's logit: lora_roundings' four a layer), against the same adapters in f32: one rounding point per tensor
    (a whole tensor rounded to a narrower dtype), two per projection; {} for float32. Taken relative to the
    adapters' delta, which is at most the projection's output."""
    name = np.dtype(dtype).name
    return {} if name == "float32" else {name: 2 * projections}


def backward_roundings(forward: int, batch_tokens: int) -> int:
    """A gradient of a network whose forward path is `forward` roundings long: the forward path, the reverse
    path through the same ops, and a weight gradient's sum over the batch's tokens."""
    return 2 * forward + batch_tokens


def bf16_rounding_points(layers: int, *, every_activation: bool) -> int:
    """Where a bf16 model rounds its activations to bf16, on the path to a logit.

    every_activation False: only each projection's input (this library: q/k/v, o, gate/up, down inputs,
    and the head's), 4 a layer and 1. True (transformers run in bf16): also every op's output: the norm,
    q/k/v, rope, attention, o, residual, norm, gate, up, activation, product, down, residual: 13 a layer,
    plus the final norm and the head.
    """
    return layers * (13 if every_activation else 4) + (2 if every_activation else 1)


def weight_quantization_roundoff(w, w_dequantized) -> float:
    """The unit roundoff a quantized weight behaves as, from the weight itself (never from a model's output):
    u = sqrt(3) rms(W - dequantized W) / rms(W), the u of a rounding whose relative error is uniform on [-u, u]
    (standard deviation u / sqrt(3)). int8 per output channel gives about 1/127 of a Gaussian weight's rms
    scale, int4 in groups about 1/7 of it."""
    w = np.asarray(w, np.float64)
    d = np.asarray(w_dequantized, np.float64) - w
    den = np.sqrt(np.mean(w ** 2))
    return float(np.sqrt(3.0) * np.sqrt(np.mean(d ** 2)) / den) if den else 0.0


# What quantizing a projection's input to int8 per block of 32 (scale amax / 127: the native int4 kernel,
# kernels/projection_int4.c) does, as a rounding point: each value moves by a rounding error uniform on
# [-s / 2, s / 2] (variance s^2 / 12, s = amax / 127), and a block's mean square is at least amax^2 / 32, so
# rms(error) / rms(x) <= sqrt(32 / 12) / 127 over any tensor; u = sqrt(3) times that (weight_quantization_roundoff's
# convention) is sqrt(8) / 127.
INT8_ACTIVATION_ROUNDOFF = math.sqrt(8.0) / 127.0


def activation_quantization_std(x, w, blocks) -> np.ndarray:
    """The standard deviation of what quantizing x to int8 per block adds to x @ w: x [M, I], w [I, O] (the
    weight the codes stand for), blocks [I] the block of each input (inputs of a block share the scale
    amax / 127). Each x moves by an independent rounding error uniform on [-s / 2, s / 2]: the variance of
    output (m, o) is sum_i w[i, o]^2 s[m, block(i)]^2 / 12. -> [M, O]."""
    x = np.asarray(x, np.float64)
    blocks = np.asarray(blocks)
    n = int(blocks.max()) + 1
    amax = np.zeros((x.shape[0], n))
    np.maximum.at(amax.T, blocks, np.abs(x).T)
    s = amax[:, blocks] / 127.0                                            # [M, I] each input's scale
    return np.sqrt((s ** 2 / 12.0) @ np.asarray(w, np.float64) ** 2)


def confidence_for(count: int) -> float:
    """The deviation that `count` compared values, each a Gaussian deviate, all stay within with the probability
    that one stays within CONFIDENCE: the union bound 2 count exp(-z^2 / 2) <= P(|Z| > CONFIDENCE)."""
    tail = math.erfc(CONFIDENCE / math.sqrt(2.0))
    return max(CONFIDENCE, math.sqrt(2.0 * math.log(2.0 * count / tail)))


def quantized_logit_bound(weight_roundoff: float, layers: int, f32_roundings: int = 0, *,
                          activation_roundoff: float = 0.0, head_roundoff: float = 0.0,
                          confidence: float = CONFIDENCE) -> float:
    """Relative bound (of the largest |logit|) on the difference between a model with quantized projections and
    the same model unquantized (plus, with f32_roundings, an f32 computation that rounds differently).

    Quantizing a whole weight is one rounding point (as rounding a tensor to bf16 is) at unit roundoff
    `weight_roundoff` (weight_quantization_roundoff), on one side only: the quantized projections' inputs on
    the path to a logit are bf16_rounding_points(layers, every_activation=False) less the head. activation_roundoff:
    each of those inputs quantized too (INT8_ACTIVATION_ROUNDOFF, the native int4 kernel's), one more rounding point
    each; head_roundoff: the head's own quantization (export's head_quant; 0 where it keeps the weight dtype), one
    point. Variances add."""
    n_q = bf16_rounding_points(layers, every_activation=False) - 1
    variance = ((weight_roundoff ** 2 + activation_roundoff ** 2) * n_q + head_roundoff ** 2) / 3.0
    variance += 2.0 * unit_roundoff("float32") ** 2 * f32_roundings / 3.0
    return confidence * math.sqrt(variance)


# -- measuring -----------------------------------------------------------------------------------


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|, in float64; 0 vs 0 is 0, NaN anywhere is inf."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if not (np.all(np.isfinite(actual)) and np.all(np.isfinite(expected))):
        return float("inf")
    err = np.max(np.abs(actual - expected), initial=0.0)
    scale = np.max(np.abs(expected), initial=0.0)
    if scale == 0:
        return 0.0 if err == 0 else float("inf")
    return float(err / scale)


def relative_rms(actual, expected) -> float:
    """sqrt(mean (actual - expected)^2 / mean expected^2), in float64: for long recurrences, whose largest
    element says little about the rest. NaN anywhere is inf."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if not (np.all(np.isfinite(actual)) and np.all(np.isfinite(expected))):
        return float("inf")
    den = np.mean(expected ** 2)
    num = np.mean((actual - expected) ** 2)
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(np.sqrt(num / den))
