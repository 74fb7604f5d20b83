"""Speculative decoding of sampled and processed rows (issue 60): an artifact with a sampler gives its verify entries
the sampler's inputs, and the body accepts by rejection sampling (kernels/rejection_sampler.py; its distribution is
tests/ops/test_rejection_sampler.py's chi-square test).

In one batch, with n-gram drafts: plain greedy rows, greedy rows with penalties, logit bias and min_tokens (their
ids equal those without speculation: each drafted position is processed with the tokens before it), and seeded
sampled rows (two choices of one prompt, as n > 1 sends them) that draft, share verify calls with the greedy rows
and give the same tokens on a second run. Control: a host that leaves the drafts out of the penalties' history
changes the penalised row's ids."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from hf_models import build_checkpoint
from tlaloc_jax import artifact as af
from tlaloc_jax.export import Sampler, export_checkpoint
from tlaloc_jax.serve import Engine, speculative
from tlaloc_jax.serve.core import inputs as call_inputs
from tlaloc_jax.serve.core import outputs
from tlaloc_jax.serve.host_sampling import Sampling
from tlaloc_jax.serve.model_runner import ModelRunner

pytestmark = [pytest.mark.numeric, pytest.mark.every_draft]

BLOCK, CONTEXT, K = 8, 64, 3
# One batch size: every call pads to 8 rows, and each of the artifact's entries compiles once for the module.
LADDER = dict(batch_ladder=(8,), context_ladder=(CONTEXT,), block_size=BLOCK, prefill_chunk=8,
              prefill_long_chunk=16, progress=False)
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# Prompts whose continuations by this seed's tiny random model fall into loops, which the proposer then drafts; under
# PENALTIES the loops of the first three drift, so a penalty that missed the drafts would change their ids.
LOOPING = [list(range(17, 78, 5)), list(range(24, 110, 5)), list(range(31, 47, 5)), list(range(52, 143, 5))]
PENALTIES = Sampling(repetition_penalty=1.05, frequency_penalty=0.1)
STOP, FIRST = 249, [3, 8, 13]          # FIRST's greedy continuation reaches STOP at its third token
ROWS = {"greedy": (LOOPING[0], Sampling()),
        **{f"penalties_{i}": (LOOPING[i], PENALTIES) for i in range(3)},
        "bias": (LOOPING[3], Sampling(logit_bias=((90, 0.5), (56, -0.3)))),
        "min_tokens": (FIRST, Sampling(min_tokens=6)),
        # Cool enough to follow the loops now and then: their drafts are both accepted and rejected.
        "sampled_0": (LOOPING[1], Sampling(temperature=0.1, seed=1234)),
        "sampled_1": (LOOPING[1], Sampling(temperature=0.1, seed=1235)),
        "top_k_penalties": (LOOPING[3], Sampling(temperature=0.1, top_k=6, frequency_penalty=0.1, seed=99))}
SAMPLED = ("sampled_0", "sampled_1", "top_k_penalties")
GREEDY = ("greedy", "penalties_0", "penalties_1", "penalties_2", "bias", "min_tokens")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("spec-sampled")
    ck = build_checkpoint(out / "ck", "llama", seed=47)
    export_checkpoint(ck, out / "art", num_blocks=48, speculative_tokens=K, sampler=Sampler(), **LADDER)
    return out / "art"


@pytest.fixture(scope="module")
def without(artifact, serve_cache_dir) -> dict:
    """Every row's ids without speculation."""
    return _batch(artifact, serve_cache_dir, speculative=False)[0]


def _batch(path, cache, speculative: bool | dict, monkeypatch=None) -> tuple[dict, list, dict]:
    """Every row of ROWS in one batch of 24 new tokens, STOP a stop id -> (ids by row, the verify calls' rows'
    sampling, stats). speculative: NGRAM when True, else the speculative config given (none when False)."""
    calls = []
    real = ModelRunner._run_verify_call

    def spy(self, call):
        calls.append([s.sampling for s in call.seqs])
        return real(self, call)
    kw = dict(speculative_config=NGRAM if speculative is True else speculative) if speculative else {}
    with Engine.load(path, cache_dir=cache, progress=False, use_decode_steps=False, **kw) as eng:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ModelRunner, "_run_verify_call", spy)
            rids = {name: eng.add_request(prompt, 24, (STOP,), sampling=sp) for name, (prompt, sp) in ROWS.items()}
            while eng.has_unfinished():
                eng.step()
        out, accepted = {}, {}
        for name, rid in rids.items():
            info = eng.request_info(rid)
            assert info.finish_reason != "error", info.error
            out[name] = eng.output(rid)
            accepted[name] = info.spec.accepted
            eng.release(rid)
        return out, calls, dict(eng.stats(), accepted=accepted)


