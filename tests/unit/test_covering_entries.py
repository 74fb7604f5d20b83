"""A preloading server is ready once `covering` entries are loaded: between them they hold every call any entry holds
(each kind's entries that no larger one holds the largest call of, and a lone request's smallest), and while the
others load a call takes the smallest loaded entry that holds it (CallPlanner.pick with `loaded`). The ladder is the
demo export's shape: decode at the top context, prefill chunks of 32 tokens (one row, and packed rows of 64-256
tokens in all), prompt chunks of one row of 64 or 128 tokens, mixed calls."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from tlaloc_jax import artifact as af
from tlaloc_jax.serve.core.call_plan import CallPlanner, covering

D, P, M, C = af.EntryKind.DECODE, af.EntryKind.PREFILL, af.EntryKind.MIXED, af.EntryKind.COPY_SLOTS


def _entry(kind, batch, context, tokens, packed=0) -> af.Entry:
    inputs = ((af.TensorSig(af.Role.TOKEN_IDS, "int32", (1, packed)),
               af.TensorSig(af.Role.PACK_INDEX, "int32", (1, packed))) if packed else ())
    name = f"{kind}_b{batch}_t{tokens}_n{packed}_c{context}"
    return af.Entry(name=name, kind=kind, batch=batch, context=context, tokens_per_seq=tokens, serialized="",
                    serialized_sha256="", inputs=inputs, outputs=(), donations=(), kept_inputs=())


ENTRIES = ([_entry(D, b, 256, 1) for b in (1, 2, 4, 8, 16, 32)]
           + [_entry(P, 1, c, 32) for c in (64, 256)]
           + [_entry(P, 8, c, 32, n) for c in (64, 256) for n in (64, 128, 192, 256)]
           + [_entry(P, 1, 64, 64), _entry(P, 1, 256, 128)]
           + [_entry(M, b, c, 32) for c in (64, 256) for b in (4, 8, 16, 32)]
           + [_entry(C, 4, 0, 1)])


def _calls(entries):
    """Every call some entry holds, at the ladder's points and just past them (batch, context, tokens, total)."""
    batches = sorted({e.batch for e in entries} | {1})
    contexts = sorted({e.context for e in entries} | {1})
    tokens = sorted({e.tokens_per_seq for e in entries} | {1})
    for kind, b, c, t in itertools.product(af.EntryKind, batches, contexts, tokens):
        for total in sorted({t, b * t, *(e.packed_tokens for e in entries if e.packed_tokens)}):
            if t <= total <= b * t and any(e.kind == kind and e.holds(b, c, t, total) for e in entries):
                yield kind, b, c, t, total


def _held_by(first, kind, b, c, t, total) -> bool:
    return any(e.kind == kind and e.holds(b, c, t, total) for e in first)


def test_the_covering_entries_hold_every_call_an_entry_holds():
    first = covering(ENTRIES)
    assert len(first) < len(ENTRIES) / 2
    names = {e.name for e in first}
    # Each kind's largest are in; the smallest of decode and prefill (a lone short request's); copy_slots always.
    assert names == {"decode_b1_t1_n0_c256", "decode_b32_t1_n0_c256", "prefill_b1_t32_n0_c64",
                     "prefill_b8_t32_n256_c256", "prefill_b1_t128_n0_c256", "mixed_b32_t32_n0_c256",
                     "copy_slots_b4_t1_n0_c0"}
    calls = list(_calls(ENTRIES))
    assert len(calls) > 50
    assert all(_held_by(first, *call) for call in calls)


def test_control_without_a_largest_entry_some_call_is_held_by_none():
    # The long single-row prompt chunk (128 tokens) is held by no packed prefill (32 tokens a row): without it, a call
    # no first entry holds. The check above would catch a covering that dropped it.
    first = [e for e in covering(ENTRIES) if e.name != "prefill_b1_t128_n0_c256"]
    assert not all(_held_by(first, *call) for call in _calls(ENTRIES))


@pytest.mark.parametrize("loaded, want", [
    (None, "decode_b4_t1_n0_c256"),                                         # everything loaded: the smallest
    ({"decode_b8_t1_n0_c256", "decode_b32_t1_n0_c256"}, "decode_b8_t1_n0_c256"),   # the smallest loaded
    ({"decode_b1_t1_n0_c256", "decode_b2_t1_n0_c256"}, "decode_b4_t1_n0_c256"),    # none loaded holds it: waits
])
def test_a_call_takes_the_smallest_loaded_entry_that_holds_it(loaded, want):
    planner = CallPlanner(SimpleNamespace(entries=ENTRIES, scorer=None, flat=False, max_batch=32), kv=None)
    assert planner.pick(D, 3, 40, 1).name == "decode_b4_t1_n0_c256"
    hurried = []
    planner.loaded = None if loaded is None else (lambda e: e.name in loaded)
    planner.hurry = lambda e: hurried.append(e.name)
    assert planner.pick(D, 3, 40, 1).name == want
    assert planner.pick(D, 33, 40, 1) is None
    # The smallest that holds the call is loaded next where it is not loaded yet.
    assert hurried == ([] if loaded is None else ["decode_b4_t1_n0_c256"])
