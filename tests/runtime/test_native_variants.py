"""The C kernels prebuilt at install for a few instruction-set levels (tlaloc_jax.native.VARIANTS): the loader takes the
best one the CPU has within XLA's ISA limit, passes over a stale one, and a host with no C compiler serves the
default demo artifact from them (the container's conditions: no compiler on PATH, CC unset, an empty kernel cache,
a read-only artifact folder) with the ids of this process's Engine. Where no kernel can be had, the server says so in
one line naming every kernel and the export flags that drop them."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tlaloc_jax import native

def loaded_in_a_new_process(**env) -> dict:
    """{kernel: variant} a fresh process loads, under `env` on top of this one's (a library loaded is kept for the
    life of a process, so each setting needs its own)."""
    code = ("import json; from tlaloc_jax import native\n"
            "for t in native.KERNELS: native.handler(t)\n"
            "print(json.dumps({'loaded': {t: native.loaded_variant(t) for t in native.KERNELS},"
            " 'usable': [v.name for v in native.usable_variants()]}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


def expected_level(isa: str | None) -> str:
    """The variant a CPU with this one's features loads under XLA's ISA limit `isa`, from the level definitions
    (not from the loader's own choice)."""
    have = native.cpu_features()
    if isa in (None, "AVX512") and native._V4 | {"avx512_vnni"} <= have:
        return "x86-64-v4-vnni"
    if isa in (None, "AVX512") and native._V4 <= have:
        return "x86-64-v4"
    if isa in (None, "AVX512", "AVX2") and native._V3 <= have:
        return "x86-64-v3"
    return "x86-64-v2"


@pytest.mark.skipif(native.machine() != "x86_64", reason="the x86-64 levels; aarch64's variants are not tested here")
@pytest.mark.parametrize("isa", [None, "AVX2", "AVX"])
def test_the_best_level_within_the_isa_limit_is_loaded(isa):
    """No limit: this CPU's best level; XLA limited to AVX2 (no AVX-512): v3; to AVX (no AVX2): v2."""
    env = {"XLA_FLAGS": f"--xla_cpu_max_isa={isa}"} if isa else {"XLA_FLAGS": ""}
    got = loaded_in_a_new_process(**env)
    want = expected_level(isa)
    assert got["loaded"] == {t: want for t in native.KERNELS}, got
    assert got["usable"][0] == want


def test_the_override_picks_a_lower_level_and_refuses_one_the_cpu_lacks(monkeypatch):
    usable = native.usable_variants()
    got = loaded_in_a_new_process(**{native.ENV_VARIANT: usable[-1].name})
    assert set(got["loaded"].values()) == {usable[-1].name}
    monkeypatch.setenv(native.ENV_VARIANT, "x86-64-v9")
    with pytest.raises(native.NativeKernelError, match="TLALOC_NATIVE_VARIANT='x86-64-v9' is not a variant"):
        native._prebuilt("tlaloc_projection_v1")


def test_a_process_of_two_variants_hands_both_to_a_new_one(monkeypatch):
    """A process whose kernels loaded different variants (one under an override, or built here) hands each kernel's
    to a new process (its compile workers: their facts must be its own) as target=name pairs. Control: one name for
    all, as before, would load the first kernel's variant for both."""
    usable = native.usable_variants()
    low, best = usable[-1].name, usable[0].name
    first, *others = sorted(native.KERNELS)
    variants = {first: low, **{t: best for t in others}}
    monkeypatch.setattr(native, "_variant", variants)
    env = native.loaded_variant_env()
    assert env == ({native.ENV_VARIANT: ",".join(f"{t}={v}" for t, v in variants.items())} if low != best
                   else {native.ENV_VARIANT: low})
    assert loaded_in_a_new_process(**env)["loaded"] == variants
    assert loaded_in_a_new_process(**{native.ENV_VARIANT: low})["loaded"] == {t: low for t in variants}
    monkeypatch.setattr(native, "_variant", {})
    assert native.loaded_variant_env() == {}


def copied_sources(tmp_path: Path) -> Path:
    """kernels/ with its prebuilt libraries, copied."""
    return Path(shutil.copytree(native.SOURCES, tmp_path / "kernels"))


def test_a_prebuilt_library_from_other_sources_is_passed_over(monkeypatch, tmp_path):
    """Editing a kernel's source after the install makes its prebuilt libraries stale: the loader passes them over
    (and builds the kernel here). Control: the unedited copy's libraries are taken."""
    target = "tlaloc_projection_v1"
    monkeypatch.delenv(native.ENV_VARIANT, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    folder = copied_sources(tmp_path)
    monkeypatch.setattr(native, "SOURCES", folder)
    found = native._prebuilt(target)
    assert found is not None and found[1] == native.usable_variants()[0].name
    source = folder / native.KERNELS[target]
    source.write_text(source.read_text() + "\n/* edited */\n")
    assert native._prebuilt(target) is None


def test_a_host_without_a_compiler_serves_the_demo_artifact(tmp_path, serve_cache_dir):
    """The container's conditions: no C compiler on PATH and CC unset, an empty kernel cache, a read-only artifact
    folder. The default demo artifact (which calls the native kernels) serves, with this process's ids, and nothing
    is built."""
    from tlaloc_jax.serve import Engine
    from tlaloc_jax.tools.demo import export_demo

    art = tmp_path / "artifact"
    export_demo(art)
    assert json.loads((art / "tlaloc-serving.json").read_text())["versions"]["custom_calls"]
    for path in [*art.rglob("*"), art]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    prompts = [[1, 2, 3, 4], [7, 8, 9]]
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as engine:
        want = engine.generate(prompts, max_new_tokens=8)
    empty, kernel_cache = tmp_path / "bin", tmp_path / "native-cache"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", native.ENV_VARIANT)}
    env.update(PATH=str(empty), **{native.ENV_CACHE: str(kernel_cache)}, XLA_FLAGS="")
    calls = json.loads((art / "tlaloc-serving.json").read_text())["versions"]["custom_calls"]
    code = ("import json, sys; from tlaloc_jax.serve import Engine; from tlaloc_jax import native\n"
            f"with Engine.load({str(art)!r}, cache_dir=None, progress=False) as e:\n"
            f"    ids = e.generate({prompts!r}, max_new_tokens=8)\n"
            f"print(json.dumps({{'ids': ids, 'variants': [native.loaded_variant(t) for t in {calls!r}]}}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["ids"] == [list(map(int, ids)) for ids in want]
    assert all(v in [x.name for x in native.usable_variants()] for v in got["variants"]), got
    assert not kernel_cache.exists() or not any(kernel_cache.iterdir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_kernel_to_be_had_is_one_line_naming_every_kernel_and_the_flags(tmp_path):
    """No prebuilt variant taken and no compiler: the server exits 2 with one line naming each kernel the artifact
    calls and the export flags that stage it without them; no traceback."""
    from tlaloc_jax.tools.demo import export_demo
    art = tmp_path / "artifact"
    export_demo(art)
    calls = json.loads((art / "tlaloc-serving.json").read_text())["versions"]["custom_calls"]
    assert len(calls) == 2
    env = {**os.environ, "CC": "no-such-cc", native.ENV_VARIANT: "build", native.ENV_CACHE: str(tmp_path / "nc")}
    run = subprocess.run([sys.executable, "-m", "tlaloc_jax.serve", str(art), "--port", str(free_port()),
                          "--cache-dir", "none", "--no-progress"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    [line] = [x for x in run.stderr.splitlines() if x.startswith("error:")]
    assert all(t in line for t in calls) and all(native.WITHOUT[t] in line for t in calls), line
    assert "no-such-cc does not run" in line
