"""The causal conv: the reference on a hand-worked case, the prefill and decode forms against it and
against transformers' torch path, right-aligned padding, carried history, gradients and export."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlaloc_jax.kernels import causal_conv1d, causal_conv1d_histories, causal_conv1d_reference, causal_conv1d_update

from margins import assert_within
from tlaloc_jax.kernels import tolerances as tol

pytestmark = pytest.mark.numeric

# A W-tap sum in f32 on both sides, in another order at most, then the bias and silu (x * logistic(x)).
# The widest conv here has 4 taps; gradients also sum over the gradient test's 2 x 9 tokens.
CONV_ROUNDINGS = 4 + 1 + tol.TRANSCENDENTAL_ULPS + 2
TOL = tol.bound(CONV_ROUNDINGS)
GRAD_TOL = tol.bound(tol.backward_roundings(CONV_ROUNDINGS, 2 * 9))


def rel_err(actual, expected) -> float:
    err = tol.relative_error(actual, expected)
    assert np.isfinite(err), "non-finite values"
    return err


def make_inputs(seed, *, B=2, T, C=6, W=4):
    """x [B, T, C], weight [C, W], bias [C], history [B, C, W-1], f32 numpy."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return normal(B, T, C), normal(C, W), normal(C), normal(B, C, W - 1)


def right_aligned(B, T, live_per_row):
    return np.arange(T)[None, :] >= (T - np.asarray(live_per_row))[:, None]


def test_reference_on_a_hand_worked_case():
    """One channel, W = 3, weight (1, 2, 3), bias 0.5, history (10, 20), no activation.

    token 1 (x = 1): 1*10 + 2*20 + 3*1 + 0.5 = 53.5; history becomes (20, 1).
    token 2 (x = -2): 1*20 + 2*1 + 3*(-2) + 0.5 = 16.5; history becomes (1, -2).
    With silu, token 2 gives 16.5 / (1 + exp(-16.5)) = 16.49999...
    """
    x = np.array([1.0, -2.0], np.float32).reshape(1, 2, 1)
    weight = np.array([[1.0, 2.0, 3.0]], np.float32)
    bias = np.array([0.5], np.float32)
    history = np.array([10.0, 20.0], np.float32).reshape(1, 1, 2)
    for form in (causal_conv1d_reference, causal_conv1d):
        y, h = form(x, weight, bias, history, activation=None)
        np.testing.assert_allclose(np.ravel(y), [53.5, 16.5], rtol=TOL)
        np.testing.assert_allclose(np.ravel(h), [1.0, -2.0], rtol=0)
        y, _ = form(x, weight, bias, history)
        np.testing.assert_allclose(np.ravel(y)[1], 16.5 / (1 + np.exp(-16.5)), rtol=TOL)


@pytest.mark.parametrize("T, W, activation, with_bias", [(1, 4, "silu", True), (5, 4, "silu", False),
                                                          (33, 4, None, True), (7, 2, "silu", True)])
def test_prefill_form_matches_reference(T, W, activation, with_bias):
    """Row 0 unpadded, row 1 right-aligned with padding (NaN inputs) before its live tokens."""
    x, weight, bias, history = make_inputs(T, T=T, W=W)
    valid = right_aligned(2, T, [T, T // 2])
    x = np.where(valid[:, :, None], x, np.nan)
    kwargs = dict(valid=valid, activation=activation)
    bias = bias if with_bias else None
    y_ref, h_ref = causal_conv1d_reference(x, weight, bias, history, **kwargs)
    y, h = jax.jit(functools.partial(causal_conv1d, **kwargs))(x, weight, bias, history)
    assert_within(rel_err(y, y_ref), TOL, "conv prefill output")
    assert_within(rel_err(h, h_ref), TOL, "conv prefill history")
    assert np.all(np.asarray(y)[~valid] == 0)


def test_gradients_match_reference():
    x, weight, bias, history = make_inputs(1, T=9)
    valid = right_aligned(2, 9, [9, 4])
    w_y = np.random.default_rng(2).standard_normal(x.shape)

    def grads(form):
        loss = lambda *a: jnp.sum(form(*a, valid=valid)[0] * w_y) + jnp.sum(form(*a, valid=valid)[1])  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, weight, bias, history)

    for name, d, d_ref in zip(("x", "weight", "bias", "history"), grads(causal_conv1d), grads(causal_conv1d_reference)):
        assert_within(rel_err(d, d_ref), GRAD_TOL, f"conv d{name}")


# ---------------------------------------------------------------------------------------------
# transformers' torch path (Qwen3-Next; Qwen3.5 has the same functions). Layout [B, C, T] there.


def test_decode_and_prefill_match_transformers():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, weight, bias, history = make_inputs(3, T=11)
    channels_first = torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2)))
    # Decode: causal_conv1d_update writes the new state into conv_state in place.
    conv_state = torch.from_numpy(history.copy())
    y_hf = hf.causal_conv1d_update(channels_first[:, :, :1], conv_state, torch.from_numpy(weight),
                                   torch.from_numpy(bias), "silu")
    y, h = causal_conv1d_update(x[:, 0], weight, bias, history)
    assert_within(rel_err(y, y_hf[:, :, 0].numpy()), TOL, "conv decode vs transformers")
    assert_within(rel_err(h, conv_state.numpy()), TOL, "conv decode state vs transformers")
    # Prefill of a fresh sequence: F.conv1d with W-1 zeros of padding, then silu.
    y_hf = hf.causal_conv1d_fn(channels_first, torch.from_numpy(weight), torch.from_numpy(bias), activation="silu")
    y, _ = causal_conv1d(x, weight, bias, np.zeros_like(history))
    assert_within(rel_err(y, np.swapaxes(y_hf.numpy(), 1, 2)), TOL, "conv")
    # Prefill continuing a history: the same torch path over [history, x], keeping the last T outputs.
    with_history = torch.cat([torch.from_numpy(history), channels_first], dim=-1)
    y_hf = hf.causal_conv1d_fn(with_history, torch.from_numpy(weight), torch.from_numpy(bias), activation="silu")
    y, h = causal_conv1d(x, weight, bias, history)
    assert_within(rel_err(y, np.swapaxes(y_hf.numpy()[:, :, -11:], 1, 2)), TOL, "conv")
    np.testing.assert_array_equal(h, np.swapaxes(x[:, -3:], 1, 2))


