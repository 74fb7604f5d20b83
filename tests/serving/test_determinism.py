"""Determinism: the same computation run twice on one machine gives the same numbers, bit for bit.

Checked for the served path by running a script twice, each time in a fresh process with a fresh compile
(no compile cache): it loads an artifact with the JAX-free Engine, runs fixed prefill and decode calls and
hashes the logits' bytes, and draws seeded samples (which depend on every bit of the logits they are drawn
from). The in-process decoder is checked the same way. Run-to-run equality is what lets a failing numeric
test be rerun and debugged; across machines the numbers differ, which the tolerance model covers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hf_models import build_checkpoint
from tlaloc_jax.export import export_checkpoint

pytestmark = pytest.mark.numeric

PROMPTS = [[5, 17, 99, 3, 250, 8, 61], [42, 7], list(range(1, 30))]

SERVED = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs, pack_step_inputs
    from tlaloc_jax.artifact import Role
    from tlaloc_jax.serve import Engine, Sampling
    prompts = json.loads(sys.argv[2])
    with Engine.load(sys.argv[1], cache_dir=None, progress=False) as eng:
        greedy = eng.generate(prompts, 8)
        sampled = eng.generate(prompts, 8, sampling=Sampling(temperature=1.0, seed=7))
        # The logits of one prefill call and one decode call, straight from the compiled entries (the same
        # executions the engine runs; the pools are this throwaway process's own).
        digest = hashlib.sha256()
        for kind, rows in (("prefill", [RowCall(p, 0, list(range(4 * i, 4 * i + 4))) for i, p in enumerate(prompts)]),
                           ("decode", [RowCall([p[-1]], len(p) - 1, list(range(4 * i, 4 * i + 4)))
                                       for i, p in enumerate(prompts)])):
            entry = eng.scheduler.planner.pick(kind, len(rows), 64, max(len(r.token_ids) for r in rows))
            inputs = build_step_inputs(rows, batch=entry.batch, tokens=entry.tokens_per_seq,
                                       width=entry.context // eng.block_size, block_size=eng.block_size)
            if entry.packed_tokens:
                inputs = pack_step_inputs(inputs, entry.packed_tokens)
            logits = eng.runner.run(entry, inputs, {Role.LOGITS})[Role.LOGITS]
            digest.update(np.ascontiguousarray(logits).tobytes())
    print(json.dumps({"greedy": greedy, "sampled": sampled, "logits": digest.hexdigest()}))
""")

IN_PROCESS = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    import tlaloc_jax
    model = tlaloc_jax.load_hf(sys.argv[1])
    logits = model.first_logits(json.loads(sys.argv[2]))
    print(json.dumps({"logits": hashlib.sha256(np.ascontiguousarray(logits).tobytes()).hexdigest()}))
""")


def _run(script: str, *args) -> dict:
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoint_and_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("det")
    ck = build_checkpoint(root / "ck", "llama", seed=61)
    export_checkpoint(ck, root / "art", batch_ladder=(4,), context_ladder=(64,), block_size=16, progress=False)
    return ck, root / "art"


def test_served_path_gives_the_same_bits_in_two_fresh_processes(checkpoint_and_artifact):
    _, art = checkpoint_and_artifact
    first = _run(SERVED, art, json.dumps(PROMPTS))
    assert _run(SERVED, art, json.dumps(PROMPTS)) == first
    # Control: the hash does see the logits (other prompts, another hash).
    assert _run(SERVED, art, json.dumps([p[::-1] for p in PROMPTS]))["logits"] != first["logits"]


@pytest.mark.slow    # the served path above is what users run; this one checks the in-process decoder alike
def test_in_process_decoder_gives_the_same_bits_in_two_fresh_processes(checkpoint_and_artifact):
    ck, _ = checkpoint_and_artifact
    first = _run(IN_PROCESS, ck, json.dumps(PROMPTS))
    assert _run(IN_PROCESS, ck, json.dumps(PROMPTS)) == first
    assert _run(IN_PROCESS, ck, json.dumps([p[::-1] for p in PROMPTS])) != first
