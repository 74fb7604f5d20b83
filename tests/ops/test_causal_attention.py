"""Training attention (blockwise forward, flash-style custom_vjp) against dense softmax attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlaloc_jax.kernels import causal_attention, causal_attention_reference
from margins import assert_within
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error

pytestmark = pytest.mark.numeric

B, T, D = 2, 37, 8   # T is not a multiple of the key block
KEY_BLOCK = 16       # 3 key blocks, the last one partly padding
SCALE = 0.35
# Blockwise online softmax vs dense softmax over at most T keys; the gradients add the backward's path.
OUTPUT_BOUND = tol.bound(tol.attention_roundings(D, T))
GRAD_BOUND = tol.bound(tol.attention_grad_roundings(D, T))


def random_inputs(seed, H, K, dtype=np.float32):
    """-> q [B, T, H, D], k, v [B, T, K, D], and the weights w [B, T, H, D] of a random linear functional."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D))
    k, v = rng.standard_normal((2, B, T, K, D))
    w = rng.standard_normal((B, T, H, D)).astype(np.float32)
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(w)


# The window is traced (0 = none), so every window shares one compile.
@functools.partial(jax.jit, static_argnames=("soft_cap",))
def outputs_and_grads(q, k, v, w, window, *, soft_cap):
    """-> (fast output, reference output, fast grads, reference grads) of sum(w * attention(q, k, v))."""
    fast = functools.partial(causal_attention, scale=SCALE, key_block=KEY_BLOCK, window=window, soft_cap=soft_cap)
    dense = functools.partial(causal_attention_reference, scale=SCALE, window=window, soft_cap=soft_cap)
    grads = [jax.grad(lambda q, k, v, f=f: jnp.sum(w * f(q, k, v)), argnums=(0, 1, 2))(q, k, v) for f in (fast, dense)]
    return fast(q, k, v), dense(q, k, v), *grads


@pytest.mark.parametrize("H, K, soft_cap", [(4, 4, None), (4, 2, None), (4, 2, 5.0), (4, 1, 5.0)],
                         ids=["G1", "G2", "G2-soft-cap", "G4-soft-cap"])
def test_matches_reference_with_gradients(H, K, soft_cap):
    """Outputs and d/d(q, k, v) of a random linear functional, with and without a window (7 crosses key blocks)."""
    q, k, v, w = random_inputs(H * 10 + K, H, K)
    for window in (0, 7):
        out, expected, grads, expected_grads = outputs_and_grads(q, k, v, w, jnp.int32(window), soft_cap=soft_cap)
        assert out.shape == (B, T, H, D) and out.dtype == jnp.float32
        assert_within(relative_error(out, expected), OUTPUT_BOUND, f"window {window}: output")
        for name, g, e in zip("qkv", grads, expected_grads):
            assert g.shape == e.shape, name
            assert_within(relative_error(g, e), GRAD_BOUND, f"window {window}: d{name}")


def test_bf16_inputs():
    """bf16 inputs are widened before any arithmetic, so the output is held to the f32 bound; the gradients
    come back in bf16: one more rounding point, in bf16, on each side."""
    q, k, v, w = random_inputs(0, 4, 2, jnp.bfloat16)
    out, expected, grads, expected_grads = outputs_and_grads(q, k, v, w, jnp.int32(0), soft_cap=None)
    assert_within(relative_error(out, expected), OUTPUT_BOUND, "bf16 inputs: output")
    grad_bound = tol.bound({"bfloat16": 1, "float32": tol.attention_grad_roundings(D, T)})
    for name, g, e in zip("qkv", grads, expected_grads):
        assert g.dtype == jnp.bfloat16
        assert_within(relative_error(g, e), grad_bound, f"bf16 inputs: d{name}")


def test_reference_hand_worked():
    """With q = 0 every visible key scores the same: token t averages v_0..v_t (v_{t-W+1}..v_t with a window)."""
    reference = jax.jit(causal_attention_reference, static_argnames=("scale", "window"))
    rtol = tol.bound(tol.attention_roundings(2, 3))
    q = jnp.zeros((1, 3, 1, 2))
    k = jnp.ones((1, 3, 1, 2))
    v = jnp.array([[[[3.0, 0.0]], [[0.0, 6.0]], [[9.0, 3.0]]]])
    np.testing.assert_allclose(reference(q, k, v, scale=1.0)[0, :, 0],
                               [[3.0, 0.0], [1.5, 3.0], [4.0, 3.0]], rtol=rtol)
    np.testing.assert_allclose(reference(q, k, v, scale=1.0, window=2)[0, :, 0],
                               [[3.0, 0.0], [1.5, 3.0], [4.5, 4.5]], rtol=rtol)


def test_control_wrong_head_mapping_fails():
    """Query head h reading KV head h % K (not h // G) changes the answer: the comparison can see it."""
    q, k, v, _ = random_inputs(1, 4, 2)
    tiled = q.reshape(B, T, 2, 2, D).transpose(0, 1, 3, 2, 4).reshape(B, T, 4, D)
    wrong = jax.jit(functools.partial(causal_attention, scale=SCALE, key_block=KEY_BLOCK))(tiled, k, v)
    wrong = wrong.reshape(B, T, 2, 2, D).transpose(0, 1, 3, 2, 4).reshape(B, T, 4, D)
    expected = jax.jit(functools.partial(causal_attention_reference, scale=SCALE))(q, k, v)
    assert relative_error(wrong, expected) > 0.1


def test_no_token_by_token_tensor_in_forward_or_backward(jaxpr_eqns):
    """Neither the forward nor the backward holds a [T, T] score tensor; the reference's gradient does (control)."""
    q, k, v, w = random_inputs(2, 4, 2)
    lengths = {T, -(-T // KEY_BLOCK) * KEY_BLOCK}  # the tokens, and the keys padded to whole blocks

    def has_square(attention):
        loss = lambda q, k, v: jnp.sum(w * attention(q, k, v, scale=SCALE))
        eqns = jaxpr_eqns(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
        return any(sum(d in lengths for d in v.aval.shape) >= 2 for e in eqns for v in e.outvars)

    assert not has_square(functools.partial(causal_attention, key_block=KEY_BLOCK))
    assert has_square(causal_attention_reference)
