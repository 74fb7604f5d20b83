"""Gated delta rule: prefill speed of the chunked form against the per-token recurrence, and the memory a
sequence holds in the linear-attention state pools against a full KV cache. One run prints both.

    JAX_PLATFORMS=cpu .venv/bin/python -m bench.gated_delta [--tokens 1024] [--value-heads 48] ...

The default shape is Qwen3.5-27B-like (the seed's "Qwen3.8-27B"): 64 layers, every fourth one attention
(48 Gated DeltaNet layers, 16 attention layers); linear layers with 16 key heads and 48 value heads of
128, a 4-tap conv over q|k|v; attention layers with 4 KV heads of 256. That attention geometry gives the
seed's 128 KiB per token of f32 KV for the 16 attention layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tlaloc_jax.kernels import gated_delta_rule_chunked, gated_delta_rule_recurrent

F32_BYTES = 4
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class HybridShape:
    linear_layers: int = 48
    attention_layers: int = 16
    key_heads: int = 16      # K: q and k heads of a linear layer
    value_heads: int = 48    # H: one recurrent state each
    key_size: int = 128      # Dk
    value_size: int = 128    # Dv
    conv_taps: int = 4       # W
    kv_heads: int = 4        # attention layers
    head_size: int = 256

    @property
    def conv_channels(self) -> int:
        """C: the conv runs over q|k|v."""
        return 2 * self.key_heads * self.key_size + self.value_heads * self.value_size

    def conv_state_bytes(self) -> int:
        """One linear layer's conv state, [C, W-1] f32."""
        return self.conv_channels * (self.conv_taps - 1) * F32_BYTES

    def recurrent_state_bytes(self) -> int:
        """One linear layer's recurrent state, [H, Dk, Dv] f32."""
        return self.value_heads * self.key_size * self.value_size * F32_BYTES

    def kv_bytes_per_token(self, layers: int) -> int:
        """f32 keys and values of one token over `layers` attention layers."""
        return layers * 2 * self.kv_heads * self.head_size * F32_BYTES


def median_seconds(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefill_speed(shape: HybridShape, tokens: int, repeats: int, chunk: int):
    rng = np.random.default_rng(0)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    K, H, Dk, Dv = shape.key_heads, shape.value_heads, shape.key_size, shape.value_size
    args = (normal(1, tokens, K, Dk), normal(1, tokens, K, Dk), normal(1, tokens, H, Dv),
            -0.3 * jax.nn.softplus(normal(1, tokens, H)), jax.nn.sigmoid(normal(1, tokens, H)),
            jnp.zeros((1, H, Dk, Dv), jnp.float32))
    chunked = jax.jit(lambda *a: gated_delta_rule_chunked(*a, chunk=chunk))
    recurrent = jax.jit(gated_delta_rule_recurrent)
    t_chunked = median_seconds(chunked, args, repeats)
    t_recurrent = median_seconds(recurrent, args, repeats)
    o_c, s_c = chunked(*args)
    o_r, s_r = recurrent(*args)
    agreement = float(jnp.sqrt(jnp.mean((s_c - s_r) ** 2) / jnp.mean(s_r**2)))
    print(f"prefill, one sequence of {tokens} tokens, one linear layer (K={K}, H={H}, Dk={Dk}, Dv={Dv}), "
          f"{jax.devices()[0].platform}, median of {repeats}:")
    print(f"  chunked (N={chunk})   {t_chunked * 1e3:9.1f} ms  {tokens / t_chunked:10.0f} tokens/s")
    print(f"  per-token recurrence {t_recurrent * 1e3:9.1f} ms  {tokens / t_recurrent:10.0f} tokens/s")
    print(f"  chunked / recurrent speed: {t_recurrent / t_chunked:.2f}x "
          f"(final states agree to {agreement:.1e} rel RMS)")


def memory_table(shape: HybridShape, positions=(1024, 8192, 32768)):
    conv, recurrent = shape.conv_state_bytes(), shape.recurrent_state_bytes()
    state = shape.linear_layers * (conv + recurrent)
    all_layers = shape.linear_layers + shape.attention_layers
    print(f"\nmemory per sequence, f32: {shape.linear_layers} linear layers, each conv state [C={shape.conv_channels}, "
          f"W-1={shape.conv_taps - 1}] = {conv / 2**10:.0f} KiB + recurrent state [H={shape.value_heads}, "
          f"{shape.key_size}, {shape.value_size}] = {recurrent / MIB:.2f} MiB;")
    kv_per_token = shape.kv_bytes_per_token(shape.attention_layers)
    print(f"  {shape.attention_layers} attention layers, KV {kv_per_token / 2**10:.0f} KiB per token; "
          f"one linear layer's state = the KV of "
          f"{(conv + recurrent) / shape.kv_bytes_per_token(1):.0f} tokens in one attention layer")
    header = (f"{'positions':>9} | {'state pools (fixed)':>19} | {f'KV, {shape.attention_layers} attn layers':>19} | "
              f"{'hybrid total':>12} | {f'KV if all {all_layers} were attn':>26} | {'all-attn / hybrid':>17}")
    print(header)
    print("-" * len(header))
    for p in positions:
        kv = p * kv_per_token
        full = p * shape.kv_bytes_per_token(all_layers)
        print(f"{p:>9,} | {state / MIB:>15.1f} MiB | {kv / MIB:>15.1f} MiB | {(state + kv) / MIB:>8.1f} MiB | "
              f"{full / MIB:>22.1f} MiB | {full / (state + kv):>17.2f}")
    print(f"  state pools: {state / 1e6:.1f} MB ({state / MIB:.1f} MiB) per sequence, whatever the context")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--key-heads", type=int, default=HybridShape.key_heads)
    parser.add_argument("--value-heads", type=int, default=HybridShape.value_heads)
    args = parser.parse_args()
    shape = HybridShape(key_heads=args.key_heads, value_heads=args.value_heads)
    prefill_speed(shape, args.tokens, args.repeats, args.chunk)
    memory_table(shape)


if __name__ == "__main__":
    main()