def test_sampled_and_processed_rows_speculate_beside_greedy_ones(artifact, serve_cache_dir, without):
    """Greedy rows with penalties, bias and min_tokens give the ids they give without speculation; seeded sampled
    rows give the same tokens on a second run; sampled and greedy rows share verify calls and drafts are accepted;
    min_tokens holds off the stop id."""
    want = without
    got, calls, st = _batch(artifact, serve_cache_dir, speculative=True)
    again, _, _ = _batch(artifact, serve_cache_dir, speculative=True)
    for name in GREEDY:
        assert got[name] == want[name], name
    assert got == again
    assert got["sampled_0"] != got["sampled_1"]
    assert STOP not in got["min_tokens"][:6] and len(got["min_tokens"]) > 3
    assert any(st["accepted"][name] for name in SAMPLED) and any(st["accepted"][name] for name in GREEDY)
    drafted = {name for name, (_, sp) in ROWS.items() if any(sp in c for c in calls)}
    assert drafted == set(ROWS), f"rows that never drafted: {set(ROWS) - drafted}"
    assert any(any(sp.temperature > 0 for sp in c) and any(sp.temperature == 0 for sp in c) for c in calls)


def test_control_a_history_without_the_drafts_changes_the_penalised_ids(artifact, serve_cache_dir, without,
                                                                        monkeypatch):
    """The sampler's inputs built as before verify rows sampled: the history through the row's last token only, so
    a drafted position's penalties miss the drafts before it. The penalised greedy row's ids then differ from those
    without speculation, which the test above would catch."""
    want = without
    real = call_inputs.sampler_inputs

    def forgetful(runner, call, producing, allowed):
        out = real(runner, call, producing, allowed)
        history = out.get(af.Role.TOKEN_HISTORY)
        if call.entry.kind == af.EntryKind.VERIFY and isinstance(history, np.ndarray):
            for b, row in zip(call.out_rows, call.rows):
                history[b, row.start + 1:] = -1
        return out
    monkeypatch.setattr(call_inputs, "sampler_inputs", forgetful)
    got, _, _ = _batch(artifact, serve_cache_dir, speculative=True)
    assert any(got[f"penalties_{i}"] != want[f"penalties_{i}"] for i in range(3))


# Rows under a grammar: letters and digits alternate, so each drafted position's mask differs from the one before.
# The grammar's tokenizer is the model's 256 ids as single bytes (id b is byte b), STOP its end.
GRAMMAR = ("regex", "([a-d][0-3]){4,12}")
SHAPED = {"shaped": (list(b"a0b1a0b1a0b1"), Sampling()), "shaped_other": (list(b"c2d3"), Sampling())}
# Cool enough to follow the loops, as the sampled rows above. One row: a row under a grammar sits out the steps
# its grammar is still working (Constraint.ready), so a batch's calls, and the kernels' rounding with their row
# count, would follow the grammar thread's timing; alone, the row's calls are the same every run.
SHAPED_SAMPLED = {"shaped_sampled": (list(b"a0b1a0b1"), Sampling(temperature=0.1, seed=40))}


