"""Serving memory (issue 57): an artifact larger than the host's free memory is refused by name before anything is
allocated, and a loaded artifact holds one copy of its weights (resident set bounded, checked in a clean process,
with a control that keeps a second copy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import random_weights, save_checkpoint
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.runtime import host_memory, pjrt, sharded

# A small Llama whose weights are mostly its 32,000-row embedding and head (about 63 MiB of f32): large against a
# step's temporaries, so that a second copy of them shows in the resident set.
HF = dict(model_type="llama", vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=256,
          tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# One point on each ladder and no long-prompt entry: every entry compiles at load, so what the resident set gains
# after the load is the weights' and pools' pages and a step's temporaries, not compiling.
LADDER = dict(batch_ladder=(1,), context_ladder=(64,), prefill_max_batch=1, prefill_chunk=16, prefill_long_chunk=0,
              block_size=16, progress=False)
# What a step's temporaries and the interpreter's allocations on the way may add to the resident set of this model
# (its logits row is 125 KiB); a second copy of the weights adds 63 MiB.
STEP_SLACK = 16 << 20


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving-memory")
    fam, cfg = config_from_hf(HF)
    save_checkpoint(root / "ck", HF, random_weights(cfg, fam, seed=0, std=0.02))
    export_checkpoint(root / "ck", root / "art", **LADDER)
    return root / "art"


def test_an_artifact_past_memavailable_is_refused_by_name_before_anything_is_allocated(artifact, tmp_path,
                                                                                         monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000000 kB\nMemFree:          2000 kB\nMemAvailable:     4096 kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO", meminfo)

    def untouched(*a, **k):
        raise AssertionError("compiled or allocated before the memory check")
    for name in ("compile", "adopt", "upload"):
        monkeypatch.setattr(pjrt.Device, name, untouched)
    monkeypatch.setattr(sharded, "upload_weights", untouched)
    with pytest.raises(af.ManifestError) as e:
        Engine.load(artifact, cache_dir=None, progress=False)
    msg = str(e.value)
    weights = sum(w.nbytes for w in af.load_manifest(artifact).weights)
    assert f"the artifact {artifact} needs " in msg
    assert f"weights {weights / 2**20:.1f} MiB" in msg
    assert "cpu has 4.0 MiB free (MemAvailable): nothing was allocated" in msg
    for way_out in ("--num-blocks", "--context-ladder", "--weight-quant int8 or int4"):
        assert way_out in msg


def test_the_same_artifact_loads_when_memavailable_holds_it(artifact, tmp_path, monkeypatch):
    """The control of the refusal: the check reads MemAvailable, and an artifact that fits it loads."""
    m = af.load_manifest(artifact)
    need = sum(w.nbytes for w in m.weights) + sum(p.nbytes for p in m.pools)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {need // 1024 + 1} kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO", meminfo)
    with Engine.load(artifact, cache_dir=None, progress=False) as eng:
        assert eng.stats()["resident_bytes_at_load"] > eng.weight_bytes


# Runs in a process of its own: loads the artifact, runs every entry, then reports its resident set. "control" keeps a
# second host copy of every weight, as a runtime would that read its weights into an arena and copied them to the
# device buffers.
_PROBE = textwrap.dedent("""
    import json, sys
    from tlaloc_jax.serve import Engine
    from tlaloc_jax.serve.runtime import host_memory, pjrt
    if sys.argv[2] == "control":
        def two_copies(self, array, device=0):
            self._adopted.append(array)
            return self.upload(array, device)
        pjrt.Device.adopt = two_copies
    eng = Engine.load(sys.argv[1], cache_dir=None, progress=False)
    assert not {"pending", "cached"} & set(eng.runner.compile_report()), eng.runner.compile_report()   # all compiled
    eng.generate([[5, 6, 7, 8]], 8)
    print(json.dumps(dict(before=eng.runner.resident_before_weights, at_load=eng.resident_at_load,
                          after=host_memory.resident_bytes(), weights=eng.weight_bytes, pools=eng.pool_bytes,
                          bound=eng.resident_bound)))
""")


def _probe(artifact: Path, mode: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", _PROBE, str(artifact), mode], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _growth_within_bound(r: dict) -> bool:
    """What the resident set gained from before the weights to after a generation: at most weights + pools + a
    step's slack (one copy of the weights)."""
    return r["after"] - r["before"] <= r["weights"] + r["pools"] + STEP_SLACK


@pytest.mark.parametrize("mode", ["plain", "control"])
def test_the_served_artifact_holds_one_copy_of_its_weights(artifact, mode):
    r = _probe(artifact, mode)
    assert r["weights"] >= 3 * STEP_SLACK       # a second copy would pass the slack by far
    if mode == "plain":
        assert _growth_within_bound(r), r
        assert r["after"] <= r["bound"] == r["weights"] + r["pools"] + host_memory.RESIDENT_OVERHEAD, r
    else:
        assert r["after"] - r["before"] >= 2 * r["weights"] - STEP_SLACK, r    # the control kept two copies
        assert not _growth_within_bound(r), r
