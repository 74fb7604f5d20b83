"""The gated delta rule: the reference on a hand-worked case, both fast forms against it (outputs, states,
gradients) and against transformers' torch forms, right-aligned padding, carried state, and export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from margins import assert_within
from tlaloc_jax.kernels import gated_delta_rule_chunked, gated_delta_rule_recurrent, gated_delta_rule_reference
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.gated_delta import _unit_lower_inverse

pytestmark = pytest.mark.numeric


def output_bound(T: int, Dk: int) -> float:
    """Relative RMS bound for outputs and states after T tokens. Both sides do f32 arithmetic on the same
    (possibly bf16) inputs; the fast forms sum in other orders and (chunked) solve each chunk's triangle."""
    return tol.bound(tol.gated_delta_roundings(T, Dk))


def grad_bound(T: int, Dk: int, B: int = 2) -> float:
    return tol.bound(tol.backward_roundings(tol.gated_delta_roundings(T, Dk), B * T))

FORMS = {"chunked": gated_delta_rule_chunked, "recurrent": gated_delta_rule_recurrent}
JITTED = {name: jax.jit(form) for name, form in FORMS.items()}
SHAPE = dict(K=2, H=4, Dk=16, Dv=8)  # grouped key heads, Dk != Dv
NAMES = ("q", "k", "v", "g", "beta", "state")


def rel_rms(actual, expected) -> float:
    assert np.all(np.isfinite(np.asarray(actual))), "non-finite values"
    return tol.relative_rms(actual, expected)


