"""Building the native C kernels into their cache (tlaloc_jax.native), and what goes wrong there: no compiler, a
compiler that fails, one that exits 0 and writes nothing, an unwritable cache, a cached library that is empty,
truncated or not a library. Each fault is a NativeKernelError naming the kernel and the way out; a cached library
that does not load is rebuilt once (atomically, as three servers building into one cache need) before it is named
with the command that clears it. Loads run in a fresh process: a truncated library crashes the loader (SIGBUS), and
a library loaded once is kept by path for the life of a process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tlaloc_jax import native

TARGET = "tlaloc_decode_attention_v1"


@pytest.fixture
def cache(monkeypatch, tmp_path):
    folder = tmp_path / "cache"
    monkeypatch.setenv(native.ENV_CACHE, str(folder))
    monkeypatch.setenv(native.ENV_VARIANT, "build")       # these tests are about building here, not the prebuilt ones
    # What they load stays theirs: the process's loaded kernels and their variants are as before after each (a variant
    # left behind made the shipped facts of later tests in this worker differ from their compile workers').
    monkeypatch.setattr(native, "_loaded", dict(native._loaded))
    monkeypatch.setattr(native, "_variant", dict(native._variant))
    return folder


def logging_compiler(tmp_path: Path) -> tuple[str, Path]:
    """$CC for the system compiler that logs each run's arguments, one line a run."""
    log, script = tmp_path / "cc.log", tmp_path / "logging-cc"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec cc "$@"\n')
    script.chmod(0o755)
    return str(script), log


def builds(log: Path) -> int:
    return sum("-o" in line.split() for line in log.read_text().splitlines()) if log.exists() else 0


LOAD = f"from tlaloc_jax import native; assert native.handler({TARGET!r})"


def load_in_a_new_process() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True)


def test_a_machine_without_a_compiler_is_told_so(monkeypatch, cache):
    """No C compiler where the kernel is built: the error names the kernel, the compiler and the way out."""
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(native.NativeKernelError, match="'tlaloc_decode_attention_v1' is built on the serving machine "
                                                       "with a C compiler, and no-such-cc does not run.*install gcc "
                                                       "or clang.*--decode-attention xla"):
        native.library(TARGET)


def test_a_compiler_that_fails_is_named_with_its_output_and_the_way_out(monkeypatch, tmp_path, cache):
    cc = tmp_path / "broken-cc"
    cc.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo broken 1.0; exit 0; }\necho "no room left" >&2\nexit 1\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(native.NativeKernelError, match=r"(?s)'tlaloc_decode_attention_v1': .*broken-cc failed on "
                                                       r"decode_attention.c.*no room left.*install gcc or clang.*"
                                                       r"--decode-attention xla"):
        native.library(TARGET)
    assert list(cache.glob("*.so")) == []


@pytest.mark.parametrize("cc", ["true", "empty-cc"])
def test_a_compiler_that_writes_no_library_is_named(monkeypatch, tmp_path, cache, cc):
    """`CC=true` exits 0 and writes nothing; empty-cc leaves an empty file: neither is taken into the cache, and the
    error names the kernel, the compiler command and the way out."""
    if cc == "empty-cc":
        (tmp_path / cc).write_text('#!/bin/sh\nwhile [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
        (tmp_path / cc).chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CC", cc)
    with pytest.raises(native.NativeKernelError, match=f"'tlaloc_decode_attention_v1': {cc} exited 0 on "
                                                       "decode_attention.c but wrote no whole library.*install gcc or "
                                                       "clang.*--decode-attention xla"):
        native.library(TARGET)
    assert list(cache.glob("*.so")) == []


def test_an_unwritable_build_folder_is_named(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path / "a-file" / "native"))
    with pytest.raises(native.NativeKernelError, match="cannot write its build to .*a-file/native.*TLALOC_NATIVE_CACHE"):
        native.library(TARGET)


@pytest.mark.parametrize("damage", ["empty", "truncated", "not a library"])
def test_a_cached_library_that_does_not_load_is_rebuilt_once(monkeypatch, tmp_path, cache, damage):
    cc, log = logging_compiler(tmp_path)
    monkeypatch.setenv("CC", cc)
    path = native.library(TARGET)
    whole = path.read_bytes()
    assert builds(log) == 1 and path.parent == cache
    path.write_bytes({"empty": b"", "truncated": whole[:len(whole) // 2], "not a library": b"\0junk" * 4096}[damage])
    run = load_in_a_new_process()
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert builds(log) == 2 and path.read_bytes() == whole
    assert [p.name for p in cache.iterdir()] == [path.name]     # no build folder left behind
    assert load_in_a_new_process().returncode == 0 and builds(log) == 2


def test_three_processes_rebuild_one_damaged_library_at_once(monkeypatch, tmp_path, cache):
    """Three servers starting on one cache whose library was cut short: each rebuilds it and loads a whole one."""
    path = native.library(TARGET)
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 3])
    runs = [subprocess.Popen([sys.executable, "-c", LOAD], stderr=subprocess.PIPE, text=True) for _ in range(3)]
    assert [(r.wait(), r.stderr.read()[-2000:]) for r in runs] == [(0, "")] * 3
    assert path.read_bytes() == whole and [p.name for p in cache.iterdir()] == [path.name]


def test_a_library_that_still_does_not_load_is_named_with_the_command_to_clear_it(monkeypatch, tmp_path, cache):
    """A cached library that does not load, nor does its rebuild (here: every load fails): one rebuild, then the
    file and the command that clears it; a library built just now that does not load is named without a rebuild."""
    cc, log = logging_compiler(tmp_path)
    monkeypatch.setenv("CC", cc)
    monkeypatch.setattr(native, "_loaded", {})
    path = native.library(TARGET)

    def no_load(path, *a, **k):
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(native.ctypes, "CDLL", no_load)
    for runs in (2, 3):
        with pytest.raises(native.NativeKernelError) as err:
            native.handler(TARGET)
        assert builds(log) == runs
        message = str(err.value)
        assert "'tlaloc_decode_attention_v1'" in message and "failed to map segment" in message
        assert f"rm {path}" in message and f"rm -r {cache}" in message and "--decode-attention xla" in message
        path.unlink()                   # the second time round nothing is cached: one build, no rebuild


def test_every_cut_of_a_library_is_found_short(tmp_path, cache):
    """The check that keeps a truncated library from the loader: the whole file passes, each cut of it fails."""
    whole = native.library(TARGET).read_bytes()
    cut = tmp_path / "cut.so"
    cut.write_bytes(whole)
    assert not native._short(cut)
    for n in [*range(0, len(whole), max(1, len(whole) // 64)), len(whole) - 1]:
        cut.write_bytes(whole[:n])
        assert native._short(cut), n


def test_the_limits_come_from_the_build_and_key_it(monkeypatch, tmp_path, cache):
    """decode_attention.c's limits are written once, in native.DEFINES: the C file does not compile without them, and
    a changed limit is a new library in the cache."""
    run = subprocess.run(["cc", *native.FLAGS, f"-I{native.SOURCES}", str(native.SOURCES / native.KERNELS[TARGET]),
                          "-o", str(tmp_path / "no-limits.so")], capture_output=True, text=True)
    assert run.returncode and "MAX_GROUP and MAX_HEAD_DIM come from tlaloc_jax/native.py's DEFINES" in run.stderr
    first = native.library(TARGET)
    monkeypatch.setitem(native.DEFINES[TARGET], "MAX_GROUP", native.DEFINES[TARGET]["MAX_GROUP"] // 2)
    assert native.library(TARGET) != first and len(list(cache.glob("*.so"))) == 2
