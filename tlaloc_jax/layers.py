"""The decoder's building blocks as small pure functions (shapes use docs/glossary.md's letters)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

# REDUCE_ROWS: the most rows a projection of an out-major weight computes as a multiply-reduce on CPU.
from tlaloc_jax.kernels.quantized_matmul import REDUCE_ROWS, QuantizedWeight, out_major_product, quantized_matmul  # noqa: F401

from .config import RopeConfig

HIGHEST = lax.Precision.HIGHEST


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutMajor:
    """A linear's weight stored [O, I] (torch's order: each output's inputs contiguous), which the per-layer
    layout (tlaloc_jax.layout) writes. `linear` reads it as the [I, O] weight it stands for.

    Why: on XLA's CPU backend a projection of 2 to REDUCE_ROWS rows written as a multiply-reduce over an [O, I]
    weight streams the weight once, each row of it reused for every input row from cache, at about the speed of
    the batch-1 matrix-vector product; the dot of an [I, O] weight (a YNNPACK fusion walking 64-column strips)
    takes 1.6-1.9x that (bench/dot_forms.py, deleted in 82403e3; docs/cpu.md). A bf16 weight is widened in registers by that form at 1 row too.
    Otherwise it is a dot that contracts both operands' last axes, which reads [O, I] in place
    (kernels.quantized_matmul.out_major_product)."""

    out_in: jax.Array

    @property
    def dtype(self):
        return self.out_in.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's logical shape [..., I, O]."""
        return (*self.out_in.shape[:-2], self.out_in.shape[-1], self.out_in.shape[-2])


def _out_major_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x: [..., I] (in w's dtype), w: [O, I] -> [..., O] f32, by the form XLA runs fastest on the platform."""
    flat = x.reshape(-1, x.shape[-1])
    out = out_major_product(flat, w, reduce_one_row=w.dtype != jnp.float32)
    return out.reshape(*x.shape[:-1], w.shape[0])


def linear(x: jax.Array, w: jax.Array | OutMajor | QuantizedWeight) -> jax.Array:
    """x: [..., I] f32, w: [I, O] (or OutMajor [O, I]) -> [..., O] f32.

    A bf16 weight stays bf16: the input is rounded to bf16 and the product accumulates in f32. A quantized
    weight (kernels.quantized_matmul.QuantizedWeight) is read as its codes, its scales applied after the dot.
    """
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(x, w)
    if w.dtype != jnp.float32:
        x = x.astype(w.dtype)
    if isinstance(w, OutMajor):
        return _out_major_linear(x, w.out_in)
    return jnp.einsum("...i,io->...o", x, w, precision=HIGHEST, preferred_element_type=jnp.float32)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x: [..., E] f32, w: [E] -> [..., E] f32: x / rms(x) * (offset + w).

    offset 0 is Llama's norm; 1 is Gemma's (its weights are stored as w - 1, zero-centred).
    """
    x = x.astype(jnp.float32)
    y = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * (offset + w.astype(jnp.float32))


def embed(table: jax.Array, token_ids: jax.Array) -> jax.Array:
    """table: [V, E], token_ids: [B, T] -> [B, T, E] f32."""
    return jnp.take(table, token_ids, axis=0).astype(jnp.float32)


def tied_head(x: jax.Array, table: jax.Array) -> jax.Array:
    """x: [B, E], table: [V, E] -> logits [B, V]: contracts the hidden axes of both; no transposed copy."""
    if table.dtype != jnp.float32:
        x = x.astype(table.dtype)
    return lax.dot_general(x, table, (((1,), (1,)), ((), ())), precision=HIGHEST,
                           preferred_element_type=jnp.float32)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def gated_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, act: str = "silu") -> jax.Array:
    """x: [..., E]; gate, up: [E, F]; down: [F, E] -> [..., E]: down(act(gate x) * up x).

    act "silu" is SwiGLU (Llama, Qwen); "gelu_tanh" is GeGLU with the tanh GELU (Gemma).
    """
    return linear(ACTIVATIONS[act](linear(x, gate)) * linear(x, up), down)


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap): bounds logits smoothly (Gemma 2); cap 0 leaves x as it is."""
    return cap * jnp.tanh(x / cap) if cap else x


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [R / 2] (R = rotated dims), computed in f32 as transformers does."""
    rot = int(head_dim * rope.partial_rotary_factor)
    inv = (1.0 / (np.float32(rope.theta) ** (np.arange(0, rot, 2, dtype=np.int64).astype(np.float32) / rot)))
    inv = inv.astype(np.float32)
    if rope.rope_type == "linear":
        inv = (inv / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    if rope.rope_type == "yarn":
        inv = _yarn_inv_freq(rope, rot)
    if rope.rope_type == "longrope":
        # LongRoPE: each frequency divided by its own factor, from the set the config chose (RopeConfig.long_factors).
        ext = np.asarray(rope.long_factor if rope.long_factors else rope.short_factor, np.float32)
        shape = np.arange(0, rot, 2, dtype=np.int64).astype(np.float32) / np.float32(rot)
        inv = (np.float32(1.0) / (ext * np.float32(rope.theta) ** shape)).astype(np.float32)
    return inv


def _yarn_inv_freq(rope: RopeConfig, rot: int) -> np.ndarray:
    """YaRN (Peng et al. 2023, as transformers computes it): each frequency blends the original (extrapolated)
    and the one divided by `factor` (interpolated), by a linear ramp over the dims between the ones that turn
    beta_fast and beta_slow times within the original context."""
    base, old = rope.theta, rope.original_max_position_embeddings

    def dim_of(rotations: float) -> float:
        return (rot * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001
    pos = np.float32(base) ** (np.arange(0, rot, 2, dtype=np.int64).astype(np.float32) / np.float32(rot))
    extrapolated = (np.float32(1.0) / pos).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(rope.factor) * pos)).astype(np.float32)
    ramp = np.clip((np.arange(rot // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)
    return (interpolated * (np.float32(1.0) - keep) + extrapolated * keep).astype(np.float32)


def rope_tables(rope: RopeConfig, head_dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions: [B, T] -> (cos, sin) each [B, T, R] f32. Padding positions (-1) are clamped to 0."""
    inv = jnp.asarray(rope_inv_freq(rope, head_dim))
    freqs = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * inv
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if rope.attention_factor != 1.0:     # YaRN scales cos and sin (and so every score) by it
        cos, sin = cos * jnp.float32(rope.attention_factor), sin * jnp.float32(rope.attention_factor)
    # cos and sin of the R / 2 frequencies, then doubled: XLA's CPU backend keeps an expensive op out of a fusion
    # that reads its elements more than once, which the doubling does. Doubled first, they were fused into each
    # layer's rotation of q and of k and evaluated again for every head and layer.
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False) -> jax.Array:
    """x: [B, T, H, D], cos/sin: [B, T, R] -> x with its first R dims rotated (rotate-half convention: dims i and
    i + R / 2 pair up).

    interleaved: dims 2i and 2i + 1 pair up (DeepSeek's rope_interleave); the rotated pairs come out as
    transformers writes them, first elements then second ones, which a query and a key both get, so their dot
    products are the interleaved rotation's."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    if interleaved:
        xr = jnp.concatenate([xr[..., 0::2], xr[..., 1::2]], axis=-1)
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    xr = xr * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return jnp.concatenate([xr, xp], axis=-1) if xp.shape[-1] else xr
