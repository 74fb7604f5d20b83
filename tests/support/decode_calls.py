"""Decode calls over paged pools for the decode kernels' tests (test_paged_attention_gpu.py, test_paged_attention_native.py):
random rows whose unwritten slots are NaN, so a read of one that reaches an output shows up as a NaN."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

S, D = 4, 16       # page size, head size (Triton's dot wants a head size and a key block of at least 16)
M = 12             # block-table width: context 48


class Call(NamedTuple):
    q: jax.Array             # [B, 1, H, D]
    kv_pool: jax.Array       # [L, 2, P, S, K, D]
    layer: int
    block_tables: jax.Array  # [B, M]
    positions: jax.Array     # [B, 1]
    seq_lens: jax.Array      # [B]


def make_call(seed, lengths, *, H=4, K=2, layers=2, layer=1, dtype=np.float32, padding=(), head_dim=D,
              page_size=S, width=M) -> Call:
    """Decode rows whose sequences hold lengths[b] keys, the last one this call's token (position length - 1).

    Rows in `padding` (and rows of length 0) are padding: position -1. Each row's pages are distinct pages
    drawn at random from P = B * M + 8; table entries past a row's pages point at random pages, free ones
    included."""
    rng = np.random.default_rng(seed)
    S, M, D = page_size, width, head_dim
    B, P = len(lengths), len(lengths) * M + 8
    pool = np.full((layers, 2, P, S, K, D), np.nan, np.float32)
    tables = rng.integers(0, P, (B, M), dtype=np.int32)
    own = iter(rng.permutation(P))
    positions = np.full((B, 1), -1, np.int32)
    for b, length in enumerate(lengths):
        for m in range(math.ceil(length / S)):
            tables[b, m] = next(own)
        for j in range(length):
            pool[:, :, tables[b, j // S], j % S] = rng.standard_normal((layers, 2, K, D))
        if length and b not in padding:
            positions[b, 0] = length - 1
    q = rng.standard_normal((B, 1, H, D)).astype(np.float32)
    return Call(jnp.asarray(q), jnp.asarray(pool, dtype), layer, jnp.asarray(tables), jnp.asarray(positions),
                jnp.asarray(lengths, jnp.int32))


def assert_controls_fail(kernel, reference, bound: float) -> None:
    """Plausible bugs a decode kernel's comparison with the reference catches, each far past `bound`: a causal length
    one short, query head h reading KV head h % K instead of h // G. kernel, reference: (call, window) -> output."""
    from tlaloc_jax.kernels.tolerances import relative_error
    call = make_call(0, [20, 33, 9], H=4, K=2)
    want = reference(call, jnp.int32(0))
    short = call._replace(positions=jnp.where(call.positions > 0, call.positions - 1, call.positions))
    assert relative_error(kernel(short, jnp.int32(0)), want) > 100 * bound
    # Feed the kernel the heads in (g, k) order, and put its output back.
    tiled = call.q.reshape(3, 1, 2, 2, D).transpose(0, 1, 3, 2, 4).reshape(3, 1, 4, D)
    wrong = kernel(call._replace(q=tiled), jnp.int32(0)).reshape(3, 1, 2, 2, D).transpose(0, 1, 3, 2, 4)
    assert relative_error(wrong.reshape(3, 1, 4, D), want) > 100 * bound
