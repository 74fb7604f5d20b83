"""An artifact whose decode entries call the native C attention kernel (export decode_attention="native"), served by
the JAX-free runtime: the manifest names the kernel (and the projection kernel, which cpu exports use for f32 decode
rows by default), the runtime builds and registers them before compiling, and the
served ids are transformers' (near-tie rule, tests/support/oracle.py), alone and four at once, with a control that must fail.
A runtime that lacks the kernel, or cannot build it, refuses the artifact at load, by the kernel's name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_models import build_checkpoint, load_hf_torch, torch_greedy
from oracle import GreedyMismatch, check_served_greedy, kv_one_slot_off
from tlaloc_jax import native
from tlaloc_jax.checkpoint import load_checkpoint
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.paged_attention_native import NATIVE_DECODE_ATTENTION
from tlaloc_jax.kernels.projection_native import NATIVE_PROJECTION

pytestmark = pytest.mark.numeric

PROMPTS = [[(i * 37 + 11) % 256 for i in range(40)], [42], [5, 17, 99, 3, 249, 8, 61], [(i * 11 + 5) % 253
                                                                                      for i in range(23)]]
NEW = 12


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tlaloc_jax.export import export_checkpoint
    path = build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=81)
    art = tmp_path_factory.mktemp("art") / "native"
    export_checkpoint(path, art, batch_ladder=(1, 4), context_ladder=(64,), block_size=8, prefill_chunk=32,
                      prefill_long_chunk=0, decode_attention="native", progress=False)
    return path, art


def test_served_gives_transformers_ids(exported, monkeypatch, serve_cache_dir):
    from tlaloc_jax.serve import Engine
    path, art = exported
    manifest = json.loads((art / "tlaloc-serving.json").read_text())
    assert manifest["versions"]["custom_calls"] == [NATIVE_DECODE_ATTENTION, NATIVE_PROJECTION]
    ref = load_hf_torch(path)
    want = [torch_greedy(ref, p, NEW) for p in PROMPTS]
    bound = tol.bound(tol.decoder_roundings_of(load_checkpoint(path)[0], context=64))

    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as eng:
        check_served_greedy(eng, PROMPTS, want, logit_bound=bound, new=NEW)
        kv_one_slot_off(monkeypatch)
        with pytest.raises(GreedyMismatch):
            check_served_greedy(eng, PROMPTS, want, logit_bound=bound, new=NEW)


def test_a_kernel_the_runtime_lacks_is_refused_at_load(exported, tmp_path):
    """A manifest naming a native kernel this runtime has not: refused by that name before anything compiles."""
    import shutil

    from tlaloc_jax.serve import Engine
    _, art = exported
    other = tmp_path / "art"
    shutil.copytree(art, other)
    manifest = json.loads((other / "tlaloc-serving.json").read_text())
    manifest["versions"]["custom_calls"] = ["tlaloc_flash_v9"]
    (other / "tlaloc-serving.json").write_text(json.dumps(manifest))
    with pytest.raises(native.NativeKernelError, match="'tlaloc_flash_v9' is not one this runtime has"):
        Engine.load(other, progress=False)


def test_a_server_whose_compiler_writes_nothing_names_the_kernel(exported, tmp_path):
    """The probe: `CC=true` (exits 0, writes no library), an empty kernel cache and no prebuilt variant taken. The server exits 2 with the
    kernel, the compiler command and the way out, not a bare file-not-found error nor a traceback."""
    _, art = exported
    env = {**os.environ, "CC": "true", native.ENV_CACHE: str(tmp_path / "native"), native.ENV_VARIANT: "build"}
    run = subprocess.run([sys.executable, "-m", "tlaloc_jax.serve", str(art), "--port", "0", "--cache-dir", "none",
                          "--no-progress"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "native kernel 'tlaloc_decode_attention_v1': true exited 0 on decode_attention.c but wrote no " \
           "whole library" in run.stderr and "install gcc or clang" in run.stderr, run.stderr[-2000:]


def test_pools_the_kernel_does_not_read_default_to_plain_ops(exported, tmp_path):
    """An fp8 KV pool (which the kernel does not read): a cpu export that does not ask gets plain ops; one that asks
    for the kernel is refused by name."""
    from tlaloc_jax.export import ExportError, export_checkpoint
    path, _ = exported
    kw = dict(batch_ladder=(1,), context_ladder=(64,), block_size=8, kv_dtype="float8_e4m3fn", progress=False)
    assert export_checkpoint(path, tmp_path / "default", **kw).versions.custom_calls == (NATIVE_PROJECTION,)
    with pytest.raises(ExportError, match="native decode-attention kernel cannot serve this model: a float8_e4m3fn "
                                          "pool: it reads f32 or bf16 pools"):
        export_checkpoint(path, tmp_path / "native", decode_attention="native", **kw)

