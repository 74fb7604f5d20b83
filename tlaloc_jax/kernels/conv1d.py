"""Depthwise causal conv over a linear-attention layer's q|k|v channels, continued from a saved history.

Each channel c has its own W taps: y_t = act(bias + sum_w weight[c, w] * x_{t - (W - 1) + w}), where
the inputs before a sequence's first live token come from its history (the last W - 1 inputs of
earlier calls; zeros for a fresh sequence). That history is the layer's conv state pool entry.

Dimensions (docs/glossary.md): B, T, plus C (conv channels: 2 * K * Dk + H * Dv for Gated DeltaNet)
and W (taps, 4 for Qwen3-Next / Qwen3.5).

Rows are right-aligned: `valid` [B, T] is False on the padding before a row's live tokens. Padding
tokens are not inputs: a row's live tokens follow directly after its history, their outputs do
not depend on how much padding precedes them, padding outputs are 0, and a row without live
tokens keeps its history bit for bit.

- `causal_conv1d`: prefill form (any T), shifted slices over [history, live tokens].
- `causal_conv1d_update`: decode form (one token per row).
- `causal_conv1d_histories`: the history after each token of a call (speculative decoding keeps one).
- `causal_conv1d_reference`: the decode step scanned over T; the oracle.
"""

import jax
import jax.numpy as jnp
from jax import lax

_ACTIVATIONS = {"silu": jax.nn.silu, None: lambda y: y}


def _activation(name):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not one of {sorted(map(str, _ACTIVATIONS))}")
    return _ACTIVATIONS[name]


def _live_mask(valid, batch, tokens):
    """valid: [B, T] bool or None (all live) -> [B, T] bool."""
    if valid is None:
        return jnp.ones((batch, tokens), bool)
    return valid.astype(bool)


def _check(x, weight, bias, history):
    channels, taps = weight.shape
    if x.shape[-1] != channels or (bias is not None and bias.shape != (channels,)):
        bias_shape = None if bias is None else bias.shape
        raise ValueError(f"x {x.shape}, weight {weight.shape}, bias {bias_shape}: the channel counts C must agree")
    if history.shape != (x.shape[0], channels, taps - 1):
        raise ValueError(f"history {history.shape} must be [B, C, W-1] = {(x.shape[0], channels, taps - 1)}")


def causal_conv1d_update(x, weight, bias, history, *, valid=None, activation="silu"):
    """Decode form: one token per row.

    x: [B, C]; weight: [C, W]; bias: [C] or None; history: [B, C, W-1]; valid: [B] bool or None.
    Returns (y [B, C] in x's dtype, 0 where not valid; history [B, C, W-1], unchanged where not valid).
    """
    _check(x, weight, bias, history)
    window = jnp.concatenate([history.astype(jnp.float32), x.astype(jnp.float32)[:, :, None]], axis=-1)
    y = jnp.einsum("bcw,cw->bc", window, weight.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = _activation(activation)(y)
    live = _live_mask(None if valid is None else valid[:, None], x.shape[0], 1)  # [B, 1]
    return (
        jnp.where(live, y, 0.0).astype(x.dtype),
        jnp.where(live[:, :, None], window[..., 1:], history).astype(history.dtype),
    )


def causal_conv1d_reference(x, weight, bias, history, *, valid=None, activation="silu"):
    """The decode step, token by token: x [B, T, C] -> (y [B, T, C], history [B, C, W-1])."""
    _check(x, weight, bias, history)
    live = _live_mask(valid, *x.shape[:2])

    def token(hist, per_token):
        x_t, live_t = per_token
        y_t, hist = causal_conv1d_update(x_t, weight, bias, hist, valid=live_t, activation=activation)
        return hist, y_t

    history, y = lax.scan(token, history, (jnp.moveaxis(x, 1, 0), jnp.moveaxis(live, 1, 0)))
    return jnp.moveaxis(y, 0, 1), history


def _inputs_after_padding(x, history, live):
    """Each row's inputs as [padding, history, live tokens], so tap w of token t reads index t + w.

    x: [B, T, C]; history: [B, C, W-1]; live: [B, T] right-aligned -> [B, W-1+T, C] f32.
    Positions before the history read history[0]: finite, and only ever read by padding tokens.
    """
    taps_before = history.shape[-1]
    stacked = jnp.concatenate([jnp.swapaxes(history, 1, 2), x], axis=1).astype(jnp.float32)
    padding = x.shape[1] - jnp.sum(live, axis=1, dtype=jnp.int32)  # [B]
    index = jnp.arange(taps_before + x.shape[1])[None, :]
    # History sits at [0, W-1) of `stacked` and must land right before the live tokens, at
    # [padding, padding + W-1); the live tokens are already in place.
    source = jnp.where(index < padding[:, None] + taps_before, jnp.maximum(index - padding[:, None], 0), index)
    return jnp.take_along_axis(stacked, source[:, :, None], axis=1)


def causal_conv1d(x, weight, bias, history, *, valid=None, activation="silu"):
    """Prefill form: the conv over each row's live tokens, preceded by its history.

    x: [B, T, C]; weight: [C, W]; bias: [C] or None; history: [B, C, W-1]; valid: [B, T] bool
    (right-aligned) or None. Returns (y [B, T, C] in x's dtype, 0 at padding; history [B, C, W-1]
    = the last W-1 inputs of history followed by the live tokens).
    """
    _check(x, weight, bias, history)
    tokens, taps = x.shape[1], weight.shape[1]
    live = _live_mask(valid, *x.shape[:2])
    inputs = _inputs_after_padding(x, history, live)
    weight = weight.astype(jnp.float32)
    y = sum(inputs[:, w : w + tokens] * weight[:, w] for w in range(taps))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = _activation(activation)(y)
    new_history = jnp.swapaxes(inputs[:, tokens:], 1, 2)
    return jnp.where(live[:, :, None], y, 0.0).astype(x.dtype), new_history.astype(history.dtype)


def causal_conv1d_histories(x, history, *, valid=None):
    """The history after each token: x [B, T, C]; history [B, C, W-1]; valid [B, T] (right-aligned) or None ->
    [B, T, C, W-1], entry t the last W-1 inputs up to and including token t (at a row's last token, the history
    `causal_conv1d` returns). Entries at padding are finite and not a history."""
    live = _live_mask(valid, *x.shape[:2])
    inputs = _inputs_after_padding(x, history, live)                      # [B, W-1+T, C]
    taps_before = history.shape[-1]
    index = jnp.arange(x.shape[1])[:, None] + 1 + jnp.arange(taps_before)[None, :]    # [T, W-1]
    return jnp.moveaxis(inputs[:, index], -1, 2).astype(history.dtype)
