"""python -m tlaloc_jax.export: the artifact, its bodies against the in-process decoder, and refusals."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jax_export
from safetensors.numpy import load_file

import tlaloc_jax
from bodies import entry_args, run_body
from hf_models import build_checkpoint
from margins import assert_within
from tlaloc_jax import artifact as af
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.export import ExportError, check_custom_calls, export_checkpoint
from tlaloc_jax.export._entries import check_body
from tlaloc_jax.serve.core.kv_cache import UnitPool
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs, pages_for

LADDER = dict(batch_ladder=(1, 2), context_ladder=(32, 64), block_size=8, prefill_chunk=16, prefill_long_chunk=0,
              progress=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    return {"llama": build_checkpoint(root / "llama", "llama", seed=11),
            "qwen3-tied": build_checkpoint(root / "qwen3", "qwen3", tied=True, seed=12)}


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("art")
    return {k: (export_checkpoint(v, root / k, mlir=True, exported=True, **LADDER), root / k)
            for k, v in checkpoints.items()}


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["llama", pytest.param("qwen3-tied", marks=pytest.mark.slow)])
def test_bodies_match_the_in_process_decoder(name, checkpoints, artifacts):
    m, art = artifacts[name]
    model = tlaloc_jax.load_hf(checkpoints[name], block_size=m.block_size)
    rng = np.random.default_rng(0)
    kv = m.pool("kv")
    for entry in m.entries:
        if entry.kind == "mixed":
            continue        # two row groups: tests/serving/test_mixed.py compares them against the two calls they replace
        alloc = UnitPool(kv.capacity)
        rows = []
        for b in range(entry.batch):
            n = int(rng.integers(1, entry.tokens_per_seq + 1))
            start = 0 if entry.kind == "prefill" else int(rng.integers(0, entry.context - 1))
            if entry.kind == "decode":
                n = 1
            start = min(start, entry.context - n)
            pages = alloc.take(pages_for(start + n, m.block_size))
            rows.append(RowCall(rng.integers(0, m.model.vocab, n).tolist(), start, pages))
        inputs = build_step_inputs(rows, batch=entry.batch, tokens=entry.tokens_per_seq,
                                   width=entry.context // m.block_size, block_size=m.block_size)
        pool = rng.standard_normal(kv.shape).astype(np.float32)
        want_logits, want_pools = model.step({"kv": jnp.asarray(pool)}, inputs)
        out = run_body(art, entry, entry_args(entry, inputs, {"kv": pool}, model.weights))
        logits, nxt = out["logits"], out["next_token"]
        # The body and jax.jit compile the same function, possibly fused and summed in other orders.
        bound = tol.bound(tol.decoder_roundings_of(model.config, context=entry.context))
        assert_within(relative_error(logits, want_logits), bound, f"{name} {entry.name}: logits")
        assert_within(relative_error(out["kv"], want_pools["kv"]), bound, f"{name} {entry.name}: KV pool")
        # NEXT_TOKEN is the argmax of the body's own logits (the in-process argmax may differ at a near-tie).
        np.testing.assert_array_equal(np.asarray(nxt), np.argmax(np.asarray(logits), -1))


def test_every_donated_pool_parameter_carries_tf_aliasing_output(artifacts):
    m, art = artifacts["llama"]
    for e in m.entries:
        text = (art / e.body).read_text()
        main = re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S).group(1)
        args = re.findall(r"%arg(\d+): tensor<[^>]*>(\s*\{[^}]*\})?", main)
        aliased = {int(i): re.search(r"tf\.aliasing_output = (\d+)", a).group(1) for i, a in args
                   if "tf.aliasing_output" in a}
        pool_in = 10 if e.kind == "mixed" else 5       # after the step inputs (a mixed entry's two groups of 5)
        assert aliased == {pool_in: "2"}, e.name
        assert e.donations == ((2, pool_in),)
        assert (e.inputs[pool_in].role, e.inputs[pool_in].slot) == (af.Role.POOL_IN, "kv")
        assert (e.outputs[2].role, e.outputs[2].slot) == (af.Role.POOL_OUT, "kv")


def test_entries_follow_the_ladders(artifacts):
    m, _ = artifacts["llama"]
    names = sorted(e.name for e in m.entries)
    # Mixed entries (decode rows and a 16-token chunk) at the largest decode batch, below MIXED_MIN_BATCH rows;
    # decode entries at the largest context alone (the native decode attention: decode_contexts).
    assert names == sorted([f"prefill_b{b}_c{c}" for b in (1, 2) for c in (32, 64)]
                           + [f"decode_b{b}_c64" for b in (1, 2)] + [f"mixed_b2_t16_c{c}" for c in (32, 64)])
    for e in m.entries:
        assert e.tokens_per_seq == (1 if e.kind == "decode" else 16)
    assert m.pool("kv").capacity == 2 * 64 // 8     # the largest batch at the largest context


def _hash_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_is_byte_identical_twice(checkpoints, artifacts, tmp_path):
    _, first = artifacts["qwen3-tied"]
    export_checkpoint(checkpoints["qwen3-tied"], tmp_path / "again", mlir=True, exported=True, **LADDER)
    a, b = _hash_tree(first), _hash_tree(tmp_path / "again")
    assert a == b and len(a) > 10


def test_tied_head_has_no_head_weight_and_linears_are_out_in(checkpoints, artifacts):
    m, art = artifacts["qwen3-tied"]
    assert not {"head", "head.out_in"} & {w.slot for w in m.weights}
    assert "head.out_in" in {w.slot for w in artifacts["llama"][0].weights}
    slots = {w.slot: w for w in m.weights}

    def read(slot):
        return np.frombuffer((art / slots[slot].file).read_bytes(), "<f4").reshape(slots[slot].shape)

    # The per-layer layout (tlaloc_jax.layout): one file per layer, q|k|v and gate|up joined on the output axis,
    # each projection [out, in] as torch stores it (layers.OutMajor).
    hf = load_file(checkpoints["qwen3-tied"] / "model.safetensors")
    layer = "model.layers.2."
    np.testing.assert_array_equal(read("attn.o_proj.2.out_in"), hf[layer + "self_attn.o_proj.weight"])
    np.testing.assert_array_equal(read("attn.qkv_proj.2.out_in"), np.concatenate(
        [hf[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"], axis=0))
    np.testing.assert_array_equal(read("layers.gate_up_proj.2.out_in"), np.concatenate(
        [hf[layer + f"mlp.{p}_proj.weight"] for p in ("gate", "up")], axis=0))
    assert not {"attn.q_proj.2", "attn.o_proj", "attn.o_proj.2", "layers.gate_proj.2.out_in"} & set(slots)


def _broken_copy(art: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(art, dst)
    return dst


def _edit_manifest(path: Path, fn):
    raw = json.loads((path / af.MANIFEST_NAME).read_text())
    fn(raw)
    (path / af.MANIFEST_NAME).write_text(json.dumps(raw))


def test_manifest_refusals_name_the_fault(artifacts, tmp_path):
    _, art = artifacts["llama"]
    cases = [
        (lambda r: r.update(schema="tlaloc-serving-v9"), r"unknown manifest schema version 'tlaloc-serving-v9'"),
        (lambda r: r["pools"][0].pop("capacity"), r"missing field manifest\.pools\[0\]\.capacity"),
        (lambda r: r["entries"][0].update(serialized_sha256="0" * 64),
         r"entry 'prefill_b1_c32' serialized body .* has sha256"),
        (lambda r: r["weights"][1].update(file="../../etc/passwd"), r"weight '\S+' file path '\.\./\.\./etc/passwd' "
                                                                     r"leaves the artifact directory"),
        (lambda r: r["weights"][1].update(file="/etc/passwd"), r"weight '\S+' file path '/etc/passwd' is not relative"),
    ]
    for i, (edit, message) in enumerate(cases):
        dst = _broken_copy(art, tmp_path / str(i))
        _edit_manifest(dst, edit)
        with pytest.raises(af.ManifestError, match=message):
            af.load_manifest(dst)
    af.load_manifest(art)      # control: the unedited artifact loads


def test_wrong_weight_length_and_symlink_out_are_refused(artifacts, tmp_path):
    _, art = artifacts["llama"]
    dst = _broken_copy(art, tmp_path / "len")
    m = af.load_manifest(dst)
    w = m.weights[0]
    with open(dst / w.file, "ab") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(af.ManifestError, match=rf"weight '{w.slot}' file '{re.escape(w.file)}' has \d+ bytes"):
        af.load_manifest(dst)
    dst = _broken_copy(art, tmp_path / "link")
    outside = tmp_path / "outside.bin"
    outside.write_bytes((dst / m.weights[1].file).read_bytes())
    (dst / m.weights[1].file).unlink()
    os.symlink(outside, dst / m.weights[1].file)
    with pytest.raises(af.ManifestError, match=rf"weight '{m.weights[1].slot}' file path .* leaves the artifact directory"):
        af.load_manifest(dst)


def test_custom_call_the_plugin_lacks_is_refused_by_name():
    def solve(a, b):
        return jax.scipy.linalg.solve_triangular(a, b, lower=True)
    exp = jax_export.export(jax.jit(solve), platforms=["cpu"])(
        jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((4, 2), jnp.float32))
    with pytest.raises(ExportError, match=r"custom_call 'lapack_strsm_ffi'"):
        check_custom_calls("solve", exp.mlir_module())


def test_dropped_argument_is_refused_by_name():
    def f(x, unused):
        return x * 2
    sigs = [af.TensorSig(af.Role.TOKEN_IDS, "float32", (2,)), af.TensorSig(af.Role.WEIGHT, "float32", (3,), "layers.ghost")]
    exp = jax_export.export(jax.jit(f), platforms=["cpu"])(*(jax.ShapeDtypeStruct(s.shape, jnp.float32) for s in sigs))
    with pytest.raises(ExportError, match=r"dropped unused inputs \['layers\.ghost'\]"):
        check_body("f", exp, sigs, [af.TensorSig(af.Role.LOGITS, "float32", (2,))])


def test_cli_subprocess_and_help(checkpoints, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "tlaloc_jax.export", "--help"], capture_output=True, text=True,
                         env=env, check=True).stdout
    for opt in ("--batch-ladder", "--context-ladder", "--prefill-max-batch", "--prefill-chunk", "--block-size",
                "--num-blocks", "--weight-dtype", "--kv-dtype", "--attention-block", "--no-mixed"):
        assert opt in out
    r = subprocess.run([sys.executable, "-m", "tlaloc_jax.export", str(checkpoints["llama"]), str(tmp_path / "a"),
                        "--batch-ladder", "1", "--context-ladder", "32", "--block-size", "8", "--weight-dtype", "bf16",
                        "--quiet", "--no-compile-cache"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    m = af.load_manifest(tmp_path / "a")
    assert {w.dtype for w in m.weights} == {"bfloat16"}
    assert sorted(e.name for e in m.entries) == ["decode_b1_c32", "mixed_b1_t32_c32", "prefill_b1_c32"]
    r = subprocess.run([sys.executable, "-m", "tlaloc_jax.export", str(tmp_path / "nope"), str(tmp_path / "b")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "no config.json" in r.stderr
