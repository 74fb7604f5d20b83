"""The notebooks run from top to bottom (executed with nbclient).

author_a_model.ipynb asserts its own results in plain equality (its prompts' greedy steps are far from any
near-tie, and it prints the closest); the test reads them back out of the kernel and applies the suite's
rule for greedy ids (tests/support/oracle.py: equal up to near-ties the tolerance model allows), including to the
notebook's control, which must fail it."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from oracle import GreedyMismatch, OracleRun, check_greedy_batch
from tlaloc_jax.kernels import tolerances as tol

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def run_notebook(name: str, tmp_path: Path, monkeypatch, *extra_cells: str) -> nbformat.NotebookNode:
    """Execute notebooks/<name> (plus extra code cells at its end) in a fresh kernel whose working directory
    is tmp_path; a cell that raises fails the test."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(src) for src in extra_cells]
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return nb


def test_decode_loop_notebook_runs(tmp_path, monkeypatch):
    nb = run_notebook("decode_loop.ipynb", tmp_path, monkeypatch)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "tokens/s" in outputs and "in place" in outputs


# Appended to author_a_model.ipynb: hands the test what the notebook computed (names the notebook defines).
HANDOFF = """
import json
def _oracle_logits(prompt, ids):
    seq = prompt + ids
    logits = padded_logits(params, jnp.asarray([seq + [0] * (CONTEXT - len(seq))]))[0]
    return np.asarray(logits[len(prompt) - 1:len(seq) - 1]).tolist()
Path("handoff.json").write_text(json.dumps(dict(
    prompts=prompts, in_process=in_process, served_alone=served_alone, served_together=served_together,
    control_alone=control_alone, control_together=control_together, losses=losses,
    oracle_logits=[_oracle_logits(p, ids) for p, ids in zip(prompts, in_process)],
    sizes=dict(hidden=E, mlp=F, heads=H, head_dim=D, layers=L), work=str(work), artifact=str(artifact),
    control=str(control_artifact), cache=str(work / "executables"))))
"""


def parallel_block_roundings(*, hidden: int, mlp: int, heads: int, head_dim: int, layers: int, keys: int) -> int:
    """A logit of the notebook's model (tolerance model, tlaloc_jax/kernels/tolerances.py): the embedding sum; per layer a
    LayerNorm (mean and variance, hidden-term sums; rsqrt; subtract, scale, shift), then the longer of the
    attention path (the qkv projection, attention over `keys`, the output projection) and the MLP path (up
    and its bias, tanh-approximated gelu, down and its bias), and two residual adds; then the final
    LayerNorm and the head (a hidden-term dot)."""
    norm = 2 * hidden + 2 + tol.TRANSCENDENTAL_ULPS + 3
    attention = hidden + tol.attention_roundings(head_dim, keys) + heads * head_dim
    mlp_path = hidden + 1 + tol.TRANSCENDENTAL_ULPS + 7 + mlp + 1
    return 1 + layers * (norm + max(attention, mlp_path) + 2) + norm + hidden


@contextlib.contextmanager
def teacher_forcing(artifact: str, cache: str):
    """next_token(ids) through a served artifact, its Engine loaded only if a check asks (after a divergence)."""
    from tlaloc_jax.serve import Engine
    engines = []

    def next_token(ids):
        if not engines:
            engines.append(Engine.load(artifact, cache_dir=cache, progress=False))
        return engines[0].generate([ids], 1)[0][0]

    try:
        yield next_token
    finally:
        for e in engines:
            e.close()


@pytest.mark.numeric
def test_author_a_model_notebook_serves_its_in_process_ids(tmp_path, monkeypatch):
    """An authored flax.nnx model, trained, staged and served: the served greedy ids, alone and together, are the
    in-process ones up to near-ties; the control (keys and values written at POSITIONS instead of
    SLOT_MAPPING) fails the same check."""
    run_notebook("author_a_model.ipynb", tmp_path, monkeypatch, HANDOFF)
    r = json.loads((tmp_path / "handoff.json").read_text())
    try:
        assert r["losses"][-1] < r["losses"][0] / 10, f"training did not learn: {r['losses'][0]} -> {r['losses'][-1]}"
        prompts = r["prompts"]
        oracles = [OracleRun(ids, np.asarray(logits, np.float32)) for ids, logits in zip(r["in_process"],
                                                                                          r["oracle_logits"])]
        keys = max(len(p) + len(ids) for p, ids in zip(prompts, r["in_process"]))
        bound = tol.bound(parallel_block_roundings(**r["sizes"], keys=keys))
        with teacher_forcing(r["artifact"], r["cache"]) as next_token:
            for got in (r["served_alone"], r["served_together"]):
                check_greedy_batch(prompts, got, oracles, logit_bound=bound, next_token=next_token)
        with teacher_forcing(r["control"], r["cache"]) as next_token, pytest.raises(GreedyMismatch):
            check_greedy_batch(prompts, r["control_together"], oracles, logit_bound=bound, next_token=next_token)
    finally:
        shutil.rmtree(r["work"], ignore_errors=True)


# Appended to embed_sentences.ipynb: what it measured, for the test to hold to the tolerance model itself.
EMBED_HANDOFF = """
import json
Path("handoff.json").write_text(json.dumps(dict(checks=checks, control=control_message, artifact=str(artifact),
                                                work=str(work))))
"""


@pytest.mark.slow
@pytest.mark.numeric
def test_embed_sentences_notebook_serves_its_in_process_embeddings(tmp_path, monkeypatch):
    """A flax.nnx sentence encoder staged as a bounded program and served: each served embedding (its sentences,
    and 1 to 4 rows at every bucket edge) is the in-process one within the tolerance model's bound for the largest
    body; its control, a mean over the padded tokens, was refused at export by name."""
    import re

    from margins import assert_within
    from tlaloc_jax.artifact.bounded_manifest import load_bounded
    run_notebook("embed_sentences.ipynb", tmp_path, monkeypatch, EMBED_HANDOFF)
    r = json.loads((tmp_path / "handoff.json").read_text())
    try:
        bound = tol.bound(dict(load_bounded(r["artifact"]).output("embedding").roundings))
        assert len(r["checks"]) == 8 + 9
        for what, err in r["checks"]:
            assert_within(err, bound, f"embed_sentences notebook {what}")
        assert re.match(r"output 'embedding' reads padding: in bucket rows \d, tokens \d+ ", r["control"]), r["control"]
    finally:
        shutil.rmtree(r["work"], ignore_errors=True)
