"""A tampered or broken artifact is refused at load, by name, before anything is compiled or allocated; and
the server reads no file the manifest does not list (issue 12, findings 3, 4, 5 and 9)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from tlaloc_jax import artifact as af
from tlaloc_jax.artifact.bounded_manifest import load_bounded
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve import engine as engine_module
from tlaloc_jax.serve.__main__ import main as serve_main
from tlaloc_jax.serve.tokenizer import load_tokenizer


@pytest.fixture
def artifact(http_artifacts, tmp_path):
    """A private copy of the HTTP tests' text artifact (tokenizer files included) to tamper with."""
    dst = tmp_path / "art"
    shutil.copytree(http_artifacts[0], dst)
    return dst


@pytest.fixture
def no_device(monkeypatch):
    """Any use of the device (creating a client, compiling, allocating) fails the test: a refusal must come first."""
    class Untouchable:
        def __init__(self, *a, **k):
            raise AssertionError("the device was touched before the artifact was refused")
    monkeypatch.setattr(engine_module, "Device", Untouchable)


def _edit(art: Path, fn) -> None:
    raw = json.loads((art / af.MANIFEST_NAME).read_text())
    fn(raw)
    (art / af.MANIFEST_NAME).write_text(json.dumps(raw))


def _pool_sigs(raw, name):
    for e in raw["entries"]:
        for s in e["inputs"] + e["outputs"]:
            if s["slot"] == name and s["role"] in ("POOL_IN", "POOL_OUT"):
                yield s


def _resize_pool(raw, pages):
    """The pool's size changed everywhere in the manifest (as a consistent tamper would), not in the bodies."""
    pool = raw["pools"][0]
    pool["capacity"] = pages
    pool["shape"][2] = pages
    for s in _pool_sigs(raw, pool["name"]):
        s["shape"][2] = pages


def _swap_bodies(raw):
    """The bodies of the first two decode entries (batch 1 and the next batch up) swapped."""
    a, b = [e for e in raw["entries"] if e["kind"] == "decode"][:2]
    for key in ("serialized", "serialized_sha256"):
        a[key], b[key] = b[key], a[key]


def _grow_vocab(raw, with_logits: bool):
    raw["model"]["vocab"] += 16
    if with_logits:
        for e in raw["entries"]:
            for s in e["outputs"]:
                if s["role"] == "LOGITS":
                    s["shape"][1] += 16


TAMPERS = {
    # Finding 4: what the bodies were compiled for differs from the manifest.
    "pool-resized": (lambda r: _resize_pool(r, 80), r"body .* does not match the manifest: argument \d+ \(POOL_IN kv\) "
                                                    r"is float32\[3, 2, 64, 8, 2, 16\] in the body, the manifest says float32\[3, 2, 80, 8, 2, 16\]"),
    "pool-2GiB": (lambda r: _resize_pool(r, 1 << 20), r"does not match the manifest: argument \d+ \(POOL_IN kv\)"),
    "bodies-swapped": (_swap_bodies, r"entry 'decode_b1_c\d+' body .* does not match the manifest: argument 0 "
                                     r"\(TOKEN_IDS\) is int32\[\d+, 1\] in the body"),
    "vocab-larger": (lambda r: _grow_vocab(r, False), r"model\.vocab is 304, but the embedding 'embed' has \[288, 64\] rows"),
    "vocab-and-logits-larger": (lambda r: (_grow_vocab(r, True), r["model"].update(embedding_slot="")),
                                r"result 0 \(LOGITS\) is float32\[1, 288\] in the body, the manifest says float32\[1, 304\]"),
    # Finding 9: refused with a message, never a traceback.
    "pool-negative": (lambda r: r["pools"][0].update(capacity=-4), r"pool 'kv' capacity must be positive"),
    "ladder-empty": (lambda r: r["buckets"].update(batch_ladder=[]), r"buckets\.batch_ladder is empty"),
    "no-entries": (lambda r: r.update(entries=[]), r"the manifest has no entries"),
}


@pytest.mark.parametrize("case", list(TAMPERS))
def test_a_tampered_manifest_is_refused_by_name_before_the_device_is_touched(artifact, no_device, case):
    edit, message = TAMPERS[case]
    _edit(artifact, edit)
    with pytest.raises(af.ManifestError, match=message):
        Engine.load(artifact, progress=False)


def test_unreadable_manifests_are_refused_by_name(artifact, no_device):
    for content, message in ((b'{"schema": "tlaloc-serving-v4", "model": "\xff\xfe"}', r"is not UTF-8 text"),
                             (b"[" * 100_000 + b"]" * 100_000, r"nests deeper than any manifest"),
                             (b'{"a":' * 40 + b"1" + b"}" * 40, r"nests deeper than any manifest")):
        (artifact / af.MANIFEST_NAME).write_bytes(content)
        with pytest.raises(af.ManifestError, match=message):
            Engine.load(artifact, progress=False)


