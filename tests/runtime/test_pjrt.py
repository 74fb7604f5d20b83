"""tlaloc_jax.serve.runtime (the PJRT layer) against jax: bodies exported by jax.export run through the PJRT plugin.

jax is used here only to write StableHLO and to compute the expected numbers; everything that
runs a body goes through `Device`. Facts these tests pin are written up in docs/pjrt-notes.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export, lax

from margins import assert_within
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.serve.runtime.pjrt import (ENV_PLUGIN, CompileError, Device, DonationError,
                                   PluginNotFoundError, bytecode_stablehlo_version, find_plugin)
from tlaloc_jax.serve.runtime import pypjrt_compat

# The same bodies on both sides, but the plugin's XLA is newer than jaxlib's and may fuse and sum in
# other orders: each check's bound counts the roundings of its computation.
S = jax.ShapeDtypeStruct


def _export(f, *specs, donate=()):
    return export.export(jax.jit(f, donate_argnums=donate), platforms=["cpu"])(*specs)


@pytest.fixture(scope="module")
def dev():
    with Device() as d:
        yield d


# --------------------------------------------------------------------------- plugin and client


def test_default_plugin_is_the_installed_cpu_plugin(dev, monkeypatch):
    monkeypatch.delenv(ENV_PLUGIN, raising=False)
    assert find_plugin().endswith("lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so")
    assert dev.platform_name == "cpu"
    assert dev.plugin_package.startswith("lammps-jax-pjrt-cpu ")
    lo, hi = dev.stablehlo_versions
    assert lo <= (1, 0, 0) <= hi
    # The CPU plugin rejects the CUDA allocator options by name; they are dropped, not fatal.
    assert set(dev.ignored_options) == {"preallocate", "memory_fraction"}
    assert dev.create_options == {"cpu_device_count": 1}


def test_missing_plugin_error_names_the_path(tmp_path, monkeypatch):
    missing = tmp_path / "no_such_plugin.so"
    with pytest.raises(PluginNotFoundError, match=str(missing)):
        find_plugin(str(missing))
    with pytest.raises(PluginNotFoundError, match=str(missing)):
        Device(str(missing))
    monkeypatch.setenv(ENV_PLUGIN, str(missing))
    with pytest.raises(PluginNotFoundError, match=rf"{missing}.*\${ENV_PLUGIN}"):
        find_plugin()
    # An explicit path wins over the environment.
    assert find_plugin(_installed_cpu_plugin()) == _installed_cpu_plugin()


def _installed_cpu_plugin() -> str:
    import importlib.metadata as md
    dist = md.distribution("lammps-jax-pjrt-cpu")
    return str(next(dist.locate_file(f) for f in dist.files if f.name.endswith(".so")))


# --------------------------------------------------------------------------- numerics


@pytest.mark.numeric
def test_matmul_text_and_bytecode_match_jax(dev):
    f = lambda x, w: jnp.tanh(x @ w)
    exp = _export(f, S((8, 64), jnp.float32), S((64, 32), jnp.float32))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64), np.float32)
    w = rng.standard_normal((64, 32), np.float32) / 8
    want = np.asarray(jax.jit(f)(x, w))
    for body in (exp.mlir_module(), exp.mlir_module_serialized):
        exe = dev.compile(body)
        (out,) = dev.execute(exe, [dev.upload(x), dev.upload(w)])
        assert_within(relative_error(dev.to_host(out), want), tol.bound(64 + tol.TRANSCENDENTAL_ULPS), "tanh(x @ w)")


def _solve_lower_while(a, b):
    """Forward substitution a @ x = b (a lower triangular) in a lax.while_loop: the plain-ops
    form of solve_triangular, whose LAPACK custom_call the plugin refuses."""
    def body(carry):
        i, x = carry
        xi = (b[i] - a[i] @ x) / a[i, i]  # x[j] is still 0 for j >= i
        return i + 1, x.at[i].set(xi)
    return lax.while_loop(lambda c: c[0] < b.shape[0], body, (0, jnp.zeros_like(b)))[1]


@pytest.mark.numeric
def test_while_loop_matches_jax(dev):
    n = 12
    rng = np.random.default_rng(1)
    a = (np.tril(rng.standard_normal((n, n))) + 4 * np.eye(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    exp = _export(_solve_lower_while, S((n, n), jnp.float32), S((n,), jnp.float32))
    assert "stablehlo.while" in exp.mlir_module()
    (out,) = dev.execute(dev.compile(exp.mlir_module_serialized), [dev.upload(a), dev.upload(b)])
    got = dev.to_host(out)
    # Forward substitution: x[i] sums i products and divides; its path runs through every earlier x[j].
    bound = tol.bound(n * (n + 1) // 2 + n)
    assert_within(relative_error(got, jax.jit(_solve_lower_while)(a, b)), bound, "while-loop solve vs jax")
    # And against an independent oracle: jax's LAPACK solve, in-process.
    assert_within(relative_error(got, jax.scipy.linalg.solve_triangular(a, b, lower=True)), bound,
                  "while-loop solve vs LAPACK")


@pytest.mark.numeric
def test_random_and_argmax_match_jax(dev):
    def f(key_data, logits):
        key = jax.random.wrap_key_data(key_data)
        sampled = jax.random.categorical(key, logits)
        noise = jax.random.normal(jax.random.fold_in(key, 1), logits.shape)
        return sampled, jnp.argmax(logits + noise, axis=-1), noise
    key_data = np.asarray(jax.random.key_data(jax.random.key(7)))
    logits = np.random.default_rng(2).standard_normal((4, 50)).astype(np.float32)
    exp = _export(f, S(key_data.shape, key_data.dtype), S((4, 50), jnp.float32))
    outs = dev.execute(dev.compile(exp.mlir_module_serialized),
                       [dev.upload(key_data), dev.upload(logits)])
    want = jax.jit(f)(key_data, logits)
    # The sample: the same threefry bits and a Gumbel argmax over 50 logits a unit apart on average, where
    # the plugin's and jaxlib's log may differ by a few ulps: a tie that close has odds of about 1e-5.
    np.testing.assert_array_equal(dev.to_host(outs[0]), want[0])
    # Normal noise: threefry bits (exact), then erfinv and a scale.
    noise = dev.to_host(outs[2])
    assert_within(relative_error(noise, want[2]), tol.bound(tol.TRANSCENDENTAL_ULPS + 2), "noise")
    # The body's argmax is that of its own noisy logits.
    np.testing.assert_array_equal(dev.to_host(outs[1]), np.argmax(logits + noise, axis=-1))


def test_bf16_round_trip_and_body(dev):
    x = (np.random.default_rng(3).standard_normal(33) * 100).astype(ml_dtypes.bfloat16)
    buf = dev.upload(x)
    assert buf.dtype == np.dtype(ml_dtypes.bfloat16) and buf.shape == (33,)
    back = dev.to_host(buf)
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(back.view(np.uint16), x.view(np.uint16))  # bit for bit

    f = lambda v: (v * 3 + 1).astype(jnp.bfloat16)
    (out,) = dev.execute(dev.compile(_export(f, S((33,), jnp.bfloat16)).mlir_module_serialized),
                         [buf])
    got = dev.to_host(out)
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16),
                                  np.asarray(jax.jit(f)(x)).view(np.uint16))


def test_upload_shapes_and_read_only_memory(dev, tmp_path):
    assert dev.to_host(dev.upload(np.float32(2.5))) == np.float32(2.5)  # 0-d
    assert dev.to_host(dev.upload(np.zeros((0, 3), np.int32))).shape == (0, 3)
    strided = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]
    np.testing.assert_array_equal(dev.to_host(dev.upload(strided)), strided)
    # Weight files are mapped read-only; they upload without a writable copy.
    path = tmp_path / "w.bin"
    np.arange(10, dtype=np.float32).tofile(path)
    weights = np.memmap(path, np.float32, mode="r")
    assert not weights.flags.writeable
    np.testing.assert_array_equal(dev.to_host(dev.upload(weights)), np.arange(10))
    with pytest.raises(TypeError, match="cannot upload dtype complex64"):
        dev.upload(np.zeros(2, np.complex64))


def test_an_input_written_over_is_what_the_next_execution_reads(dev):
    """Device.overwrite puts a new value in a host-memory buffer: the next execution reads it, not the old one.
    It refuses (False, nothing written) another shape or dtype, and a buffer an execution took by donation."""
    exe = dev.compile(_export(lambda x: x * 2 + 1, S((2, 3), jnp.int32)).mlir_module_serialized)
    x0, x1 = np.arange(6, dtype=np.int32).reshape(2, 3), np.arange(6, 12, dtype=np.int32).reshape(2, 3)
    buf = dev.upload(x0)
    np.testing.assert_array_equal(dev.to_host(dev.execute(exe, [buf])[0]), x0 * 2 + 1)
    assert dev.overwrite(buf, x1)
    np.testing.assert_array_equal(dev.to_host(dev.execute(exe, [buf])[0]), x1 * 2 + 1)
    np.testing.assert_array_equal(dev.to_host(buf), x1)
    assert not dev.overwrite(buf, x1.astype(np.int64)) and not dev.overwrite(buf, x1[:1])
    assert not dev.overwrite(buf, x1.T.copy())
    np.testing.assert_array_equal(dev.to_host(buf), x1)
    pool = dev.upload(x0)
    dev.execute(dev.compile(_export(lambda p: p + 1, S((2, 3), jnp.int32), donate=(0,)).mlir_module_serialized),
                [pool], donate={0})
    assert pool.consumed and not dev.overwrite(pool, x1)


def _mapping(address: int) -> tuple[str, set[str]]:
    """The /proc/self/smaps entry holding `address`: (its maps line, its VmFlags)."""
    line, flags, found = "", set(), None
    for text in open("/proc/self/smaps"):
        head = text.split()
        if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            line = text
            found = lo <= address < hi
        elif found and head[0] == "VmFlags:":
            return line, set(head[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_pools_and_large_weights_are_private_memory_marked_for_huge_pages(dev, tmp_path):
    """A pool is private anonymous memory marked MADV_HUGEPAGE (a shared one, Python's mmap default, is shmem: no huge
    pages unless shmem_enabled says so). Weights of 2 MiB or more are read, one after another, into one such mapping
    from a 2 MiB boundary where the kernel offers huge pages, and adopted; a smaller one is its file's mapping
    (control: the file's pages, shared)."""
    from tlaloc_jax import artifact as af
    from tlaloc_jax.serve.runtime import sharded
    pool = sharded.zeros(dev, "float32", (1024, 1024), (), None)
    line, flags = _mapping(dev.device_address(pool))
    assert line.split()[1].endswith("p") and "hg" in flags, (line, flags)
    values = {"big": np.arange(1 << 20, dtype=np.float32), "odd": np.arange(589_825, dtype=np.float32) * 2,
              "small": np.arange(1024, dtype=np.float32)}       # odd: 2.25 MiB and 4 bytes, not a whole page
    for name, v in values.items():
        (tmp_path / f"{name}.bin").write_bytes(v.tobytes())
    files = [af.WeightFile(name, "float32", v.shape, v.nbytes, file=f"{name}.bin") for name, v in values.items()]
    placed = sharded.upload_weights(dev, tmp_path, files, None)
    assert list(placed) == list(values)
    lines = {}
    for name, v in values.items():
        np.testing.assert_array_equal(dev.to_host(placed[name]), v)
        line, flags = _mapping(dev.device_address(placed[name]))
        lines[name] = line
        if name != "small" and sharded.huge_pages_offered():
            assert not line.rstrip().endswith(f"{name}.bin") and line.split()[1].endswith("p") and "hg" in flags, \
                (line, flags)
        else:
            assert line.rstrip().endswith(f"{name}.bin"), line
    if sharded.huge_pages_offered():
        big, odd = dev.device_address(placed["big"]), dev.device_address(placed["odd"])
        assert lines["big"] == lines["odd"] and big % sharded.HUGE_PAGE == 0 and odd == big + (4 << 20)
    (tmp_path / "big.bin").write_bytes(values["big"].tobytes()[:-4])    # a file shorter than its weight is refused
    with pytest.raises((af.ManifestError, ValueError), match="big.bin holds 4194300 bytes|mmap length"):
        sharded.upload_weights(dev, tmp_path, files[:1], None)


def test_host_arena_cuts_page_aligned_runs_from_a_2mib_boundary():
    """host_arena: each run starts on a page after the one before, the first on a 2 MiB boundary; zero sizes give
    empty runs; runs are writable and apart (control: writing one leaves its neighbour as it was)."""
    import mmap
    from tlaloc_jax.serve.runtime import sharded
    runs = sharded.host_arena([5, 3 << 20, 0, 4096])
    starts = [r.ctypes.data for r in runs]
    assert [len(r) for r in runs] == [5, 3 << 20, 0, 4096]
    assert starts[0] % sharded.HUGE_PAGE == 0
    assert starts[1] == starts[0] + mmap.PAGESIZE and starts[3] == starts[1] + (3 << 20)
    runs[1][:] = 7
    runs[3][:] = 9
    assert runs[0].sum() == 0 and (runs[1] == 7).all() and (runs[3] == 9).all()
    assert [len(r) for r in sharded.host_arena([0, 0])] == [0, 0]


# --------------------------------------------------------------------------- donation


P, D = 16, 8  # pool rows (pages), row width


def _write_row(pool, idx, val):
    """Scatter one row into the pool; return a reduction of it (the "logits") and the pool."""
    pool = pool.at[idx].set(val)
    return pool.sum(axis=1), pool


def _step_inputs(dev, i):
    return dev.upload(np.int32(i % P)), dev.upload(np.full(D, i + 1, np.float32))


def test_donated_pool_is_updated_in_place(dev):
    exp = _export(_write_row, S((P, D), jnp.float32), S((), jnp.int32), S((D,), jnp.float32),
                  donate=(0,))
    assert "tf.aliasing_output = 1" in exp.mlir_module()
    exe = dev.compile(exp.mlir_module_serialized, name="write_row")
    assert exe.num_outputs == 2  # the (sums, pool) tuple comes back as two buffers

    pool = first = dev.upload(np.zeros((P, D), np.float32))
    home = dev.device_address(pool)
    in_place = 0
    for i in range(100):
        sums, new_pool = dev.execute(exe, [pool, *_step_inputs(dev, i)], donate={0})
        assert pool.consumed and dev.is_consumed(pool)
        in_place += dev.device_address(new_pool) == home
        pool = new_pool
    assert in_place == 100

    want = np.zeros((P, D), np.float32)
    for i in range(100):
        want[i % P] = i + 1
    np.testing.assert_array_equal(dev.to_host(pool), want)
    np.testing.assert_array_equal(dev.to_host(sums), want.sum(axis=1))

    # A consumed buffer is refused by name, not read after free.
    with pytest.raises(ValueError, match="device memory is gone"):
        dev.to_host(first)
    with pytest.raises(ValueError, match="argument 0 is donated"):
        dev.execute(exe, [first, *_step_inputs(dev, 0)], donate={0})


def test_an_adopted_pool_and_weight_are_their_host_memory(dev, tmp_path):
    """Device.adopt on the CPU plugin: no copy. A pool from host_zeros is updated in place, in the array's own
    memory (what the runtime's load relies on: pages touched when written, not at load); a weight file's read-only
    np.memmap is the weight's device memory. Control: the same zeros one element off the page boundary cannot be
    adopted, so they are copied (another address, the array untouched by the runs)."""
    from tlaloc_jax.serve.runtime.sharded import host_zeros
    exp = _export(_write_row, S((P, D), jnp.float32), S((), jnp.int32), S((D,), jnp.float32), donate=(0,))
    exe = dev.compile(exp.mlir_module_serialized, name="write_row")
    host = host_zeros((P, D), np.float32)
    unaligned = host_zeros((P * D + 1,), np.float32)[1:].reshape(P, D)
    for array, adopted in ((host, True), (unaligned, False)):
        pool = dev.adopt(array)
        assert (dev.device_address(pool) == array.ctypes.data) == adopted
        for i in range(3 * P):
            _, pool = dev.execute(exe, [pool, *_step_inputs(dev, i)], donate={0})
        want = np.repeat(np.arange(2 * P + 1, 3 * P + 1, dtype=np.float32)[:, None], D, axis=1)
        np.testing.assert_array_equal(dev.to_host(pool), want)
        np.testing.assert_array_equal(array, want if adopted else np.zeros((P, D), np.float32))

    weights = np.arange(P * D, dtype=np.float32).reshape(P, D)
    weights.tofile(tmp_path / "w.bin")
    mapped = np.memmap(tmp_path / "w.bin", dtype=np.float32, mode="r", shape=(P, D))
    w = dev.adopt(mapped)
    assert dev.device_address(w) == mapped.ctypes.data
    double = dev.compile(_export(lambda x: x * 2, S((P, D), jnp.float32)).mlir_module_serialized)
    (out,) = dev.execute(double, [w])
    np.testing.assert_array_equal(dev.to_host(out), weights * 2)
    np.testing.assert_array_equal(dev.to_host(w), weights)


def test_control_without_donation_copies_every_step(dev):
    """Same aliased body, pool not donated: the input survives and every output is a copy."""
    exp = _export(_write_row, S((P, D), jnp.float32), S((), jnp.int32), S((D,), jnp.float32),
                  donate=(0,))
    exe = dev.compile(exp.mlir_module_serialized)
    pool = dev.upload(np.zeros((P, D), np.float32))
    copied = 0
    for i in range(100):
        before = dev.to_host(pool)
        _, new_pool = dev.execute(exe, [pool, *_step_inputs(dev, i)], donate=())
        assert not pool.consumed
        np.testing.assert_array_equal(dev.to_host(pool), before)  # the input is untouched
        copied += dev.device_address(new_pool) != dev.device_address(pool)
        pool.close()
        pool = new_pool
    assert copied == 100


def test_control_body_without_alias_refuses_donation(dev):
    """A body exported without donate_argnums has no alias: asking to donate raises, and the
    input and the outputs are all still there."""
    exp = _export(_write_row, S((P, D), jnp.float32), S((), jnp.int32), S((D,), jnp.float32))
    assert "tf.aliasing_output" not in exp.mlir_module()
    exe = dev.compile(exp.mlir_module_serialized)
    pool = dev.upload(np.zeros((P, D), np.float32))
    with pytest.raises(DonationError, match=r"donated argument\(s\) \[0\] were not consumed") as e:
        dev.execute(exe, [pool, *_step_inputs(dev, 3)], donate={0})
    assert not pool.consumed
    assert dev.device_address(e.value.outputs[1]) != dev.device_address(pool)
    assert dev.to_host(e.value.outputs[1])[3].tolist() == [4.0] * D


def test_plugin_checks_argument_count_and_bytes_only(dev):
    """The plugin refuses a wrong argument count or byte size, naming the executable, but runs
    an argument of the right size with the wrong shape or dtype: checking those against the
    manifest is the caller's job."""
    from pypjrt.errors import InvalidArgument
    exe = dev.compile(_export(_write_row, S((P, D), jnp.float32), S((), jnp.int32),
                              S((D,), jnp.float32)).mlir_module_serialized, name="write_row")
    idx, val = _step_inputs(dev, 0)
    with pytest.raises(InvalidArgument, match=r"write_row .*supplied 2 arguments .*expected 3"):
        dev.execute(exe, [dev.upload(np.zeros((P, D), np.float32)), idx])
    with pytest.raises(InvalidArgument, match=r"(?s)write_row .*expected parameter 0 of size 512"):
        dev.execute(exe, [dev.upload(np.zeros((P, D + 1), np.float32)), idx, val])
    for wrong in (np.zeros((D, P), np.float32), np.zeros((P, D), np.int32)):
        _, pool = dev.execute(exe, [dev.upload(wrong), idx, val])
        assert pool.shape == (P, D) and pool.dtype == np.float32


def test_memory_stats_reveal_a_pool_copied_inside_the_body(dev):
    """The address check proves the output was written over the donated pool, not that XLA did
    not copy the pool on the way. Reading a slice of the pool in the same step as updating it
    makes XLA's CPU compiler copy the whole pool into temp memory; a write alone does not."""
    rows, width = 64, 256
    specs = (S((rows, width), jnp.float32), S((), jnp.int32), S((width,), jnp.float32))
    pool_bytes = rows * width * 4
    write_only = lambda pool, i, v: (v.sum(), pool.at[i].set(v))
    read_and_write = lambda pool, i, v: (pool[i].sum(), pool.at[i].set(v))
    stats = {}
    for name, f in (("write_only", write_only), ("read_and_write", read_and_write)):
        exe = dev.compile(_export(f, *specs, donate=(0,)).mlir_module_serialized)
        stats[name] = exe.memory_stats()
        assert stats[name]["alias_size_in_bytes"] == pool_bytes
        pool = dev.upload(np.zeros((rows, width), np.float32))
        home = dev.device_address(pool)
        _, new = dev.execute(exe, [pool, dev.upload(np.int32(1)),
                                   dev.upload(np.ones(width, np.float32))], donate={0})
        assert dev.device_address(new) == home  # in place at the buffer level, both times
    assert stats["write_only"]["temp_size_in_bytes"] < pool_bytes
    assert stats["read_and_write"]["temp_size_in_bytes"] >= pool_bytes


# --------------------------------------------------------------------------- compile


def _mlp(x, w):
    def layer(i, h):
        h = jax.nn.gelu(h @ w[i])
        return (h - h.mean(-1, keepdims=True)) * lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
    return lax.fori_loop(0, w.shape[0], layer, x).sum()


def test_compile_cache_hit_skips_compilation(tmp_path):
    body = _export(_mlp, S((4, 128), jnp.float32), S((6, 128, 128), jnp.float32)
                   ).mlir_module_serialized
    x = np.random.default_rng(4).standard_normal((4, 128), np.float32)
    w = np.random.default_rng(5).standard_normal((6, 128, 128), np.float32) / 12
    results = {}
    for run in ("miss", "hit"):
        with Device(cache_dir=tmp_path) as d:
            exe = d.compile(body, name="mlp")
            assert exe.cache == run
            (out,) = d.execute(exe, [d.upload(x), d.upload(w)])
            results[run] = (exe.seconds, d.to_host(out))
    print(f"\ncompile {results['miss'][0] * 1e3:.1f} ms, cache load "
          f"{results['hit'][0] * 1e3:.1f} ms")
    assert results["hit"][0] < results["miss"][0]
    np.testing.assert_array_equal(results["hit"][1], results["miss"][1])

    # Controls: a truncated entry, or one whose executable bytes were altered, is not handed to
    # the plugin; it is recompiled ("stale") and rewritten.
    (entry,) = tmp_path.glob("*.pypjrta")
    good = entry.read_bytes()
    for damaged in (good[:200], good[:-100] + bytes(100)):
        entry.write_bytes(damaged)
        with Device(cache_dir=tmp_path) as d:
            assert d.compile(body).cache == "stale"
            assert d.compile(body).cache == "hit"


def test_compile_cache_is_keyed_by_xla_flags_and_host_cpu(tmp_path, monkeypatch):
    """An executable compiled under other XLA flags (--xla_cpu_max_isa changes the code), or on another CPU,
    is not taken from the cache: the key holds both."""
    from tlaloc_jax.serve.runtime import compile_cache
    body = _export(lambda x: jnp.tanh(x) * 2, S((4, 8), jnp.float32)).mlir_module_serialized
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    with Device(cache_dir=tmp_path) as d:
        assert d.compile(body).cache == "miss"
    with Device(cache_dir=tmp_path) as d:
        assert d.compile(body).cache == "hit"
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    with Device(cache_dir=tmp_path) as d:
        assert d.compile(body).cache == "miss"
    monkeypatch.setattr(compile_cache, "host_cpu", lambda: "another CPU")
    with Device(cache_dir=tmp_path) as d:
        assert d.compile(body).cache == "miss"


def test_refused_custom_call_is_named(dev):
    f = lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True)
    exp = _export(f, S((4, 4), jnp.float32), S((4,), jnp.float32))
    with pytest.raises(CompileError,
                       match="No FFI handler registered for lapack_strsm_ffi") as e:
        dev.compile(exp.mlir_module_serialized, name="solve")
    assert e.value.target == "lapack_strsm_ffi"