# ---------------------------------------------------------------------------------------------
# Right-aligned padding and carried history


@pytest.mark.parametrize("live", [1, 2, 9])
def test_padded_row_matches_unpadded_row(live):
    """Live tokens behind padding (NaN inputs) see the history directly before them, not the padding;
    1 and 2 live tokens put the history inside the padded stretch."""
    T = 12
    x, weight, bias, history = make_inputs(4, B=1, T=live)
    y_solo, h_solo = causal_conv1d(x, weight, bias, history)
    padded = np.concatenate([np.full((1, T - live, x.shape[2]), np.nan, np.float32), x], axis=1)
    y, h = causal_conv1d(padded, weight, bias, history, valid=right_aligned(1, T, [live]))
    assert_within(rel_err(y[:, T - live:], y_solo), TOL, "conv")
    np.testing.assert_array_equal(h, h_solo)  # moved, not computed: exact
    assert np.all(np.asarray(y[:, : T - live]) == 0)


@pytest.mark.parametrize("form", ["prefill", "decode"])
def test_row_without_live_tokens_keeps_its_history_bit_for_bit(form):
    x, weight, bias, history = make_inputs(5, T=6)
    history[1, 0, :] = -0.0
    valid = right_aligned(2, 6, [6, 0])
    if form == "decode":
        x, valid = x[:, 0], valid[:, 0]
        run = functools.partial(causal_conv1d_update, weight=weight, bias=bias)
    else:
        run = functools.partial(causal_conv1d, weight=weight, bias=bias)
    _, h = run(np.where(valid[..., None], x, np.nan), history=history, valid=valid)
    assert np.array_equal(np.asarray(h[1]).view(np.uint32), history[1].view(np.uint32))
    # Control: the same row read as live tokens (valid=None) moves the history.
    _, h_live = run(x, history=history)
    assert not np.array_equal(np.asarray(h_live[1]), history[1])


def test_history_carries_across_calls():
    """13 tokens at once equal 5 then 8 with the history carried, and decode steps continue a prefill."""
    x, weight, bias, history = make_inputs(6, T=13)
    y_whole, h_whole = causal_conv1d(x, weight, bias, history)
    y_first, h = causal_conv1d(x[:, :5], weight, bias, history)
    y_second, h_second = causal_conv1d(x[:, 5:], weight, bias, h)
    assert_within(rel_err(np.concatenate([y_first, y_second], axis=1), y_whole), TOL, "conv")
    np.testing.assert_array_equal(h_second, h_whole)
    for t in range(5, 8):
        y_t, h = causal_conv1d_update(x[:, t], weight, bias, h)
        assert_within(rel_err(y_t, y_whole[:, t]), TOL, "conv")


def test_histories_after_each_token_are_the_decode_forms():
    """causal_conv1d_histories' entry t is the history the decode form holds after token t (moved, not computed:
    exact), for full rows and right-aligned rows behind NaN padding; at a row's last token, causal_conv1d's. Control:
    the entry one token later is not."""
    x, weight, bias, history = make_inputs(8, B=3, T=5)
    valid = right_aligned(3, 5, [5, 3, 1])
    x = np.where(valid[..., None], x, np.nan).astype(np.float32)
    each = np.asarray(causal_conv1d_histories(x, history, valid=valid))
    assert each.shape == (3, 5, x.shape[2], weight.shape[1] - 1)
    h = history
    for t in range(5):
        _, h = causal_conv1d_update(x[:, t], weight, bias, h, valid=valid[:, t])
        for b in range(3):
            if valid[b, t]:
                np.testing.assert_array_equal(each[b, t], np.asarray(h[b]))
    np.testing.assert_array_equal(each[:, -1], np.asarray(causal_conv1d(x, weight, bias, history, valid=valid)[1]))
    assert not np.array_equal(each[0, 1], each[0, 2])


def test_exports_without_custom_calls():
    x, weight, bias, history = make_inputs(7, T=16)
    valid = right_aligned(2, 16, [16, 5])
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, weight, bias, history, valid)]
    prefill = jax.export.export(jax.jit(lambda x, w, b, h, m: causal_conv1d(x, w, b, h, valid=m)),
                                platforms=["cpu"])(*specs).mlir_module()
    decode = jax.export.export(jax.jit(causal_conv1d_update), platforms=["cpu"])(
        jax.ShapeDtypeStruct(x[:, 0].shape, x.dtype), *specs[1:4]).mlir_module()
    assert "stablehlo.custom_call" not in prefill and "stablehlo.custom_call" not in decode
