"""The C decode attention kernel (kernels/decode_attention.c, called through
tlaloc_jax/kernels/paged_attention_native.py as an FFI custom call jax runs in process) against the naive reference,
at the edge cases the other decode kernels' tests cover; its refusals and limits; the vendored FFI header.

Every pool is NaN wherever no key was written, so a read of such a slot that reaches an output shows up as a NaN.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_calls import D, M, S, assert_controls_fail, make_call
from margins import assert_within
from tlaloc_jax import native
from tlaloc_jax.kernels import paged_attention_reference
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.paged_attention import _window_array
from tlaloc_jax.kernels.paged_attention_native import (MAX_GROUP, MAX_HEAD_DIM, NATIVE_DECODE_ATTENTION, _native_decode,
                                                       native_decode_attention, register_in_process)
from tlaloc_jax.kernels.tolerances import relative_error

pytestmark = pytest.mark.numeric

SCALE = 0.4
# The kernel and the reference are the same math over at most M * S keys, summed in other orders and with
# another softmax arithmetic (the kernel's exp a polynomial of a few ulps); both widen a bf16 pool to f32 first.
BOUND = tol.bound(tol.attention_roundings(D, M * S))


@functools.partial(jax.jit, static_argnames=("soft_cap",))
def kernel(call, window, *, soft_cap=None, sinks=None):
    return native_decode_attention(*call, scale=SCALE, window=window, soft_cap=soft_cap, sinks=sinks)


@functools.partial(jax.jit, static_argnames=("soft_cap",))
def reference(call, window, *, soft_cap=None, sinks=None):
    return paged_attention_reference(*call, scale=SCALE, window=window, soft_cap=soft_cap, sinks=sinks)


def check(call, window=0, **kw):
    """The kernel matches the reference; padding and empty rows get 0. -> the kernel's output."""
    out = kernel(call, jnp.int32(window), **kw)
    want = reference(call, jnp.int32(window), **kw)
    assert out.dtype == jnp.float32 and out.shape == call.q.shape and np.all(np.isfinite(out))
    assert_within(relative_error(out, want), BOUND, f"native decode vs reference, window {window}, {kw}")
    dead = np.asarray(call.positions[:, 0]) < 0
    np.testing.assert_array_equal(np.asarray(out)[dead], 0.0)
    return out


EDGES = [1, 4, 5, 16, 17, 48, 3, 0]  # length 1, at and one past a page (4) and 16, the full bucket, empty


@pytest.mark.parametrize("H, K, dtype", [(4, 4, np.float32), (4, 2, jnp.bfloat16), (8, 2, np.float32),
                                         (6, 2, jnp.bfloat16)], ids=["G1-f32", "G2-bf16", "G4-f32", "G3-bf16"])
def test_decode_matches_reference(H, K, dtype):
    """Lengths 1, a page boundary and one past, the full bucket, an empty row, a padding row with keys; GQA ratios
    1, 2, 4 and 3, f32 and bf16 pools; with and without a window (traced: one compile)."""
    call = make_call(H + K, EDGES, H=H, K=K, dtype=dtype, padding=(6,))
    check(call)
    check(call, window=5)
    check(call, window=17)
    check(call._replace(positions=jnp.full_like(call.positions, -1)))   # no live row: all 0


@pytest.mark.parametrize("head_dim", [64, 128, 18])
def test_head_sizes(head_dim):
    """Head sizes 64 and 128, which the kernel compiles as constants, and 18, whole vectors on no instruction set
    (its rows copied and padded with zeros); f32 and bf16 pools."""
    bound = tol.bound(tol.attention_roundings(head_dim, M * S))
    for dtype in (np.float32, jnp.bfloat16):
        call = make_call(head_dim, EDGES, H=6, K=2, dtype=dtype, padding=(6,), head_dim=head_dim)
        for window in (0, 5):
            got = kernel(call, jnp.int32(window))
            assert np.all(np.isfinite(got))
            assert_within(relative_error(got, reference(call, jnp.int32(window))), bound,
                          f"native decode, head size {head_dim}, {dtype}, window {window}")


def test_pages_longer_than_a_chunk():
    """Pages of 80 keys, which the kernel takes a chunk of 32 at a time (two whole and one part), from a page's
    start and from within one (a window), G = 4."""
    lengths = [1, 31, 32, 33, 80, 81, 200, 240]
    bound = tol.bound(tol.attention_roundings(64, 240))
    call = make_call(5, lengths, H=8, K=2, head_dim=64, page_size=80, width=3)
    for window in (0, 45):
        assert_within(relative_error(kernel(call, jnp.int32(window)), reference(call, jnp.int32(window))), bound,
                      f"native decode, pages of 80, window {window}")


