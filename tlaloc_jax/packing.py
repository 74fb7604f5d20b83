"""A packed call's layouts: its tokens side by side [1, N] (StepInputs.pack_index says where each row's are), as
its rows [B, T], or as rows of one token each."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .inputs import StepInputs


def packed_rows(flat: jax.Array, pack_index: jax.Array, fill) -> jax.Array:
    """A packed call's per-token values [1, N, ...] laid out as its rows [B, T, ...] (`fill` where a row has none)."""
    pad = jnp.full((1,) + flat.shape[2:], fill, flat.dtype)
    return jnp.concatenate([flat[0], pad])[pack_index]


def token_rows(inputs: StepInputs) -> StepInputs:
    """A packed call's tokens [1, N] as N rows of one token, each with its row's pages and seeing the keys up to its
    own position (the call writes every token's keys before any attends; a ring's later slots are masked as out of
    the window)."""
    B, T = inputs.pack_index.shape
    n = inputs.positions.shape[1]
    row = jnp.zeros((n + 1,), jnp.int32).at[inputs.pack_index.reshape(-1)].set(jnp.repeat(jnp.arange(B), T))[:n]
    pos = inputs.positions[0]
    return inputs._replace(positions=pos[:, None], seq_lens=jnp.where(pos >= 0, pos + 1, 0),
                           block_tables=None if inputs.block_tables is None else inputs.block_tables[row],
                           window_block_tables=(None if inputs.window_block_tables is None
                                                else inputs.window_block_tables[row]))


def unpack_rows(rows: jax.Array, pack_index: jax.Array, n: int) -> jax.Array:
    """The inverse of packed_rows: [B, T, ...] -> [1, N, ...] (what sits where a row has no token is dropped)."""
    B, T = pack_index.shape
    flat = jnp.zeros((n + 1,) + rows.shape[2:], rows.dtype).at[pack_index.reshape(-1)].set(
        rows.reshape((B * T,) + rows.shape[2:]))
    return flat[None, :n]


def query_rows(inputs: StepInputs) -> StepInputs:
    """A call's rows [B, T] as B * T rows of one token, each with its row's pages and seeing the keys up to its own
    position (a verify call writes its tokens' keys before any attends; a padding token sees none)."""
    B, T = inputs.positions.shape
    pos = inputs.positions.reshape(B * T, 1)
    tables = {name: None if getattr(inputs, name) is None else jnp.repeat(getattr(inputs, name), T, axis=0)
              for name in ("block_tables", "window_block_tables")}
    return inputs._replace(positions=pos, seq_lens=jnp.where(pos[:, 0] >= 0, pos[:, 0] + 1, 0), **tables)