def test_swapped_weight_files_and_an_edited_tokenizer_are_refused(artifact, no_device, caplog):
    """Finding 5: every weight and tokenizer file is hashed. Two same-length weight files swapped, or one
    edited character of tokenizer.json, are refused; --trust-weights skips the weights' hashes (and says so)
    but never the tokenizer's."""
    m = af.load_manifest(artifact)
    a, b = (next(w for w in m.weights if w.slot == s) for s in ("layers.attn_norm.0", "layers.mlp_norm.0"))
    assert a.nbytes == b.nbytes
    pa, pb = artifact / a.file, artifact / b.file
    da, db = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(db)
    pb.write_bytes(da)
    with pytest.raises(af.ManifestError, match=rf"weight 'layers.attn_norm.0' file .* has sha256 [0-9a-f]+, the "
                                              rf"manifest says {a.sha256}"):
        Engine.load(artifact, progress=False)
    # Trusted, the swap goes unnoticed by the hash (the sizes still agree): the device is reached.
    with caplog.at_level(logging.WARNING, logger="tlaloc_jax.serve"):
        with pytest.raises(AssertionError, match="the device was touched"):
            Engine.load(artifact, progress=False, trust_weights=True)
    assert "--trust-weights: the weight files" in caplog.text
    pa.write_bytes(da)
    pb.write_bytes(db)
    tok = artifact / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"a"', '"b"', 1))
    for trust in (False, True):
        with pytest.raises(af.ManifestError, match=r"tokenizer file 'tokenizer.json' has sha256"):
            Engine.load(artifact, progress=False, trust_weights=trust)


def _hashed_files(art: Path) -> list[Path]:
    """The files a load hashes: those the manifest gives a sha256 (of the bodies, only the bytecode the runtime
    compiles)."""
    m = af.load_manifest(art)
    bodies = [(e.serialized, e.serialized_sha256) for e in m.entries]
    listed = [*bodies, *((w.file, w.sha256) for w in m.weights), *((t.file, t.sha256) for t in m.tokenizer_files)]
    assert all(digest for _, digest in listed)
    return [art / f for f, _ in listed]


def test_a_file_changed_since_a_load_is_hashed_again_and_refused(artifact, no_device, tmp_path, monkeypatch):
    """A load remembers the sha256 of the files it hashed (FileDigests, in the cache directory): the next load
    reads none of them again. A weight file edited afterwards, its size and modification time put back, is hashed
    again (its change time moved) and refused by name. Control: remembering by size and modification time alone
    lets the edit through to the device."""
    cache = tmp_path / "cache"
    with pytest.raises(AssertionError, match="the device was touched"):
        Engine.load(artifact, progress=False, cache_dir=cache)
    files = _hashed_files(artifact)
    known = af.FileDigests(cache, artifact)
    assert [known.sha256(p) for p in files] == [af.sha256_file(p) for p in files] and known.reads == 0

    w = next(w for w in af.load_manifest(artifact).weights if w.slot == "layers.attn_norm.0")
    path, before = artifact / w.file, (artifact / w.file).stat()
    original = path.read_bytes()
    edited = bytes([original[0] ^ 1]) + original[1:]

    def write(data: bytes) -> None:
        path.write_bytes(data)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))

    write(edited)
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(af.ManifestError, match=rf"weight 'layers.attn_norm.0' file .* has sha256 [0-9a-f]+, the "
                                              rf"manifest says {w.sha256}"):
        Engine.load(artifact, progress=False, cache_dir=cache)

    monkeypatch.setattr(af.FileDigests, "_facts", staticmethod(lambda p: [p.stat().st_size, p.stat().st_mtime_ns]))
    write(original)
    with pytest.raises(AssertionError, match="the device was touched"):
        Engine.load(artifact, progress=False, cache_dir=cache)      # remembered by size and mtime ...
    write(edited)
    with pytest.raises(AssertionError, match="the device was touched"):
        Engine.load(artifact, progress=False, cache_dir=cache)      # ... the edit passes


def test_the_server_hashes_only_files_changed_since_its_last_start(artifact, no_device, tmp_path, monkeypatch):
    """`python -m tlaloc_jax.serve` checks the artifact before the device as Engine.load does, remembering the
    files' sha256 in its cache directory: a second start hashes none of them. Control: --cache-dir none hashes
    every file at every start."""
    from tlaloc_jax.artifact import digests as digests_module
    hashed = []

    def counting(path):
        hashed.append(path)
        return af.sha256_file(path)
    monkeypatch.setattr(digests_module, "sha256_file", counting)
    cache = tmp_path / "cache"
    for expected in ("every file", "none"):
        hashed.clear()
        with pytest.raises(AssertionError, match="the device was touched"):
            serve_main([str(artifact), "--cache-dir", str(cache), "--port", "0"])
        assert (len(hashed) == 0) == (expected == "none"), (expected, hashed)
    for _ in range(2):
        hashed.clear()
        with pytest.raises(AssertionError, match="the device was touched"):
            serve_main([str(artifact), "--cache-dir", "none", "--port", "0"])
        assert {p.resolve() for p in hashed} >= {p.resolve() for p in _hashed_files(artifact)}