def make_inputs(seed, *, B=2, T, K, H, Dk, Dv, strong_decay=False):
    """Random (q, k, v, g, beta, state) as f32 numpy: q, k [B, T, K, Dk], v [B, T, H, Dv], g, beta [B, T, H]."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    # g as Qwen3-Next makes it: -A * softplus(a + dt_bias); strong decays make the chunk's cumulative
    # log decay reach a few hundred, where exp(gamma) underflows.
    a_scale = 8.0 if strong_decay else 0.3
    g = -a_scale * np.logaddexp(0.0, normal(B, T, H))
    beta = 1.0 / (1.0 + np.exp(-normal(B, T, H)))
    q, k, v, state = normal(B, T, K, Dk), normal(B, T, K, Dk), normal(B, T, H, Dv), normal(B, H, Dk, Dv)
    return q, k, v, g.astype(np.float32), beta, state


def right_aligned(B, T, live_per_row):
    """[B, T] bool with the last live_per_row[b] tokens of row b live."""
    return np.arange(T)[None, :] >= (T - np.asarray(live_per_row))[:, None]


def outputs_and_grads(form, args, valid, w_o, w_s):
    """(o, state, gradients of sum(o * w_o) + sum(state * w_s) w.r.t. q, k, v, g, beta, initial state),
    from one compiled function."""

    def run(*a):
        (o, s), vjp = jax.vjp(lambda *a: form(*a, valid=valid), *a)
        return o, s, vjp((w_o, w_s))

    return jax.jit(run)(*args)


# ---------------------------------------------------------------------------------------------


def test_reference_on_a_hand_worked_two_token_case():
    """One head, Dk = 4 (q scale 1/2), Dv = 2, zero initial state, exp(g) = 1/2 for both tokens.

    token 1: q = k = e1, v = (2, -1), beta = 1/2.
        S = 0 decayed is 0; kᵀS = 0; beta (v - kᵀS) = (1, -0.5); S = e1 (x) (1, -0.5).
        o1 = (q / 2)ᵀ S = 0.5 (1, -0.5) = (0.5, -0.25).
    token 2: q = (3, 0, 0, 4) -> (0.6, 0, 0, 0.8); k = (3, 4, 0, 0) -> (0.6, 0.8, 0, 0); v = (1.3, 0.85); beta = 1/2.
        decayed S: row 1 = (0.5, -0.25); kᵀS = 0.6 (0.5, -0.25) = (0.3, -0.15);
        beta (v - kᵀS) = 0.5 (1.0, 1.0) = (0.5, 0.5);
        S row 1 = (0.5, -0.25) + 0.6 (0.5, 0.5) = (0.8, 0.05); row 2 = 0.8 (0.5, 0.5) = (0.4, 0.4); rows 3, 4 = 0.
        o2 = (0.3, 0, 0, 0.4)ᵀ S = 0.3 (0.8, 0.05) = (0.24, 0.015).
    The l2norm eps (1e-6) moves these by < 1e-6 relative.
    """
    q = np.array([[1, 0, 0, 0], [3, 0, 0, 4]], np.float32).reshape(1, 2, 1, 4)
    k = np.array([[1, 0, 0, 0], [3, 4, 0, 0]], np.float32).reshape(1, 2, 1, 4)
    v = np.array([[2, -1], [1.3, 0.85]], np.float32).reshape(1, 2, 1, 2)
    g = np.log(np.full((1, 2, 1), 0.5, np.float32))
    beta = np.full((1, 2, 1), 0.5, np.float32)
    state = np.zeros((1, 1, 4, 2), np.float32)
    o_expected = np.array([[0.5, -0.25], [0.24, 0.015]]).reshape(1, 2, 1, 2)
    s_expected = np.array([[0.8, 0.05], [0.4, 0.4], [0, 0], [0, 0]]).reshape(1, 1, 4, 2)
    for form in (gated_delta_rule_reference, *FORMS.values()):
        o, s = form(q, k, v, g, beta, state)
        np.testing.assert_allclose(o, o_expected, rtol=2e-6, atol=1e-7, err_msg=form.__name__)
        np.testing.assert_allclose(s, s_expected, rtol=2e-6, atol=1e-7, err_msg=form.__name__)


def test_unit_lower_inverse_matches_numpy():
    rng = np.random.default_rng(0)
    a = np.tril(rng.uniform(-1, 1, (3, 64, 64)), -1).astype(np.float32)
    expected = np.linalg.inv(np.eye(64) + a.astype(np.float64))
    # Forward substitution: row i sums i earlier rows; the last row's path is 64 * 65 / 2 roundings.
    assert_within(rel_rms(_unit_lower_inverse(a), expected), tol.bound(64 * 65 // 2), "unit lower inverse")


def _check_against_reference(T, K, H, Dk, Dv, *, strong_decay=False, seed=0):
    """Both forms vs the reference: outputs, final states and all six gradients. Row 0 is unpadded;
    row 1 is right-aligned with a third of its tokens padding (all of them at T = 1)."""
    args = make_inputs(seed, T=T, K=K, H=H, Dk=Dk, Dv=Dv, strong_decay=strong_decay)
    valid = right_aligned(2, T, [T, T - max(1, T // 3)])
    rng = np.random.default_rng(seed + 1)
    w_o = rng.standard_normal((2, T, H, Dv)).astype(np.float32)
    w_s = rng.standard_normal(args[5].shape).astype(np.float32)
    o_ref, s_ref, g_ref = outputs_and_grads(gated_delta_rule_reference, args, valid, w_o, w_s)
    for name, form in FORMS.items():
        o, s, g = outputs_and_grads(form, args, valid, w_o, w_s)
        case = f"{name} T={T} Dk={Dk}{' strong decay' if strong_decay else ''}"
        assert_within(rel_rms(o, o_ref), output_bound(T, Dk), f"{case}: output")
        assert_within(rel_rms(s, s_ref), output_bound(T, Dk), f"{case}: state")
        assert np.all(np.asarray(o)[~valid] == 0), name
        for arg, d, d_ref in zip(NAMES, g, g_ref):
            assert_within(rel_rms(d, d_ref), grad_bound(T, Dk), f"{case}: d{arg}")


# (T, K, H, Dk, Dv): odd lengths and the chunk edges at 63, 64, 65, grouped key heads, Dk != Dv both ways; the
# 65-token case with strong decays (cumulative log decay in the hundreds within a chunk).
@pytest.mark.parametrize(
    "T, K, H, Dk, Dv, strong_decay",
    [(1, 2, 4, 16, 8, False), (15, 1, 2, 16, 8, False), (63, 1, 1, 8, 12, False), (64, 2, 2, 16, 8, False),
     (65, 2, 6, 8, 16, True)],
)
def test_fast_forms_match_reference(T, K, H, Dk, Dv, strong_decay):
    _check_against_reference(T, K, H, Dk, Dv, strong_decay=strong_decay)


@pytest.mark.slow
@pytest.mark.parametrize(
    "T, K, H, Dk, Dv",
    [(15, 4, 4, 8, 8), (300, 2, 4, 16, 24), (300, 1, 3, 32, 16), (129, 2, 2, 64, 64), (1000, 1, 2, 32, 32)],
)
def test_fast_forms_match_reference_long(T, K, H, Dk, Dv):
    _check_against_reference(T, K, H, Dk, Dv)


def test_bf16_inputs_widen_to_f32():
    args = make_inputs(4, T=64, K=1, H=2, Dk=16, Dv=8)
    args = tuple(jnp.asarray(x, jnp.bfloat16) for x in args[:5]) + (args[5],)
    o_ref, s_ref = gated_delta_rule_reference(*args)
    for name, form in FORMS.items():
        o, s = form(*args)
        assert o.dtype == s.dtype == jnp.float32
        assert_within(rel_rms(o, o_ref), output_bound(64, 16), f"{name} bf16 inputs: output")
        assert_within(rel_rms(s, s_ref), output_bound(64, 16), f"{name} bf16 inputs: state")


# ---------------------------------------------------------------------------------------------
# transformers' torch forms (Qwen3-Next; qwen3_5's copies are the same code). Same layouts:
# q, k [B, T, K, Dk], v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dk, Dv].


@pytest.mark.parametrize("form, torch_name", [("chunked", "torch_chunk_gated_delta_rule"),
                                              ("recurrent", "torch_recurrent_gated_delta_rule")])
def test_matches_transformers(form, torch_name):
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    args = make_inputs(5, T=130, **SHAPE)
    o_hf, s_hf = getattr(hf, torch_name)(*map(torch.from_numpy, args[:5]), initial_state=torch.from_numpy(args[5]),
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = JITTED[form](*args)
    bound = output_bound(130, SHAPE["Dk"])
    assert_within(rel_rms(o, o_hf.numpy()), bound, f"{form} vs transformers: output")
    assert_within(rel_rms(s, s_hf.numpy()), bound, f"{form} vs transformers: state")


# ---------------------------------------------------------------------------------------------
# Right-aligned padding. These tests share shapes (SHAPE; 65 or 130 tokens) to share compiles.


def with_nan_padding(x, valid):
    """x: [B, T, ...] with NaN wherever valid [B, T] is False."""
    return np.where(valid.reshape(*valid.shape, *[1] * (x.ndim - 2)), x, np.nan).astype(np.float32)


@pytest.mark.parametrize("form", FORMS)
def test_padded_row_matches_unpadded_row(form):
    """Row 0: 65 live tokens behind 65 padding tokens with NaN inputs give what the 65 give alone; the
    chunks hold 64 padding tokens, then 1 padding and 63 live, then 2 live and the internal tail."""
    solo = make_inputs(6, T=65, **SHAPE)
    o_solo, s_solo = JITTED[form](*solo)
    valid = right_aligned(2, 130, [65, 0])
    padded = (with_nan_padding(np.concatenate([x, x], axis=1), valid) for x in solo[:5])
    o, s = JITTED[form](*padded, solo[5], valid=valid)
    bound = output_bound(130, SHAPE["Dk"])
    assert_within(rel_rms(o[0, 65:], o_solo[0]), bound, f"{form} padded row: output")
    assert_within(rel_rms(s[0], s_solo[0]), bound, f"{form} padded row: state")
    assert np.all(np.asarray(o)[~valid] == 0)


@pytest.mark.parametrize("form", FORMS)
def test_all_padding_row_keeps_its_state_bit_for_bit(form):
    q, k, v, g, beta, state = make_inputs(7, T=130, **SHAPE)
    state[1, 0, 0, :] = -0.0  # signed zeros must survive too
    valid = right_aligned(2, 130, [130, 0])
    o, s = JITTED[form](*(with_nan_padding(x, valid) for x in (q, k, v, g, beta)), state, valid=valid)
    assert np.array_equal(np.asarray(s[1]).view(np.uint32), state[1].view(np.uint32))
    assert np.all(np.asarray(o[1]) == 0)
    # Control: the same row read as live tokens (valid=None) moves the state.
    _, s_live = JITTED[form](q, k, v, g, beta, state)
    assert rel_rms(s_live[1], state[1]) > 1e-2


def test_the_state_after_every_token():
    """each=True: entry t is the reference's state after the first t + 1 tokens (a right-aligned row's padding keeps
    the state it found), the outputs and the last entry those of each=False. Control: entry t is not entry t + 1."""
    q, k, v, g, beta, state = make_inputs(9, T=5, **SHAPE)
    valid = right_aligned(2, 5, [5, 2])
    args = [with_nan_padding(x, valid) for x in (q, k, v, g, beta)]
    o_each, states = gated_delta_rule_recurrent(*args, state, valid=valid, each=True)
    o, last = gated_delta_rule_recurrent(*args, state, valid=valid)
    assert states.shape == (2, 5, SHAPE["H"], SHAPE["Dk"], SHAPE["Dv"])
    bound = output_bound(5, SHAPE["Dk"])
    for t in range(5):
        _, want = gated_delta_rule_reference(*(x[:, :t + 1] for x in args), state, valid=valid[:, :t + 1])
        assert_within(rel_rms(states[:, t], want), bound, f"state after token {t}")
    assert np.array_equal(np.asarray(states[1, 0]), state[1]) and np.array_equal(np.asarray(states[1, 2]), state[1])
    assert_within(rel_rms(states[:, -1], last), bound, "last state")
    assert_within(rel_rms(o_each, o), bound, "outputs")
    assert rel_rms(states[:, 2], states[:, 3]) > 1e-2


# ---------------------------------------------------------------------------------------------


def test_chunked_state_carries_across_calls():
    """One 130-token call from an initial state equals 65 tokens then 65 more from the carried state,
    and decode steps (the recurrent form, one token each) continue a 65-token prefill."""
    q, k, v, g, beta, state = make_inputs(8, T=130, **SHAPE)
    chunked, decode = JITTED["chunked"], JITTED["recurrent"]
    whole_o, whole_s = chunked(q, k, v, g, beta, state)
    first_o, carried = chunked(*(x[:, :65] for x in (q, k, v, g, beta)), state)
    second_o, last = chunked(*(x[:, 65:] for x in (q, k, v, g, beta)), carried)
    bound = output_bound(130, SHAPE["Dk"])
    assert_within(rel_rms(np.concatenate([first_o, second_o], axis=1), whole_o), bound, "carried: outputs")
    assert_within(rel_rms(last, whole_s), bound, "carried: state")
    for t in range(65, 68):
        o_t, carried = decode(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), carried)
        assert_within(rel_rms(o_t, whole_o[:, t : t + 1]), bound, f"decode step {t}")


def _stablehlo(fn, *args):
    specs = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    return jax.export.export(jax.jit(fn), platforms=["cpu"])(*specs).mlir_module()


def test_exports_without_custom_calls():
    """Prefill, decode and the prefill gradient lower to plain StableHLO: no custom_call for the plugin to lack."""
    q, k, v, g, beta, state = make_inputs(9, T=100, K=1, H=2, Dk=8, Dv=8)
    valid = right_aligned(2, 100, [100, 30])
    prefill = _stablehlo(lambda *a: gated_delta_rule_chunked(*a[:6], valid=a[6]), q, k, v, g, beta, state, valid)
    decode = _stablehlo(lambda *a: gated_delta_rule_recurrent(*a[:6], valid=a[6]),
                        *(x[:, :1] for x in (q, k, v, g, beta)), state, valid[:, :1])
    loss = lambda *a: jnp.sum(gated_delta_rule_chunked(*a[:6], valid=a[6])[0])  # noqa: E731
    backward = _stablehlo(jax.grad(loss, argnums=tuple(range(6))), q, k, v, g, beta, state, valid)
    for body in (prefill, decode, backward):
        assert "stablehlo.custom_call" not in body
    assert "stablehlo.while" in prefill and "stablehlo.while" in backward
    assert "stablehlo.while" not in decode  # one token: straight-line ops
    # Control: the library triangular solve is a LAPACK custom call on CPU, which the plugin refuses.
    a = np.eye(64, dtype=np.float32)
    assert "stablehlo.custom_call" in _stablehlo(lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True), a, a)
