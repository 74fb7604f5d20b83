"""`make demo`'s path on the embedded model: export, serve over HTTP, stream; and its parity."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_models import load_hf_torch, torch_greedy
from oracle import GreedyMismatch, check_greedy_batch, engine_next_token, kv_one_slot_off
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.serve import Engine
from tlaloc_jax.tools.demo import DEMO_MODEL, export_demo


def test_demo_exports_serves_and_streams():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "tlaloc_jax.tools.demo", "--max-tokens", "24"], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "StableHLO entries" in out and "no JAX in it" in out
    completion = out.split("---\n", 1)[1].rsplit("\n---", 1)[0]
    assert completion.startswith("def read_config(path):") and len(completion) > len("def read_config(path):") + 10
    assert "time to first token" in out and "tokens/s" in out
    # README.md shows what `make demo` prints: its entry count is the one the demo prints now.
    entries = re.compile(r"to (\d+) StableHLO entries")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert entries.search(readme)[1] == entries.search(out)[1], "README.md's `make demo` output is stale"


@pytest.mark.numeric
def test_served_embedded_model_gives_transformers_greedy_ids(tmp_path, monkeypatch, serve_cache_dir):
    """The project's own model passes the same parity check as the oracles: transformers reads the
    embedded checkpoint and gives the ids the JAX-free runtime serves from its artifact (up to the
    tolerance model's near-ties). Control: the engine writing KV one slot off fails it."""
    import tlaloc_jax
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in ("import os\n", "def main():\n    ", "class Config(object):\n")]
    export_demo(tmp_path / "artifact")
    ref = load_hf_torch(DEMO_MODEL)
    want = [torch_greedy(ref, p, 16) for p in prompts]
    cfg = tlaloc_jax.load_hf(DEMO_MODEL).config
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=max(map(len, prompts)) + 16))
    with Engine.load(tmp_path / "artifact", cache_dir=serve_cache_dir, progress=False) as eng:
        check_greedy_batch(prompts, eng.generate(prompts, max_new_tokens=16), want, logit_bound=bound,
                           next_token=engine_next_token(eng))
        kv_one_slot_off(monkeypatch)
        with pytest.raises(GreedyMismatch):
            check_greedy_batch(prompts, eng.generate(prompts, max_new_tokens=16), want, logit_bound=bound,
                               next_token=engine_next_token(eng))


def test_export_demo_with_the_default_contexts_works(tmp_path):
    """`python -m tlaloc_jax.export --demo OUT` with its default context ladder: the rungs of 64, 256, 1024 within
    the demo model's 256 positions."""
    from tlaloc_jax import artifact as af
    from tlaloc_jax.export.__main__ import main
    assert main(["--demo", str(tmp_path / "a"), "--batch-ladder", "1", "--quiet", "--no-compile-cache"]) == 0
    assert af.load_manifest(tmp_path / "a").buckets.context_ladder == (64, 256)