def test_no_file_outside_the_manifest_is_read(artifact, tmp_path):
    """Finding 3: a chat_template.jinja the manifest does not list is never read (here a symlink to a file outside
    the artifact); one it lists but that leads outside is refused."""
    secret = tmp_path / "secret.txt"
    secret.write_text("{{ 'SECRET' }}")
    m = af.load_manifest(artifact)
    assert "chat_template.jinja" not in {t.file for t in m.tokenizer_files}
    for name in ("chat_template.jinja", "generation_config.json", "tokenizer_config.json"):
        if not (artifact / name).exists():
            os.symlink(secret, artifact / name)
    tok = load_tokenizer(artifact, m)
    assert "SECRET" not in (tok.chat_template or "")
    listed = next(t for t in m.tokenizer_files if t.file != "tokenizer.json")
    (artifact / listed.file).unlink(missing_ok=True)
    os.symlink(secret, artifact / listed.file)
    with pytest.raises(af.ManifestError, match=rf"tokenizer file path '{listed.file}' leaves the artifact directory"):
        af.load_manifest(artifact)


def test_pools_that_do_not_fit_the_device_are_refused_before_they_are_allocated(artifact, monkeypatch):
    """Finding 4: the pools' and weights' bytes are checked against the device's free memory first."""
    from tlaloc_jax.serve.runtime import pjrt
    monkeypatch.setattr(pjrt.Device, "memory_available", lambda self: 1000)

    def no_compile(self, *a, **k):
        raise AssertionError("compiled before the memory check")
    monkeypatch.setattr(pjrt.Device, "compile", no_compile)
    with pytest.raises(af.ManifestError, match=r"the artifact \S+ needs [\d.]+ MiB on the device \(weights [\d.]+ "
                                               r"MiB; pools kv [\d.]+ MiB\), and cpu has 0\.0 MiB free"):
        Engine.load(artifact, cache_dir=None, progress=False)


@pytest.mark.parametrize("case", ["non-utf8", "deep", "negative-pool", "corrupt-tokenizer", "missing"])
def test_the_server_refuses_a_bad_artifact_with_an_error_line_and_status_2(artifact, capsys, case):
    """Finding 9: `python -m tlaloc_jax.serve` prints `error: ...` and exits 2 (no traceback), a corrupt
    tokenizer.json included, which is read before anything compiles."""
    if case == "non-utf8":
        (artifact / af.MANIFEST_NAME).write_bytes(b"\xff\xfe\x00")
    elif case == "deep":
        (artifact / af.MANIFEST_NAME).write_bytes(b"[" * 50_000 + b"]" * 50_000)
    elif case == "negative-pool":
        _edit(artifact, lambda r: r["pools"][0].update(capacity=-1))
    elif case == "corrupt-tokenizer":
        (artifact / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
        digest = af.sha256_file(artifact / "tokenizer.json")
        _edit(artifact, lambda r: [t.update(sha256=digest) for t in r["tokenizer_files"] if t["file"] == "tokenizer.json"])
    else:
        shutil.rmtree(artifact)
    assert serve_main([str(artifact), "--cache-dir", "none", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    if case == "corrupt-tokenizer":
        assert "tokenizer file 'tokenizer.json' does not load" in err


def test_a_checkpoint_folder_is_refused_with_the_export_command(http_artifacts, capsys, no_device):
    """Issue 55: a Hugging Face checkpoint given where an artifact belongs: the error names the folder and the
    export command to run first (it said "no tlaloc-serving.json in the artifact directory")."""
    ck = http_artifacts[0].parent / "ck"
    assert (ck / "config.json").is_file() and not (ck / af.MANIFEST_NAME).exists()
    assert serve_main([str(ck), "--cache-dir", "none", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ck}: ") and "Traceback" not in err, err
    assert f"a Hugging Face checkpoint (config.json), not an artifact; export it first: python -m tlaloc_jax.export " \
           f"{ck} OUT_DIR, then serve OUT_DIR" in err, err
    with pytest.raises(af.ManifestError, match=rf"{ck}: no tlaloc-bounded.json .*tlaloc_jax.stage_bounded"):
        load_bounded(ck)
    # Any other folder without a manifest is named too.
    with pytest.raises(af.ManifestError, match=rf"^{http_artifacts[0].parent}: no tlaloc-serving.json in the "
                                               r"artifact directory$"):
        Engine.load(http_artifacts[0].parent, cache_dir=None)


def test_a_port_in_use_is_refused_before_anything_loads(artifact, capsys, monkeypatch):
    """Issue 55: `python -m tlaloc_jax.serve --port P` with P taken exits 2 naming the port before it reads the
    artifact (it found out only once the model had loaded); control: with the port free it goes on to load."""
    import socket

    def loading(*a, **k):
        raise af.ManifestError("reached loading")
    monkeypatch.setattr(af, "load_remembering", loading)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_main([str(artifact), "--cache-dir", "none", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: port {port} on 127.0.0.1 is in use") and "--port" in err, err
        assert "reached loading" not in err
    assert serve_main([str(artifact), "--cache-dir", "none", "--port", str(port)]) == 2
    assert capsys.readouterr().err == "error: reached loading\n"