def _byte_grammars():
    """Grammars over a byte-level tokenizer of the model's 256 ids, on a StepWork of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers_util import _bytes_to_unicode
    from tlaloc_jax.serve.loop import StepWork
    from tlaloc_jax.serve.openai.structured import Grammars
    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return Grammars(tok.to_str(), 256, [STOP], StepWork())


def _shaped(path, cache, rows: dict, speculative: bool, free: bool = False) -> tuple[dict, dict]:
    """Each of `rows` under GRAMMAR (and, free, ROWS' greedy row beside them without one) in one batch of 24 new
    tokens -> (ids by row, each row's accepted drafts)."""
    grammars = _byte_grammars()
    kw = dict(speculative_config=NGRAM) if speculative else {}
    try:
        with Engine.load(path, cache_dir=cache, progress=False, use_decode_steps=False, **kw) as eng:
            rids = {name: eng.add_request(prompt, 24, (STOP,), sampling=sp,
                                          constraint=grammars.prepare(*GRAMMAR, 1, {STOP})[0])
                    for name, (prompt, sp) in rows.items()}
            if free:
                rids["greedy"] = eng.add_request(ROWS["greedy"][0], 24, (STOP,), sampling=ROWS["greedy"][1])
            while eng.has_unfinished():
                eng.step()
            out, accepted = {}, {}
            for name, rid in rids.items():
                info = eng.request_info(rid)
                out[name] = (eng.output(rid), info.finish_reason, info.error)
                accepted[name] = info.spec.accepted
                eng.release(rid)
    finally:
        grammars.close()
        grammars.steps.close()
    return out, accepted


@pytest.fixture(scope="module")
def shaped_without(artifact, serve_cache_dir) -> dict:
    """The grammar rows' ids without speculation: "alone" (the greedy shaped row), "batched" (SHAPED and a free row)."""
    return {"alone": _shaped(artifact, serve_cache_dir, {"shaped": SHAPED["shaped"]}, speculative=False)[0],
            "batched": _shaped(artifact, serve_cache_dir, SHAPED, speculative=False, free=True)[0]}


def _valid(ids: list[int]) -> bool:
    return re.fullmatch(GRAMMAR[1], bytes(t for t in ids if t != STOP).decode("latin-1")) is not None


def test_rows_under_a_grammar_draft_and_keep_their_greedy_ids(artifact, serve_cache_dir, shaped_without):
    """Greedy rows under a grammar whose mask changes at every position give the ids they give without speculation,
    alone and batched with a free row, and accept drafts on the way; their output is the grammar's."""
    for rows, free, want in (({"shaped": SHAPED["shaped"]}, False, shaped_without["alone"]),
                             (SHAPED, True, shaped_without["batched"])):
        got, accepted = _shaped(artifact, serve_cache_dir, rows, speculative=True, free=free)
        assert got == want
        assert accepted["shaped"] > 0, accepted
        for name in rows:
            assert got[name][1] in ("stop", "length") and _valid(got[name][0]), got[name]


def test_sampled_rows_under_a_grammar_draft_within_it(artifact, serve_cache_dir):
    """A seeded sampled row under the grammar drafts, gives the same tokens on a second run, and stays in the
    grammar."""
    got, accepted = _shaped(artifact, serve_cache_dir, SHAPED_SAMPLED, speculative=True)
    again, _ = _shaped(artifact, serve_cache_dir, SHAPED_SAMPLED, speculative=True)
    assert got == again and sum(accepted.values()) > 0, accepted
    for name, (ids, reason, error) in got.items():
        assert reason in ("stop", "length") and _valid(ids), (name, ids, reason, error)


def test_control_position_zeros_mask_at_every_position_changes_the_ids(artifact, serve_cache_dir, monkeypatch,
                                                                       shaped_without):
    """A verify row whose positions all get its first position's mask (the grammar's before the drafts): the greedy
    row under the grammar no longer gives its ids without speculation, which the tests above would catch."""
    want = shaped_without["alone"]
    real = outputs.draft_masks

    def first_only(s, drafts, vocab):
        masks = real(s, drafts, vocab)
        return masks if masks is None or masks.ndim == 1 else np.repeat(masks[:1], len(masks), axis=0)
    monkeypatch.setattr(outputs, "draft_masks", first_only)
    got, accepted = _shaped(artifact, serve_cache_dir, {"shaped": SHAPED["shaped"]}, speculative=True)
    assert got != want


def test_verify_entries_with_one_mask_a_row_still_serve_without_grammar_drafts(artifact, serve_cache_dir,
                                                                                monkeypatch, shaped_without):
    """The contract before masks per position: a verify entry's TOKEN_MASK [B, W] still loads, and its rows under a
    grammar do not draft (draft_limit), while a shape of neither kind is refused by name. Served so (the
    scheduler told its entries take one mask a row), the grammar row gives its ids without drafting."""
    m = af.load_manifest(artifact, verify_files=False)
    verify = [e for e in m.entries if e.kind == af.EntryKind.VERIFY]
    assert verify and speculative.masks_per_position(verify)

    def with_mask(shape):
        entries = tuple(dataclasses.replace(e, inputs=tuple(
            dataclasses.replace(s, shape=shape(e)) if s.role == af.Role.TOKEN_MASK else s for s in e.inputs))
            if e.kind == af.EntryKind.VERIFY else e for e in m.entries)
        return dataclasses.replace(m, entries=entries)
    old = with_mask(lambda e: (e.batch, m.sampler.mask_words))
    af.check_manifest(old)
    assert not speculative.masks_per_position([e for e in old.entries if e.kind == af.EntryKind.VERIFY])
    with pytest.raises(af.ManifestError, match="TOKEN_MASK is int32"):
        af.check_manifest(with_mask(lambda e: (e.batch, e.tokens_per_seq + 1, m.sampler.mask_words)))

    class Ready:
        constraint = type("C", (), {"ready": lambda self: True})()
        sampling, stop, generated = Sampling(), (), []
    assert speculative.draft_limit(Ready, True, masks=False) == 0
    assert speculative.draft_limit(Ready, True, masks=True) == -1

    want = shaped_without["alone"]
    monkeypatch.setattr(speculative, "masks_per_position", lambda entries: False)
    got, accepted = _shaped(artifact, serve_cache_dir, {"shaped": SHAPED["shaped"]}, speculative=True)
    assert got == want and accepted == {"shaped": 0}
