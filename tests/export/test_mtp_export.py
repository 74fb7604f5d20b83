"""DeepSeek-V3's MTP head staged (export/_mtp_entries.py): with --speculative-tokens, a checkpoint that has the head
gets mtp entries, its own pool and HIDDEN_STATES (after the final norm) from the decoder's entries; the staged mtp
entry's logits equal the torch reference (tests/support/mtp_checkpoint.py), calls chaining through its pool; a
checkpoint without the head stages none."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from bodies import _compiled
from hf_models import build_checkpoint
from margins import assert_within
from mtp_checkpoint import add_mtp_head, mtp_bound, torch_hidden, torch_mtp
from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import load_checkpoint, read_config
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.families import config_from_hf
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.mtp_head import POOL

pytestmark = pytest.mark.numeric

SEED, K, BLOCK, CHUNK = 69, 2, 4, 8
LADDER = dict(batch_ladder=(1, 2), context_ladder=(16,), block_size=BLOCK, prefill_chunk=CHUNK, prefill_long_chunk=0,
              num_blocks=12, progress=False, exported=True, speculative_tokens=K)
B, CALLS = 2, ((0, 4), (4, 10))         # two calls of the head over positions [0, 4) and [4, 10)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-export")
    plain = build_checkpoint(root / "plain", "deepseek_v3", seed=SEED)
    head = add_mtp_head(plain, root / "head", seed=SEED + 1)
    return {name: (ck, export_checkpoint(ck, root / f"art-{name}", **LADDER), root / f"art-{name}")
            for name, ck in (("plain", plain), ("head", head))}


def test_a_checkpoint_with_the_head_stages_mtp_entries_and_hidden_states(exported):
    _, m, _ = exported["head"]
    cfg = load_checkpoint(exported["head"][0])[0]
    kinds = {e.kind for e in m.entries}
    assert af.EntryKind.MTP in kinds and POOL in {p.name for p in m.pools}
    mtp = [e for e in m.entries if e.kind == af.EntryKind.MTP]
    # One per (batch, tokens a row) of the decode (1), verify (K + 1) and prefill (CHUNK) entries.
    assert sorted((e.batch, e.tokens_per_seq) for e in mtp) == [(b, t) for b in (1, 2) for t in (1, K + 1, CHUNK)]
    for e in m.entries:
        if e.kind in (af.EntryKind.DECODE, af.EntryKind.PREFILL, af.EntryKind.VERIFY):
            sig = e.outputs[e.output_index(af.Role.HIDDEN_STATES)]
            assert tuple(sig.shape) == (e.batch, e.tokens_per_seq, cfg.hidden_size)


def test_a_checkpoint_without_the_head_stages_none(exported):
    _, m, art = exported["plain"]
    text = (art / af.MANIFEST_NAME).read_text()
    assert af.EntryKind.MTP not in {e.kind for e in m.entries} and POOL not in {p.name for p in m.pools}
    assert "HIDDEN_STATES" not in text and '"mtp' not in text


def _call(art, e: af.Entry, step: dict, pools: dict, weights: dict) -> dict:
    """The entry's body called with its step inputs by role, pools by name and weights by slot; -> its outputs by
    (role, slot)."""
    args = [jnp.asarray(step[s.role]) if s.role in step else pools[s.slot] if s.role == af.Role.POOL_IN
            else jnp.asarray(weights[s.slot]) for s in e.inputs]
    return dict(zip([(s.role, s.slot) for s in e.outputs], _compiled(str(art / e.exported), 0, 0)(*args)))


def _run_mtp(m: af.Manifest, art, tokens: np.ndarray, hidden: np.ndarray, weights: dict) -> list[np.ndarray]:
    """The mtp entry of B rows and CHUNK tokens called for each of CALLS, rows right-aligned; -> each call's LOGITS
    [B, V] (the row's last position's)."""
    e = next(e for e in m.entries if e.kind == af.EntryKind.MTP and e.batch == B and e.tokens_per_seq == CHUNK)
    pools = {p.name: jnp.zeros(p.shape, af.numpy_dtype(p.dtype)) for p in m.pools}
    pages = 16 // BLOCK
    tables = np.arange(B * pages, dtype=np.int32).reshape(B, pages)
    out = []
    for lo, hi in CALLS:
        pad = CHUNK - (hi - lo)
        pos = np.full((B, CHUNK), -1, np.int32)
        pos[:, pad:] = np.arange(lo, hi)
        slots = np.where(pos >= 0, np.take_along_axis(tables, np.maximum(pos, 0) // BLOCK, axis=1) * BLOCK
                         + np.maximum(pos, 0) % BLOCK, -1).astype(np.int32)
        ids = np.zeros((B, CHUNK), np.int32)
        ids[:, pad:] = tokens[:, lo:hi]
        h = np.zeros((B, CHUNK, hidden.shape[2]), np.float32)
        h[:, pad:] = hidden[:, lo:hi]
        step = {af.Role.TOKEN_IDS: ids, af.Role.POSITIONS: pos, af.Role.SEQ_LENS: np.full((B,), hi, np.int32),
                af.Role.BLOCK_TABLES: tables, af.Role.SLOT_MAPPING: slots, af.Role.HIDDEN_STATES: h}
        result = _call(art, e, step, pools, weights)
        pools = {p.name: result[(af.Role.POOL_OUT, p.name)] for p in m.pools}
        out.append(np.asarray(result[(af.Role.LOGITS, "")]))
    return out


def _weights(m: af.Manifest, art) -> dict:
    return {w.slot: np.fromfile(art / w.file, af.numpy_dtype(w.dtype)).reshape(w.shape) for w in m.weights}


def test_the_staged_mtp_entry_equals_the_torch_reference(exported):
    ck, m, art = exported["head"]
    cfg = config_from_hf(read_config(ck))[1]
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, cfg.vocab_size, (B, CALLS[-1][1])).astype(np.int32)
    hidden = rng.standard_normal((B, CALLS[-1][1], cfg.hidden_size)).astype(np.float32)
    got = _run_mtp(m, art, tokens, hidden, _weights(m, art))
    want = torch_mtp(ck, tokens, hidden)
    bound = mtp_bound(cfg, CALLS[-1][1])
    for (lo, hi), g in zip(CALLS, got):
        assert_within(tol.relative_error(g, want[:, hi - 1]), bound, f"staged MTP entry at {hi - 1}")
    # Control: the head's input norms swapped in the artifact's weights fail the same check.
    weights = _weights(m, art)
    weights["mtp.enorm"], weights["mtp.hnorm"] = weights["mtp.hnorm"], weights["mtp.enorm"]
    swapped = _run_mtp(m, art, tokens, hidden, weights)
    assert tol.relative_error(swapped[-1], want[:, -1]) > bound


def test_the_decoders_hidden_states_are_transformers_after_its_final_norm(exported):
    """What the head reads (vLLM's contract): a prefill entry's HIDDEN_STATES are transformers' decoder's hidden
    states after its final norm, within the decoder's bound. Control: those before the norm miss it."""
    ck, m, art = exported["head"]
    cfg = config_from_hf(read_config(ck))[1]
    e = next(e for e in m.entries if e.kind == af.EntryKind.PREFILL and e.batch == B and e.tokens_per_seq == CHUNK
             and not e.packed_tokens)
    tokens = np.random.default_rng(SEED + 2).integers(0, cfg.vocab_size, (B, CHUNK)).astype(np.int32)
    pos = np.broadcast_to(np.arange(CHUNK, dtype=np.int32), (B, CHUNK))
    tables = np.arange(B * (16 // BLOCK), dtype=np.int32).reshape(B, -1)
    slots = (np.take_along_axis(tables, pos // BLOCK, axis=1) * BLOCK + pos % BLOCK).astype(np.int32)
    step = {af.Role.TOKEN_IDS: tokens, af.Role.POSITIONS: pos, af.Role.SEQ_LENS: np.full((B,), CHUNK, np.int32),
            af.Role.BLOCK_TABLES: tables, af.Role.SLOT_MAPPING: slots}
    pools = {p.name: jnp.zeros(p.shape, af.numpy_dtype(p.dtype)) for p in m.pools}
    got = np.asarray(_call(art, e, step, pools, _weights(m, art))[(af.Role.HIDDEN_STATES, "")])
    before, after = torch_hidden(ck, tokens)
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=CHUNK))
    assert_within(tol.relative_error(got, after), bound, "staged HIDDEN_STATES vs transformers after the final norm")
    assert tol.relative_error(got, before) > bound
