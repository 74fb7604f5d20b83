"""CallPlanner.drafts_that_pay: a step runs the drafts whose expected accepted tokens raise its tokens per unit of
call_cost over decoding every row a token. Entries of k = 4 drafts on a ladder of batch 1, 2 and 4: a decode call
costs CALL_COST_POSITIONS + its rows, a verify call CALL_COST_POSITIONS + 5 positions a row."""

from __future__ import annotations

from types import SimpleNamespace

from tlaloc_jax import artifact as af
from tlaloc_jax.serve.core.call_plan import CALL_COST_POSITIONS, CallPlanner, Work

K = 4


def _entry(kind: af.EntryKind, batch: int, tokens: int) -> af.Entry:
    return af.Entry(name=f"{kind}_b{batch}", kind=kind, batch=batch, context=64, tokens_per_seq=tokens, serialized="",
                    serialized_sha256="", inputs=(), outputs=(), donations=(), kept_inputs=())


PLANNER = CallPlanner(SimpleNamespace(entries=[_entry(af.EntryKind.DECODE, b, 1) for b in (1, 2, 4)]
                                      + [_entry(af.EntryKind.VERIFY, b, K + 1) for b in (1, 2, 4)],
                                      scorer=None, flat=False, max_batch=4), kv=None)


def _rows(gains: list[float | None]) -> tuple[list[Work], list[tuple[Work, float]]]:
    """Decoding rows at position 20, those with a gain drafting K tokens expected to have that many accepted."""
    seqs = [SimpleNamespace(rid=str(i)) for i in range(len(gains))]
    decoding = [Work(s, 20, 1) for s in seqs]
    drafted = [(Work(s, 20, 1 + K, (1,) * K), g) for s, g in zip(seqs, gains) if g is not None]
    return decoding, drafted


def _paying(gains, ride=lambda s: True) -> list[str]:
    decoding, drafted = _rows(gains)
    return sorted(w.seq.rid for w in PLANNER.drafts_that_pay(decoding, drafted, ride))


def test_a_lone_sequence_drafts_while_its_drafts_pay_for_the_verify_row():
    # Break-even: (1 + g) / (16 + 5) = 1 / (16 + 1), g = 4/17.
    assert CALL_COST_POSITIONS == 16
    assert _paying([0.3]) == ["0"]
    assert _paying([0.2]) == []


def test_one_drafting_row_in_four_does_not_pay_for_the_verify_call():
    # Riding: (4 + 2.7) / 36 < 4 / 20; apart: (4 + 2.7) / (21 + 20) is less still.
    assert _paying([2.7, None, None, None]) == []
    assert _paying([2.7, None, None, None], ride=lambda s: False) == []


def test_four_drafting_rows_pay_when_a_fifth_of_the_drafts_are_accepted():
    # (4 + 4 g) / 36 against 4 / 20: g > 0.8 pays.
    assert _paying([1.0] * 4) == ["0", "1", "2", "3"]
    assert _paying([0.7] * 4) == []


def test_rows_worth_drafting_take_the_others_along_as_riders():
    # Two rows of 3 expected pay for a verify call of four: the two rows of 0.1 ride in it at no cost of their own.
    assert _paying([3.0, 0.1, 3.0, 0.1]) == ["0", "1", "2", "3"]
    # Without riders, the fourth row without drafts: the two good rows in a verify call of two beside a decode call
    # of two, (4 + 6) / (26 + 18) > 4 / 20; the 0.1 row too would need a verify call of four beside a decode call of
    # one, (4 + 6.1) / (36 + 17).
    assert _paying([3.0, 0.1, 3.0, None], ride=lambda s: False) == ["0", "2"]


def test_control_running_every_draft_is_what_the_gate_leaves_out():
    decoding, drafted = _rows([2.7, None, None, None])
    every = [w for w, _ in drafted]
    assert every and PLANNER.drafts_that_pay(decoding, drafted, lambda s: True) != every


def test_a_sequence_left_out_proposes_again_after_a_pause():
    """SpecState.pause: the scheduler does not ask the proposer for a left-out sequence's drafts every step."""
    from tlaloc_jax.serve.speculative import BACKOFF_TOKENS, SpecState
    st = SpecState()
    st.pause(10)
    assert not st.may_draft(10 + BACKOFF_TOKENS - 1) and st.may_draft(10 + BACKOFF_TOKENS)
    assert st.drafted == 0 and st.misses == 0
