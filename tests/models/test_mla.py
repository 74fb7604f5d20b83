"""Multi-head latent attention (tlaloc_jax/kernels/mla.py) against its naive reference: the paged forms (absorbed and
expanded, one pass and blockwise) over odd lengths, page boundaries and NaN-filled unused pages; the causal
training form and its gradients against jax.grad of the reference; the cache write; and controls that must fail.

Every pool here is NaN wherever no position was written (free pages, slots past a row's length), so a read of
such a slot that reaches an output shows up as a NaN.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_paged_attention as tpa
from margins import assert_within
from tlaloc_jax.kernels import mla_cache_write, mla_causal, mla_causal_reference, paged_mla, paged_mla_reference
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.mla import ABSORBED, EXPANDED, cheaper_form
from tlaloc_jax.kernels.tolerances import relative_error

pytestmark = pytest.mark.numeric

S, M = tpa.S, tpa.M         # page size 4, block-table width 12: context 48
H, C, R, Dn, Dv = 3, 12, 4, 6, 5   # heads, latent, rotated key (C + R: a paged-attention key and value), key part, value
KEY_BLOCK = 16              # 4 pages a key block: 3 blocks per context
ONE_PASS = M * S
SCALE = (Dn + R) ** -0.5
BOUND = tol.bound(tol.latent_attention_roundings(latent=C, rope=R, nope=Dn, keys=M * S))


def make_call(seed, lengths, new_tokens, *, T=8):
    """Rows whose sequences hold lengths[b] positions, the last new_tokens[b] of them this call's tokens: the pages,
    tables and positions of tests/ops/test_paged_attention.py's calls (distinct pages per row, table entries past a
    row's pages at random pages, NaN wherever nothing was written), each position's keys and values side by side
    as its latent and rotated key [C + R], in layer 1 of 2."""
    call = tpa.make_call(seed, lengths, new_tokens, T=T, H=1, K=1)
    kv = np.asarray(call.kv_pool)                                               # [2, 2, P, S, 1, 8]
    pool = np.concatenate([kv[:, :1], kv[:, 1:]], axis=-1)                     # [2, 1, P, S, 1, C + R]
    rng = np.random.default_rng(seed + 1)
    B = len(lengths)
    return dict(q_nope=jnp.asarray(rng.standard_normal((B, T, H, Dn)), jnp.float32),
                q_rope=jnp.asarray(rng.standard_normal((B, T, H, R)), jnp.float32), pool=jnp.asarray(pool),
                layer=call.layer, block_tables=call.block_tables, positions=call.positions, seq_lens=call.seq_lens,
                w_k=jnp.asarray(rng.standard_normal((C, H, Dn)) / np.sqrt(C), jnp.float32),
                w_v=jnp.asarray(rng.standard_normal((C, H, Dv)) / np.sqrt(C), jnp.float32))


@functools.partial(jax.jit, static_argnames=("key_block", "form"))
def fast(call, *, key_block, form):
    return paged_mla(**call, scale=SCALE, key_block=key_block, form=form)


@jax.jit
def reference(call):
    return paged_mla_reference(**call, scale=SCALE)


# Odd lengths crossing page and key-block boundaries; a row of one key; an empty row; decode and prefill.
CASES = {
    "prefill": ([13, 47, 1, 0], [8, 5, 1, 0], 8),
    "prefill_page_edges": ([4, 16, 17, 33], [4, 8, 1, 7], 8),
    "decode": ([1, 29, 48, 0], [1, 1, 1, 0], 1),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("form", [ABSORBED, EXPANDED])
def test_paged_forms_match_reference(case, form):
    lengths, new, T = CASES[case]
    call = make_call(3, lengths, new, T=T)
    want = reference(call)
    assert np.all(np.isfinite(want))
    for key_block in (KEY_BLOCK, ONE_PASS):
        got = fast(call, key_block=key_block, form=form)
        assert got.shape == (len(lengths), T, H, Dv) and np.all(np.isfinite(got))
        assert_within(relative_error(got, want), BOUND, f"{case}: {form}, key block {key_block}, vs reference")
        # Padding tokens and empty rows see nothing: exactly 0.
        np.testing.assert_array_equal(np.asarray(got)[np.asarray(call["positions"]) < 0], 0.0)


def test_reference_hand_worked():
    """One head, C = 2, R = 1, Dn = Dv = 1, Wk = Wv = [[1], [0]] (a head reads the latent's first entry). Keys:
    latents (0, 5), (ln 3, 7) with rotated keys 0; query nope 1, rope 0, scale 1: scores 0 and ln 3, weights
    1/4 and 3/4; values are the latents' first entries 0 and ln 3. A query whose rotated part is 1 against rotated
    keys 0 and ln 2 adds ln 2 to the second score: weights 1/7, 6/7."""
    pool = np.full((1, 1, 2, 2, 1, 3), np.nan, np.float32)
    pool[0, 0, 0, :, 0] = [[0.0, 5.0, 0.0], [np.log(3.0), 7.0, 0.0]]
    w = jnp.asarray([[[1.0]], [[0.0]]])
    call = dict(q_nope=jnp.ones((1, 1, 1, 1)), q_rope=jnp.zeros((1, 1, 1, 1)), pool=jnp.asarray(pool), layer=0,
                block_tables=jnp.asarray([[0, 1]], jnp.int32), positions=jnp.asarray([[1]], jnp.int32),
                seq_lens=jnp.asarray([2], jnp.int32), w_k=w, w_v=w)
    rtol = tol.bound(tol.latent_attention_roundings(latent=2, rope=1, nope=1, keys=2))
    forms = [jax.jit(functools.partial(f, scale=1.0), static_argnames="layer")
             for f in (paged_mla_reference, functools.partial(paged_mla, form=ABSORBED, key_block=2),
                       functools.partial(paged_mla, form=EXPANDED))]
    for f in forms:
        np.testing.assert_allclose(np.asarray(f(**call))[0, 0, 0], [0.75 * np.log(3.0)], rtol=rtol)
    pool[0, 0, 0, 1, 0, 2] = np.log(2.0)
    call = dict(call, q_rope=jnp.ones((1, 1, 1, 1)), pool=jnp.asarray(pool))
    for f in forms:
        np.testing.assert_allclose(np.asarray(f(**call))[0, 0, 0], [6 / 7 * np.log(3.0)], rtol=rtol)


def test_control_value_heads_shifted_fails():
    """Control: the values expanded with each head's neighbour's Wv (a head mapping one off) are caught."""
    call = make_call(5, [13, 47, 1, 0], [8, 5, 1, 0])
    want = reference(call)
    wrong = fast(dict(call, w_v=jnp.roll(call["w_v"], 1, axis=1)), key_block=KEY_BLOCK, form=ABSORBED)
    assert relative_error(wrong, want) > 100 * BOUND


def test_cheaper_form_by_multiply_adds():
    """DeepSeek-V3's dims (C 512, R 64, Dn Dv 128, H 128): a decode step reads the latents absorbed; a prefill chunk
    of 512 tokens over 512 keys expands them (about 1088 T N H against C H (Dn + Dv) N + 320 T N H)."""
    dims = dict(heads=128, latent=512, rope=64, nope=128, value=128)
    assert cheaper_form(1, 4096, **dims) == ABSORBED
    assert cheaper_form(16, 4096, **dims) == ABSORBED
    assert cheaper_form(512, 512, **dims) == EXPANDED


def _materialised_shapes(jaxpr_eqns, f, *args):
    return {tuple(v.aval.shape) for e in jaxpr_eqns(f, *args) for v in e.outvars if hasattr(v.aval, "shape")}


def test_absorbed_decode_reads_only_the_latent(jaxpr_eqns):
    """The absorbed form expands no key or value: no intermediate holds a head axis over the gathered positions
    ([B, N, H, .]); the expanded form does (the control)."""
    call = make_call(7, [29, 48], [1, 1], T=1)
    args = {k: v for k, v in call.items() if k != "layer"}

    def shapes(form):
        f = lambda a: paged_mla(**a, layer=1, scale=SCALE, key_block=ONE_PASS, form=form)  # noqa: E731
        return {s for s in _materialised_shapes(jaxpr_eqns, f, args) if len(s) == 4 and s[1:3] == (M * S, H)}

    assert shapes(ABSORBED) == set()
    assert {(2, M * S, H, Dn + R), (2, M * S, H, Dv)} <= shapes(EXPANDED)


# --- the cache write --------------------------------------------------------------------------------


def test_cache_write_slots_and_padding():
    pool = jnp.full((2, 1, 5, S, 1, C + R), jnp.nan, jnp.float32)
    rng = np.random.default_rng(0)
    latent = jnp.asarray(rng.standard_normal((2, 3, C)), jnp.float32)
    rope_key = jnp.asarray(rng.standard_normal((2, 3, R)), jnp.float32)
    slots = jnp.asarray([[-1, 9, 10], [3, 4, -1]], jnp.int32)        # page 2 offsets 1, 2; page 0 offset 3, page 1 0
    out = np.asarray(jax.jit(mla_cache_write)(pool, latent, rope_key, slots, 1))
    written = {(9 // S, 9 % S): (0, 1), (10 // S, 10 % S): (0, 2), (0, 3): (1, 0), (1, 0): (1, 1)}
    for (page, offset), (b, t) in written.items():
        np.testing.assert_array_equal(out[1, 0, page, offset, 0, :C], latent[b, t])
        np.testing.assert_array_equal(out[1, 0, page, offset, 0, C:], rope_key[b, t])
    assert np.isnan(out[0]).all()
    assert np.isnan(out[1]).sum() == out[1].size - len(written) * (C + R)


@pytest.mark.parametrize("op", ["paged_mla", "mla_cache_write"])
def test_inference_only(op):
    call = make_call(1, [5], [1], T=1)
    if op == "paged_mla":
        f = lambda q: jnp.sum(paged_mla(**dict(call, q_nope=q), scale=SCALE))  # noqa: E731
        x = call["q_nope"]
    else:
        f = lambda lat: jnp.sum(mla_cache_write(call["pool"], lat, jnp.zeros((1, 1, R)),  # noqa: E731
                                                jnp.zeros((1, 1), jnp.int32), 0))
        x = jnp.zeros((1, 1, C))
    with pytest.raises(TypeError, match=f"{op} is inference-only"):
        jax.grad(f)(x)


# --- the training form ------------------------------------------------------------------------------

T_TRAIN = 33


def training_inputs(seed, T, B=2):
    rng = np.random.default_rng(seed)
    shapes = dict(q_nope=(B, T, H, Dn), q_rope=(B, T, H, R), latent=(B, T, C), rope_key=(B, T, R), w_k=(C, H, Dn),
                  w_v=(C, H, Dv))
    out = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    out["w_k"], out["w_v"] = out["w_k"] / np.sqrt(C), out["w_v"] / np.sqrt(C)
    return out, jnp.asarray(rng.standard_normal((B, T, H, Dv)), jnp.float32)


# make test runs 33 tokens in key blocks of 8 (five blocks, the last one partial); the others run in make test-slow.
@pytest.mark.parametrize("T, key_block", [pytest.param(1, 8, marks=pytest.mark.slow),
                                          pytest.param(7, 8, marks=pytest.mark.slow), (T_TRAIN, 8),
                                          pytest.param(T_TRAIN, 64, marks=pytest.mark.slow)])
def test_causal_form_and_gradients_match_reference(T, key_block):
    """mla_causal (blockwise, custom_vjp) against the dense reference and jax.grad of it, every argument's gradient
    of sum(w * out)."""
    inputs, w = training_inputs(11, T)
    names = list(inputs)

    def loss(f, *args):
        return jnp.sum(w * f(**dict(zip(names, args)), scale=SCALE))

    fast_f = functools.partial(mla_causal, key_block=key_block)
    out = jax.jit(fast_f, static_argnames="scale")(**inputs, scale=SCALE)
    want = jax.jit(mla_causal_reference, static_argnames="scale")(**inputs, scale=SCALE)
    assert_within(relative_error(out, want), tol.bound(tol.latent_attention_roundings(latent=C, rope=R, nope=Dn,
                                                                                       keys=T)), f"T {T}: output")
    argnums = tuple(range(len(names)))
    got = jax.jit(jax.grad(functools.partial(loss, fast_f), argnums=argnums))(*inputs.values())
    expected = jax.jit(jax.grad(functools.partial(loss, mla_causal_reference), argnums=argnums))(*inputs.values())
    bound = tol.bound(tol.latent_attention_grad_roundings(latent=C, rope=R, nope=Dn, value=Dv, keys=T, heads=H,
                                                          tokens=2 * T))
    for name, g, e in zip(names, got, expected):
        assert g.shape == inputs[name].shape
        assert_within(relative_error(g, e), bound, f"T {T}, key block {key_block}: d{name}")


def test_control_gradient_of_a_shifted_rope_key_fails():
    """Control: the gradient check catches a training form whose rotated keys are one position late."""
    inputs, w = training_inputs(13, T_TRAIN)
    shifted = lambda **a: mla_causal(**dict(a, rope_key=jnp.roll(a["rope_key"], 1, axis=1)), scale=SCALE)  # noqa: E731
    g_wrong = jax.jit(jax.grad(lambda x: jnp.sum(w * shifted(**dict(inputs, latent=x)))))(inputs["latent"])
    g_want = jax.jit(jax.grad(lambda x: jnp.sum(w * mla_causal_reference(**dict(inputs, latent=x), scale=SCALE))))(
        inputs["latent"])
    bound = tol.bound(tol.latent_attention_grad_roundings(latent=C, rope=R, nope=Dn, value=Dv, keys=T_TRAIN, heads=H,
                                                          tokens=2 * T_TRAIN))
    assert relative_error(g_wrong, g_want) > 100 * bound


def test_causal_form_equals_paged_prefill():
    """The training form and the paged form agree on a prompt written into pages from position 0 (the same math)."""
    inputs, _ = training_inputs(17, 13, B=1)
    pool = jnp.full((1, 1, 8, S, 1, C + R), jnp.nan, jnp.float32)
    tables = jnp.asarray([[5, 2, 7, 0]], jnp.int32)
    slots = jnp.asarray([[int(tables[0, j // S]) * S + j % S for j in range(13)]], jnp.int32)
    positions = jnp.arange(13, dtype=jnp.int32)[None]

    @jax.jit
    def paged(pool, a):
        pool = mla_cache_write(pool, a["latent"], a["rope_key"], slots, 0)
        return paged_mla(a["q_nope"], a["q_rope"], pool, 0, tables, positions, jnp.asarray([13], jnp.int32), a["w_k"],
                         a["w_v"], scale=SCALE, form=ABSORBED)

    causal = jax.jit(functools.partial(mla_causal, scale=SCALE))(**inputs)
    assert_within(relative_error(paged(pool, inputs), causal), BOUND, "paged absorbed vs causal training form")