def test_bytecode_version_checked_against_plugin(dev):
    body = _export(lambda x: x + 1, S((3,), jnp.float32)).mlir_module_serialized
    version = bytecode_stablehlo_version(body)
    lo, hi = dev.stablehlo_versions
    assert version is not None and lo <= version <= hi
    assert bytecode_stablehlo_version(b"module {}") is None
    future = body.replace(b"StableHLO_v%d.%d.%d" % version, b"StableHLO_v9.%d.%d" % version[1:])
    with pytest.raises(CompileError, match=r"StableHLO 9\.\d+\.\d+ bytecode; .* reads "
                                           r"0\.9\.0 to 1\.20\.0"):
        dev.compile(future)


# --------------------------------------------------------------------------- jax-free


def test_runs_with_jax_imports_forbidden(tmp_path):
    exp = _export(_write_row, S((P, D), jnp.float32), S((), jnp.int32), S((D,), jnp.float32),
                  donate=(0,))
    (tmp_path / "body.mlirbc").write_bytes(exp.mlir_module_serialized)
    script = textwrap.dedent(f"""
        import sys
        class Guard:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "flax", "torch", "transformers"):
                    raise ImportError("forbidden in the serving process: " + name)
        sys.meta_path.insert(0, Guard())
        import numpy as np
        from tlaloc_jax.serve.runtime import Device
        with Device() as dev:
            exe = dev.compile(open({str(tmp_path / 'body.mlirbc')!r}, "rb").read())
            pool = dev.upload(np.zeros(({P}, {D}), np.float32))
            home = dev.device_address(pool)
            for i in range(10):
                _, new = dev.execute(exe, [pool, dev.upload(np.int32(i)),
                                           dev.upload(np.ones({D}, np.float32))], donate={{0}})
                assert pool.consumed and dev.device_address(new) == home
                pool = new
            print("ok", dev.to_host(pool).sum())
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONWARNINGS": "error::ResourceWarning"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", str(10.0 * D)]


def test_an_unsupported_pypjrt_is_refused_by_name(monkeypatch):
    """The runtime reaches into pypjrt's private handles and lock (serve/runtime/pypjrt_compat.py): a pypjrt it was
    not written for is refused when a Device is made, naming both versions; the pinned one is taken."""
    pypjrt_compat.check_version(pypjrt_compat.SUPPORTED_PYPJRT[-1])
    with pytest.raises(RuntimeError, match=r"pypjrt 0\.2\.0 is installed; .* install pypjrt==0\.1\.1"):
        pypjrt_compat.check_version("0.2.0")
    monkeypatch.setattr(pypjrt_compat.metadata, "version", lambda name: "0.2.0")
    with pytest.raises(RuntimeError, match=r"pypjrt 0\.2\.0 is installed"):
        Device()


def test_execute_keeps_the_results_asked_for_and_reuses_its_structs(dev):
    """keep: the other results come back as None (released at once); the kept ones read right on every call,
    and donated pools stay in place, through the hot PJRT calls."""
    assert isinstance(dev._hot, pypjrt_compat.HotCalls)

    def f(pool, x):
        return pool + x[0], x * 2.0, jnp.sum(x), x.astype(jnp.int32)
    exp = _export(f, S((4, 8), jnp.float32), S((3,), jnp.float32), donate=(0,))
    exe = dev.compile(exp.mlir_module_serialized)
    pool = dev.upload(np.zeros((4, 8), np.float32))
    for i in range(4):
        x = np.array([i, i + 0.5, -i], np.float32)
        before = dev.device_address(pool)
        outs = dev.execute(exe, [pool, dev.upload(x)], donate={0}, keep={0, 2})
        assert outs[1] is None and outs[3] is None and pool.consumed
        pool = outs[0]
        assert dev.device_address(pool) == before                  # the donated pool, written in place
        assert dev.to_host(outs[2]) == pytest.approx(x.sum())
        np.testing.assert_array_equal(dev.to_host(pool), np.full((4, 8), sum(range(i + 1)), np.float32))
    assert exe._out_meta[1] == ((3,), np.dtype(np.float32), True)
    assert len(exe._calls) == 1
    # Every result when keep is not given; a consumed argument is refused by name.
    outs = dev.execute(exe, [pool, dev.upload(x)], donate={0})
    np.testing.assert_array_equal(dev.to_host(outs[3]), x.astype(np.int32))
    with pytest.raises(ValueError, match="argument 0 is donated"):
        dev.execute(exe, [pool, dev.upload(x)], donate={0})
