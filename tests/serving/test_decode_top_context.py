"""Decode entries at the context ladder's top alone (export decode_contexts, default where every attention layer
decodes with the native kernel): the default export stages them there, the runtime serves short and long requests
from them with transformers' ids, and the other exports (plain-ops decode attention, sliding-window rings, whose
ring scores min(bucket, ring) pages) keep one per context. Control: a runtime that picked an entry of the row's own
context bucket alone (the old assumption) finds no decode entry for a short row."""

from __future__ import annotations

import pytest

from hf_models import build_checkpoint, load_hf_torch, torch_greedy
from oracle import check_served_greedy
from tlaloc_jax import artifact as af
from tlaloc_jax.checkpoint import load_checkpoint
from tlaloc_jax.export import ExportError, export_checkpoint
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.paged_attention_native import NATIVE_DECODE_ATTENTION

CONTEXTS = (32, 128)
LADDER = dict(batch_ladder=(1, 4), context_ladder=CONTEXTS, block_size=8, prefill_chunk=16, prefill_long_chunk=0,
              progress=False)
SHORT = [5, 17, 99, 3, 249, 8, 61]                          # 7 + NEW tokens: within the smallest context
LONG = [(i * 37 + 11) % 256 for i in range(70)]            # past it: the top context's entries
NEW = 12


def _points(m: af.Manifest, kind: str) -> set[tuple[int, int]]:
    return {(e.batch, e.context) for e in m.entries if e.kind == kind}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=59)


@pytest.fixture(scope="module")
def default_export(llama, tmp_path_factory):
    art = tmp_path_factory.mktemp("art") / "default"
    return export_checkpoint(llama, art, speculative_tokens=2, **LADDER), art


def test_default_export_decodes_at_the_top_context_only(default_export):
    m, _ = default_export
    assert NATIVE_DECODE_ATTENTION in m.versions.custom_calls
    top = {(b, CONTEXTS[-1]) for b in (1, 4)}
    assert _points(m, af.EntryKind.DECODE) == top
    assert _points(m, af.EntryKind.VERIFY) == top
    # Prefill and mixed entries attend with plain ops over their bucket: one per context still.
    assert {c for _, c in _points(m, af.EntryKind.PREFILL)} == set(CONTEXTS)
    assert {c for _, c in _points(m, af.EntryKind.MIXED)} == set(CONTEXTS)


@pytest.mark.numeric
def test_short_and_long_requests_give_transformers_ids(llama, default_export, monkeypatch, serve_cache_dir):
    from tlaloc_jax.serve import Engine
    from tlaloc_jax.serve.core.call_plan import CallPlanner
    _, art = default_export
    ref = load_hf_torch(llama)
    want = [torch_greedy(ref, p, NEW) for p in (SHORT, LONG)]
    bound = tol.bound(tol.decoder_roundings_of(load_checkpoint(llama)[0], context=CONTEXTS[-1]))
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False) as eng:
        check_served_greedy(eng, [SHORT, LONG], want, logit_bound=bound, new=NEW)
        # Control: an entry of the row's own bucket alone, as when every context had its decode entries.
        real = CallPlanner.pick

        def own_bucket(self, kind, batch, context, tokens, total=0):
            bucket = min(c for c in self.manifest.buckets.context_ladder if c >= context)
            e = real(self, kind, batch, context, tokens, total)
            return e if e is not None and e.context == bucket else None

        monkeypatch.setattr(CallPlanner, "pick", own_bucket)
        with pytest.raises(RuntimeError, match="no decode entry holds"):
            eng.generate([SHORT], NEW)


def _decode_contexts(m: af.Manifest) -> set[int]:
    return {e.context for e in m.entries if e.kind == af.EntryKind.DECODE}


def test_plain_ops_decode_keeps_every_context(llama, tmp_path):
    m = export_checkpoint(llama, tmp_path / "xla", decode_attention="xla", mixed=False, **LADDER)
    assert _decode_contexts(m) == set(CONTEXTS)
    with pytest.raises(ExportError, match="decode_contexts 'top'.*decode attention 'xla'.*--decode-contexts every"):
        export_checkpoint(llama, tmp_path / "refused", decode_attention="xla", decode_contexts="top", **LADDER)


def test_native_decode_with_every_context_asked(llama, tmp_path):
    m = export_checkpoint(llama, tmp_path / "every", decode_contexts="every", mixed=False, **LADDER)
    assert _decode_contexts(m) == set(CONTEXTS)


@pytest.mark.slow
def test_sliding_window_rings_keep_every_context(tmp_path):
    """gemma3's sliding layers decode over their ring with plain ops: min(bucket, ring) pages, so the bucket counts."""
    ck = build_checkpoint(tmp_path / "gemma3", "gemma3_text", seed=5)
    m = export_checkpoint(ck, tmp_path / "art", mixed=False, **LADDER)
    assert m.ring is not None and m.ring.ring_pages < CONTEXTS[-1] // 8
    assert NATIVE_DECODE_ATTENTION in m.versions.custom_calls        # its full layers decode natively
    assert _decode_contexts(m) == set(CONTEXTS)


def test_mtp_head_entries_keep_every_context():
    """The MTP head attends with plain ops over its bucket: its one-token entries stay at each context even where the
    decoder's decode entries sit at the top alone (control: the decoder's own decode points are at the top)."""
    from tlaloc_jax.export._entries import EntrySpec
    from tlaloc_jax.export._mtp_entries import mtp_specs
    specs = [EntrySpec(af.EntryKind.PREFILL, 1, c, 16) for c in CONTEXTS] + [EntrySpec(af.EntryKind.DECODE, 1, 128, 1)]
    points = {(s.context, s.tokens_per_seq) for s in mtp_specs(specs)}
    assert points == {(c, t) for c in CONTEXTS for t in (1, 16)}
    assert {s.context for s in specs if s.kind == af.EntryKind.DECODE} == {CONTEXTS[-1]}
