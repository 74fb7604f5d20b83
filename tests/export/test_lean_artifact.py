"""The lean artifact (tlaloc-serving-v5): the runtime needs the manifest and each body's portable bytecode
(`.mlirbc`), from which it reads @main; the textual StableHLO (`.mlir`) and jax's serialization (`.exported`) are
export options, and programs/ is gone. v2 and v3 artifacts load with those files deleted, their bodies checked
from the bytecode."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from jax import export as jax_export

from hf_models import build_checkpoint
from tlaloc_jax import artifact as af
from tlaloc_jax.export import export_checkpoint
from test_artifact_refusals import no_device  # noqa: F401  (the fixture: any use of the device fails the test)
from tlaloc_jax.serve import Engine

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LADDER = dict(batch_ladder=(1, 2), context_ladder=(32,), block_size=8, prefill_chunk=16, prefill_long_chunk=0,
              decode_steps=2, progress=False)
DEBUG_FILES = ("*.mlir", "*.exported")


def _copy_without_debug_files(src: Path, dst: Path) -> Path:
    """The artifact with every .mlir, .exported and programs/ file left out."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*DEBUG_FILES, "programs"))
    return dst


def test_a_default_export_writes_the_manifest_the_bytecode_and_the_weights_alone(http_artifacts):
    art = http_artifacts[0]
    m = af.load_manifest(art)
    assert m.schema == af.SCHEMA_V5
    assert {f"bodies/{p.name}" for p in (art / "bodies").iterdir()} == {e.serialized for e in m.entries}
    assert not (art / "programs").exists()
    raw = json.loads((art / af.MANIFEST_NAME).read_text())
    assert all(not {"body", "exported", "program"} & set(e) for e in raw["entries"])


def test_the_debug_files_are_written_when_asked_and_agree_with_the_bytecode(tmp_path):
    """With mlir and exported, each entry lists its .mlir and .exported with their sha256; jax's own reading of the
    .exported body gives the argument and result types the runtime reads from the bytecode. The artifact loads and
    serves with both deleted."""
    ck = build_checkpoint(tmp_path / "ck", "llama", seed=3)
    art = tmp_path / "art"
    m = export_checkpoint(ck, art, mlir=True, exported=True, **LADDER)
    for e in m.entries:
        for rel, digest in ((e.body, e.body_sha256), (e.exported, e.exported_sha256), (e.serialized,
                                                                                       e.serialized_sha256)):
            assert hashlib.sha256((art / rel).read_bytes()).hexdigest() == digest, rel
        assert e.body.endswith(".mlir") and "func.func public @main" in (art / e.body).read_text()
        sig = af.main_signature((art / e.serialized).read_bytes())
        exp = jax_export.deserialize(bytearray((art / e.exported).read_bytes()))
        assert [(str(a.dtype), a.shape) for a in exp.in_avals] == [(d, s) for d, s, _ in sig.args], e.name
        assert [(str(a.dtype), a.shape) for a in exp.out_avals] == list(sig.results), e.name
        assert {i: o for i, (_, _, o) in enumerate(sig.args) if o is not None} == \
            {i: o for o, i in e.donations}, e.name
    lean = _copy_without_debug_files(art, tmp_path / "lean")
    assert not list(lean.rglob("*.mlir")) and not list(lean.rglob("*.exported"))
    eng = Engine.load(lean, progress=False)
    try:
        want = Engine.load(art, progress=False)
        try:
            assert eng.generate([[5, 17, 3]], 4) == want.generate([[5, 17, 3]], 4)
        finally:
            want.close()
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["artifact_v2", "artifact_v3"])
def test_an_older_artifact_loads_without_its_text_bodies_exported_bodies_and_programs(name, tmp_path, no_device):
    """Its bodies are checked from the bytecode alone: a copy without .mlir, .exported and programs/ loads, and the
    same copy with two entries' bytecode swapped (hashes and all) is refused by the body's @main."""
    art = _copy_without_debug_files(FIXTURES / name, tmp_path / name)
    m = af.load_manifest(art)
    assert m.schema in (af.SCHEMA_V2, af.SCHEMA_V3) and not (art / "programs").exists()
    raw = json.loads((art / af.MANIFEST_NAME).read_text())
    a, b = raw["entries"][0], next(e for e in raw["entries"] if e["batch"] != raw["entries"][0]["batch"])
    for key in ("serialized", "serialized_sha256"):
        a[key], b[key] = b[key], a[key]
    (art / af.MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(af.ManifestError, match=rf"entry '{a['name']}' body .* does not match the manifest: "):
        Engine.load(art, progress=False)


@pytest.mark.parametrize("damage,message", [
    (lambda data: data[:len(data) // 2], r"is cut short"),
    (lambda data: b"not bytecode" + data, r"is not MLIR bytecode"),
    (lambda data: data.replace(b"main", b"mian"), r"has no public @main"),
])
def test_a_body_whose_bytecode_cannot_be_read_is_refused_by_name(http_artifacts, tmp_path, no_device, damage,
                                                                 message):
    art = tmp_path / "art"
    shutil.copytree(http_artifacts[0], art)
    raw = json.loads((art / af.MANIFEST_NAME).read_text())
    entry = raw["entries"][0]
    path = art / entry["serialized"]
    data = damage(path.read_bytes())
    path.write_bytes(data)
    for e in raw["entries"]:
        if e["serialized"] == entry["serialized"]:
            e["serialized_sha256"] = hashlib.sha256(data).hexdigest()
    (art / af.MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(af.ManifestError, match=rf"entry '{entry['name']}' body {message}"):
        Engine.load(art, progress=False)
