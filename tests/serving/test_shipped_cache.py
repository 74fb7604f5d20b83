"""Issue 59, cold start: an artifact ships its entries compiled at export (`<artifact>/compile-cache/`,
serve/runtime/shipped_cache.py). Its first start on a host like the export's compiles nothing and gives the ids of
an engine that compiled them; on another CPU (or plugin, flags, kernel variant) the folder is not used, with one
line naming what differs; a damaged file, or one holding another entry's executable, is compiled over, never run.
Controls: with the host check or the file check disabled, the shipped executables are used, which the tests catch.
"""

from __future__ import annotations

import logging
import shutil

import pypjrt
import pytest

from tlaloc_jax import artifact as af
from step_spy import count_compiles
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.runtime import compile_cache, shipped_cache

PROMPT = [5, 17, 99, 3, 250, 8, 61]


@pytest.fixture(scope="module")
def shipped(http_artifacts, tmp_path_factory, serve_cache_dir):
    """(the ids artifact with its entries compiled into compile-cache/, the ids an engine without it gives)."""
    art = tmp_path_factory.mktemp("shipped") / "ids"
    shutil.copytree(http_artifacts[1], art)
    n, _ = shipped_cache.fill(art)
    assert n > 1 and (art / shipped_cache.FOLDER / shipped_cache.INDEX).is_file()
    with Engine.load(http_artifacts[1], cache_dir=serve_cache_dir, progress=False) as engine:
        want = engine.generate([PROMPT], 6)[0]
    return art, want


def _how(engine) -> dict[str, str]:
    """entry -> how its executable was had, every entry loaded first."""
    engine.compile_all()
    return {name: exe.cache for name, exe in engine.runner.executables.items()}


def test_a_fresh_artifacts_first_start_compiles_nothing(shipped, tmp_path, monkeypatch):
    art, want = shipped
    counts = count_compiles(monkeypatch)
    with Engine.load(art, cache_dir=tmp_path / "empty", progress=False) as engine:
        assert engine.entries_to_compile() == []          # ready at once: /health answers 200 without compiling
        how = _how(engine)
        assert set(how.values()) == {"shipped"} and len(how) == len(engine.manifest.entries)
        assert engine.generate([PROMPT], 6)[0] == want
    assert counts["compile"] == 0


def _start_on_another_cpu(art, cache, monkeypatch, caplog) -> dict[str, str]:
    monkeypatch.setattr(compile_cache, "host_cpu", lambda: "x86_64\nmodel name: another CPU\nflags: sse2")
    with caplog.at_level(logging.WARNING, logger="tlaloc_jax.serve"):
        with Engine.load(art, cache_dir=cache, progress=False) as engine:
            return _how(engine)


def test_shipped_entries_compiled_for_another_cpu_are_not_used(shipped, tmp_path, monkeypatch, caplog):
    art, _ = shipped
    counts = count_compiles(monkeypatch)
    how = _start_on_another_cpu(art, tmp_path / "empty", monkeypatch, caplog)
    assert "shipped" not in how.values() and counts["compile"] == len(how)
    lines = [r.getMessage() for r in caplog.records if "compiled for another" in r.getMessage()]
    assert len(lines) == 1 and "host_cpu" in lines[0], lines


def test_control_without_the_host_check_another_cpu_would_run_them(shipped, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(shipped_cache, "differences", lambda here, there: [])
    how = _start_on_another_cpu(shipped[0], tmp_path / "empty", monkeypatch, caplog)
    assert set(how.values()) == {"shipped"}               # what the test above tells apart


def _swap_and_damage(art, tmp_path, damage: bool):
    """A copy of the artifact whose shipped file for one entry holds another entry's executable and, with
    `damage`, a third entry's file cut short. -> (copy, the swapped entry, the damaged one or None)."""
    copy = tmp_path / "art"
    shutil.copytree(art, copy)
    files = {pypjrt.Artifact.read(p).metadata["name"]: p
             for p in sorted((copy / shipped_cache.FOLDER).glob("*.pypjrta"))}
    (a, pa), (_, pb), (c, pc) = list(files.items())[:3]
    pa.write_bytes(pb.read_bytes())
    if damage:
        pc.write_bytes(pc.read_bytes()[:-64])
    return copy, a, c if damage else None


def test_a_damaged_or_misplaced_shipped_executable_is_compiled_over(shipped, tmp_path, caplog):
    copy, swapped, damaged = _swap_and_damage(shipped[0], tmp_path, damage=True)
    with caplog.at_level(logging.WARNING, logger="tlaloc_jax.serve"):
        with Engine.load(copy, cache_dir=tmp_path / "empty", progress=False) as engine:
            # Compiled at load (the first of its kind) or before /health answers 200, never counted as cached.
            pending = {e.name for e in engine.entries_to_compile()}
            assert pending <= {swapped, damaged} <= pending | set(engine.runner.executables)
            how = _how(engine)
            assert engine.generate([PROMPT], 6)[0] == shipped[1]
    assert how[swapped] == how[damaged] == "miss"
    assert {k for k, v in how.items() if v == "shipped"} == set(how) - {swapped, damaged}
    lines = [r.getMessage() for r in caplog.records if "fails its check" in r.getMessage()]
    assert len(lines) == 2 and any(swapped in m for m in lines) and any(damaged in m for m in lines), lines


def test_control_without_the_file_check_another_entrys_executable_would_run(shipped, tmp_path, monkeypatch):
    def unchecked(self, key, body_sha256):
        path = self._path(key)
        return (pypjrt.Artifact.read(path).executable, "hit") if path.is_file() else (None, "miss")
    monkeypatch.setattr(compile_cache.CompileCache, "read", unchecked)
    copy, swapped, _ = _swap_and_damage(shipped[0], tmp_path, damage=False)
    with Engine.load(copy, cache_dir=tmp_path / "empty", progress=False) as engine:
        assert engine.entries_to_compile() == []
        assert _how(engine)[swapped] == "shipped"         # what the test above tells apart (never run here)


def test_the_export_cli_ships_the_entries_compiled_unless_told_not_to(http_artifacts, tmp_path, capsys):
    from tlaloc_jax.export.__main__ import main
    small = ["--batch-ladder", "1", "--context-ladder", "32", "--block-size", "8", "--prefill-chunk", "16",
             "--prefill-long-chunk", "0", "--quiet"]
    ck = http_artifacts[1].parent / "ck"
    assert main([str(ck), str(tmp_path / "shipped"), *small]) == 0
    assert "compiled" in capsys.readouterr().out
    index = tmp_path / "shipped" / shipped_cache.FOLDER / shipped_cache.INDEX
    shipped_files = len(list(index.parent.glob("*.pypjrta")))
    assert index.is_file() and shipped_files == len(af.load_manifest(tmp_path / "shipped").entries)
    assert main([str(ck), str(tmp_path / "plain"), *small, "--no-compile-cache"]) == 0
    assert not (tmp_path / "plain" / shipped_cache.FOLDER).exists()