def test_soft_cap_and_sinks():
    """Soft-capped scores and sinks. Control: the same without the sinks is far off."""
    call = make_call(11, [1, 16, 17, 48, 0], H=4, K=2)
    sinks = jnp.asarray(np.random.default_rng(31).standard_normal(4) + 1.0, jnp.float32)
    out = check(call, window=7, soft_cap=2.0, sinks=sinks)
    assert relative_error(out, reference(call, jnp.int32(7), soft_cap=2.0)) > 0.05


def test_windows_skip_pages_left_behind():
    """A window that leaves whole pages behind: those pages are NaN (an allocator may free them)."""
    window = 8
    lengths = [48, 45, 36, 33]
    call = make_call(5, lengths)
    pool = np.array(call.kv_pool)
    for b, length in enumerate(lengths):
        for m in range(max(length - window, 0) // S):
            pool[:, :, call.block_tables[b, m]] = np.nan
    check(call._replace(kv_pool=jnp.asarray(pool)), window=window)


def test_controls_that_must_fail():
    """Plausible bugs the comparison catches: a causal length one short, a wrong GQA head mapping."""
    assert_controls_fail(kernel, reference, BOUND)


def test_a_page_outside_the_pool_is_refused_not_read():
    """A block table naming a page past the pool fails the call by the kernel's name instead of reading past it."""
    call = make_call(3, [9, 5])
    tables = np.array(call.block_tables)
    tables[0, 1] = call.kv_pool.shape[2] + 1000
    with pytest.raises(Exception, match="tlaloc_decode_attention_v1: a block table names a page outside the pool"):
        np.asarray(kernel(call._replace(block_tables=jnp.asarray(tables)), jnp.int32(0)))


@pytest.mark.parametrize("case, why", [
    (dict(T=2), "one token a row, not 2"),
    (dict(H=5), f"at most {MAX_GROUP} query heads a KV head"),
    (dict(dtype=jnp.int8), "a int8 pool: it reads f32 or bf16 pools"),
])
def test_refusals_name_the_reason(case, why):
    T, H = case.get("T", 1), case.get("H", 4)
    q = jax.ShapeDtypeStruct((2, T, H, D), jnp.float32)
    pool = jax.ShapeDtypeStruct((1, 2, 8, S, 2, D), case.get("dtype", jnp.float32))
    ints = [jax.ShapeDtypeStruct(s, jnp.int32) for s in ((2, 4), (2, T), (2,))]
    with pytest.raises(ValueError, match=why):
        jax.eval_shape(lambda q, p, t, pos, n: native_decode_attention(q, p, 0, t, pos, n, scale=1.0),
                       q, pool, *ints)


@pytest.mark.parametrize("group, head_dim", [(MAX_GROUP + 1, 8), (1, MAX_HEAD_DIM + 8)])
def test_the_c_kernel_holds_the_limits_the_python_side_checks(group, head_dim):
    """The kernel is compiled with the limits refusal() checks (tlaloc_jax.native.DEFINES): a call past one of them,
    sent around refusal(), is refused by the kernel naming both numbers; a call at both runs."""
    def call(g, d):
        q, pool = jnp.ones((1, 1, g, d), jnp.float32), jnp.ones((1, 2, 1, S, 1, d), jnp.float32)
        ints = jnp.zeros((1, 1), jnp.int32)
        return np.asarray(_native_decode(1.0, 0.0, q, pool, jnp.int32(0), ints, ints, jnp.ones((1,), jnp.int32),
                                         _window_array(None), None))

    register_in_process()
    assert (call(min(group, MAX_GROUP), min(head_dim, MAX_HEAD_DIM)) == 1).all()
    with pytest.raises(Exception, match=f"exceed {MAX_GROUP} query heads a KV head, {MAX_HEAD_DIM} a head"):
        call(group, head_dim)


def test_lowers_to_one_custom_call_per_layer():
    """What a served body holds: the kernel's target, once a call."""
    call = make_call(1, [5, 9])
    text = jax.jit(lambda c: native_decode_attention(*c, scale=SCALE)).lower(call).as_text()
    assert text.count(f"stablehlo.custom_call @{NATIVE_DECODE_ATTENTION}") == 1


def test_vendored_header_is_jaxlibs():
    """The FFI header the runtime builds against (vendored, so a runtime needs no jaxlib) is jaxlib's own."""
    jaxlib = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    assert native.HEADER.read_bytes() == jaxlib.read_bytes()


def test_build_follows_xlas_isa_limit(monkeypatch):
    """`make test-isa` limits XLA's code with --xla_cpu_max_isa; the C kernels are built for the same limit."""
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX")
    assert native.march() == "-march=sandybridge"
    monkeypatch.setenv("XLA_FLAGS", "")
    assert native.march() == "-march=native"


def test_unknown_kernel_is_refused_by_name():
    with pytest.raises(native.NativeKernelError, match="'tlaloc_flash_v9' is not one this runtime has"):
        native.library("tlaloc_flash_v9")
