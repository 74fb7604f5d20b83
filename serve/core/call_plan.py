"""Which of an artifact's entries run a step's work, and how rows group into calls.

The scheduler decides what each sequence advances by (`Work`: positions [start, start + n)); this module lays that
work onto the entries the artifact staged: scored prefills for prompts whose logprobs come from the scoring
entries, a decode_steps call when every running sequence only decodes, and otherwise whichever of the plans below
computes the fewest positions (`call_cost`): prompt chunks and decode rows apart, the first chunk riding with the
decode rows in a mixed call, or every row packed into the chunks' prefill calls. An artifact of flat entries (only
packed prefills, by token bucket) runs every row, one token or a chunk, in them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from tlaloc_jax import artifact as af

from .kv_cache_manager import KVCacheManager
from .paging import RowCall, row_call
from .request import Request


@dataclass(frozen=True)
class Work:
    """A sequence's part of a step: positions [start, start + n); with drafted tokens, its last token and the drafts
    after it (a verify row)."""

    seq: Request
    start: int
    n: int
    draft: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        return self.seq.tokens[self.start:self.start + self.n - len(self.draft)] + list(self.draft)


@dataclass(frozen=True)
class ScheduledCall:
    """One execution: the entry, its sequences and each one's row."""

    entry: af.Entry
    seqs: tuple[Request, ...]
    rows: tuple[RowCall, ...]
    limits: tuple[int, ...] = ()         # decode_steps: the most tokens each row may produce in the call

    @property
    def out_rows(self) -> tuple[int, ...]:
        """Each sequence's row of the outputs (and the sampler): in order, but a mixed call's chunk, which follows
        the entry's `batch` decode rows."""
        if self.entry.kind == af.EntryKind.MIXED:
            return tuple(range(len(self.seqs) - 1)) + (self.entry.batch,)
        return tuple(range(len(self.seqs)))


# What a call costs beyond the positions it computes, in positions: reading the weights once. On a CPU an f32
# weight's bytes take about as long to read as the arithmetic of 16-20 positions (the FLOP rate over the read rate,
# times 2 bytes a FLOP of a multiply-add's f32 weight); the planner compares ways of running a step by it.
CALL_COST_POSITIONS = 16


def call_cost(calls: Sequence[ScheduledCall]) -> int:
    """The positions the calls compute, padding included, plus CALL_COST_POSITIONS each."""
    return sum(CALL_COST_POSITIONS + c.entry.positions for c in calls)


def _largest_call(e: af.Entry) -> tuple[int, int, int, int]:
    """The largest call entry `e` holds, as `Entry.holds` takes it."""
    return e.batch, e.context, e.tokens_per_seq, e.packed_tokens or e.batch * e.tokens_per_seq


# The kinds a lone short request runs, whose smallest entry `covering` keeps too (a mixed call's rows run apart as
# cheaply; a verify call too costly to pay is not made: CallPlanner.drafts_that_pay).
_SMALLEST_TOO = (af.EntryKind.DECODE, af.EntryKind.DECODE_STEPS, af.EntryKind.PREFILL)


def covering(entries: Sequence[af.Entry]) -> list[af.Entry]:
    """The entries that between them hold every call any of `entries` holds (of each kind, those whose largest call
    no larger entry of the kind holds), with the smallest of the kinds a lone short request runs: what a server loads
    before it is ready, the others while it serves, a call meanwhile taking the smallest loaded entry that holds it.
    Every copy_slots entry is in (the runtime calls its first by name). In the given order."""
    keep: set[str] = set()
    for kind in af.EntryKind:
        mine = sorted((e for e in entries if e.kind == kind), key=lambda e: e.size_key, reverse=True)
        if not mine:
            continue
        top: list[af.Entry] = []
        for e in mine:
            if kind == af.EntryKind.COPY_SLOTS or not any(t.holds(*_largest_call(e)) for t in top):
                top.append(e)
        keep |= {e.name for e in top} | ({mine[-1].name} if kind in _SMALLEST_TOO else set())
    return [e for e in entries if e.name in keep]


class CallPlanner:
    """An artifact's entries by kind, and the calls that run a step's work on them."""

    def __init__(self, m: af.Manifest, kv: KVCacheManager, *, use_decode_steps: bool = True):
        self.manifest = m
        self.kv = kv
        self.use_decode_steps = use_decode_steps
        self.use_mixed = True               # run decode rows and a prompt chunk in one call where an entry holds them
        self.scorer = m.scorer             # None: a prompt whose logprobs are asked is read a token a call
        self._by_kind = {kind: sorted((e for e in m.entries if e.kind == kind), key=lambda e: e.size_key)
                         for kind in af.EntryKind}
        self.flat = m.flat                  # every row rides in packed prefill calls
        self.max_decode_batch = m.max_batch
        self._picked: dict[tuple, list[af.Entry]] = {}      # pick's holders, smallest first: the entries never change
        # While entries still load in the background (a preloading server serves once `covering` ones are loaded):
        # loaded(entry) -> whether it runs without waiting (None: every entry does); hurry(entry): load it next.
        self.loaded: Callable[[af.Entry], bool] | None = None
        self.hurry: Callable[[af.Entry], None] = lambda e: None

    def entries(self, kind: str) -> list[af.Entry]:
        """The entries of `kind`, smallest first (by context, then batch)."""
        return self._by_kind[kind]

    def pick(self, kind: str, batch: int, context: int, tokens: int, total: int = 0) -> af.Entry | None:
        """The smallest entry of `kind` that holds `batch` rows of `tokens` tokens reaching `context` positions
        (a packed prefill: `total` tokens in all); while entries still load, the smallest loaded one that holds them
        (a call runs padded rather than wait, and the smallest is loaded next), else the smallest."""
        key = (kind, batch, context, tokens, total)
        holders = self._picked.get(key)
        if holders is None:
            holders = self._picked[key] = [e for e in self.entries(kind) if e.holds(batch, context, tokens, total)]
        if not holders:
            return None
        loaded = self.loaded
        if loaded is None or loaded(holders[0]):
            return holders[0]
        self.hurry(holders[0])
        return next((e for e in holders if loaded(e)), holders[0])

    def scored(self, s: Request) -> bool:
        """Whether the sequence's prompt logprobs come from the scoring prefill entries (the artifact has them,
        with as many top logprobs as the request asks) while it reads its prompt."""
        return (s.prompt_logprobs is not None and not s.generated and self.scorer is not None
                and s.sampling.prompt_logprobs <= self.scorer.top_logprobs)

    def stop_ids(self, s: Request) -> list[int]:
        """The stop ids a token can be (those inside the vocabulary), sorted."""
        return s.stop_ids(self.manifest.model.vocab)

    def plan(self, work: list[Work], everyone: bool, ride=None) -> list[ScheduledCall]:
        """The calls that run `work` (in scheduling order). `everyone`: the work covers every running sequence and
        none waits, so a decode_steps call may take them all several tokens on. ride(seq): whether a decoding
        sequence without drafts may take its token from a verify call (a row of its last token alone, whose token
        is the one a decode call gives): where that costs less (call_cost), such rows ride in the drafting rows'
        verify calls rather than in decode calls of their own."""
        steps = self._steps_call(work) if everyone else None
        if steps is not None:
            return [steps]
        drafting = [w for w in work if w.draft]
        riders = {id(w) for w in work if drafting and ride is not None and not w.draft and w.n == 1
                  and w.seq.decoding and ride(w.seq)}
        plans = [self._calls(drafting, [w for w in work if not w.draft])]
        if riders:
            plans.append(self._calls([w for w in work if w.draft or id(w) in riders],
                                     [w for w in work if not w.draft and id(w) not in riders]))
        return min(plans, key=call_cost)

    def _calls(self, verifying: list[Work], work: list[Work]) -> list[ScheduledCall]:
        """The calls of the verify rows and of the other work."""
        verify = self._group(verifying, af.EntryKind.VERIFY)
        scored = [w for w in work if self.scored(w.seq)]
        single = [w for w in work if w not in scored and w.n == 1]
        chunks = [w for w in work if w not in scored and w.n > 1]       # in scheduling order
        calls = verify + self._group(scored, af.EntryKind.PREFILL_SCORED)
        if self.flat:
            return self._group(sorted(single + chunks, key=lambda w: w.start + w.n), af.EntryKind.PREFILL) + calls
        # Every chunk in prefill calls beside decode calls; or the first chunk riding with the decode rows in a mixed
        # call; or decode rows riding in the chunks' packed prefill calls: whichever computes the fewest positions.
        plans = []
        mixed = self._mixed_call(single, chunks)
        if mixed is not None:
            plans.append([mixed] + self._apart(single[mixed.entry.batch:], chunks[1:]))
        plans.append(self._apart(single, chunks))
        joined = self._joined(single, chunks)
        if joined is not None:
            plans.append(joined)
        return min(plans, key=call_cost) + calls

    def _joined(self, single: list[Work], chunks: list[Work]) -> list[ScheduledCall] | None:
        """The chunks' packed prefill calls with every one-token row riding in them (a packed call computes a
        one-token row as one position); None without packed prefills, or when their rows cannot hold them all: the
        rows that ride would save no decode call, and attend with a chunk's query slots (bench/serving.py, 32
        clients with a shared prefix: 292 tok/s letting 8 - chunks of 32 decode rows ride, 333 tok/s without)."""
        rows = max((e.batch for e in self.entries(af.EntryKind.PREFILL) if e.packed_tokens), default=0)
        if not (chunks and single and rows >= len(chunks) + len(single)):
            return None
        return self._group(sorted(chunks + single, key=lambda w: w.start + w.n), af.EntryKind.PREFILL)

    def _apart(self, single: list[Work], chunks: list[Work]) -> list[ScheduledCall]:
        """The calls of prompt chunks (prefill entries, those that end near each other together) and one-token rows
        (decode entries)."""
        calls = self._group(sorted(chunks, key=lambda w: w.start + w.n), af.EntryKind.PREFILL)
        for i in range(0, len(single), self.max_decode_batch):
            calls += self._group(single[i:i + self.max_decode_batch], af.EntryKind.DECODE)
        return calls

    def _mixed_call(self, single: list[Work], chunks: list[Work]) -> ScheduledCall | None:
        """The decode rows (as many as the largest mixed entry holds) and the first prompt chunk in one mixed call,
        when the artifact has one that holds them (the decode rows then cost next to nothing beside the chunk)."""
        mixed = self.entries(af.EntryKind.MIXED)
        if not (mixed and self.use_mixed and single and chunks):
            return None
        rows = single[:max(e.batch for e in mixed)]
        chunk = chunks[0]
        entry = self.pick(af.EntryKind.MIXED, len(rows), max(w.start + w.n for w in rows + [chunk]), chunk.n)
        if entry is None:
            return None
        work = rows + [chunk]
        return ScheduledCall(entry, tuple(w.seq for w in work),
                             tuple(row_call(w.token_ids, w.start, w.seq.held) for w in work))

    def unmix(self, call: ScheduledCall) -> list[ScheduledCall]:
        """A mixed call as the decode call and the prefill call it stands for."""
        work = [Work(s, row.start, len(row.token_ids)) for s, row in zip(call.seqs, call.rows)]
        return self._group(work[:-1], af.EntryKind.DECODE) + self._group(work[-1:], af.EntryKind.PREFILL)

    def _group(self, work: list[Work], kind: af.EntryKind) -> list[ScheduledCall]:
        """The calls of entries of `kind` that run `work`: rows in order, as many a call as an entry holds."""
        calls = []
        for entry, group in self._groups(work, kind):
            if entry is None:
                raise RuntimeError(f"no {kind} entry holds a row of {group[0].n} tokens reaching position "
                                   f"{group[0].start + group[0].n}")
            rows = tuple(row_call(x.token_ids, x.start, x.seq.held) for x in group)
            calls.append(ScheduledCall(entry, tuple(x.seq for x in group), rows))
        return calls

    def _groups(self, work: list[Work], kind: af.EntryKind) -> list[tuple[af.Entry | None, list[Work]]]:
        """`work` in order, as many rows a group as an entry of `kind` holds, with that entry (None: none holds it)."""
        def fits(group: list[Work]) -> af.Entry | None:
            return self.pick(kind, len(group), max(x.start + x.n for x in group), max(x.n for x in group),
                             sum(x.n for x in group))
        groups: list[tuple[af.Entry | None, list[Work]]] = []
        group: list[Work] = []
        for w in work + [None]:
            if w is not None and fits(group + [w]):
                group = group + [w]
                continue
            if group:
                groups.append((fits(group), group))
            group = [w] if w is not None else []
        return groups

    def _cost(self, work: list[Work], kind: af.EntryKind) -> float:
        """call_cost of running `work` on entries of `kind` (infinite where no entry holds a row)."""
        groups = self._groups(work, kind)
        if any(entry is None for entry, _ in groups):
            return math.inf
        return sum(CALL_COST_POSITIONS + entry.positions for entry, _ in groups)

    def drafts_that_pay(self, decoding: list[Work], drafted: list[tuple[Work, float]], ride=None) -> list[Work]:
        """Of the drafted rows (each with the drafts it is expected to have accepted), those whose verify rows raise
        the step's tokens per unit of call_cost over decoding every row of `decoding` (the step's one-token rows,
        drafted ones included) a token: the best count of them, taken by expected gain. A verify row costs k + 1
        positions where a decode row costs one: one drafting row among four decoding ones seldom pays for the
        verify call (tests/unit/test_drafts_that_pay.py). ride(seq): a row without drafts may take its token from
        the verify call (CallPlanner.plan)."""
        plain = self._cost(decoding, af.EntryKind.DECODE)
        best: list[Work] = []
        best_rate = len(decoding) / plain
        gained = 0.0
        ranked = sorted(drafted, key=lambda wg: -wg[1])
        for m, (_, gain) in enumerate(ranked, 1):
            gained += gain
            verify = [w for w, _ in ranked[:m]]
            chosen = {id(w.seq) for w in verify}
            rest = [w for w in decoding if id(w.seq) not in chosen]
            riders = [w for w in rest if ride is not None and ride(w.seq)]
            cost = self._cost(verify, af.EntryKind.VERIFY) + self._cost(rest, af.EntryKind.DECODE)
            if riders:
                cost = min(cost, self._cost(verify + riders, af.EntryKind.VERIFY)
                           + self._cost([w for w in rest if w not in riders], af.EntryKind.DECODE))
            if (len(decoding) + gained) / cost > best_rate:
                best, best_rate = verify, (len(decoding) + gained) / cost
        return best

    def _multi_step_ok(self, s: Request) -> bool:
        """Whether a decoding sequence's next tokens may come from one decode_steps call: nothing the host decides
        between its tokens. Single steps keep a grammar or other constraint, a stop id masked until min_tokens,
        penalties (the history grows each step), logprobs, stop strings (single_step), more stop ids than the
        entry's STOP_IDS slots, and (an artifact without a sampler) any request that is not plain greedy."""
        sp = s.sampling
        return (s.constraint is None and not s.single_step and sp.logprobs is None and not sp.penalized
                and not (s.stop and len(s.generated) < sp.min_tokens)
                and (self.manifest.sampler is not None or sp.plain))

    def _steps_call(self, work: list[Work]) -> ScheduledCall | None:
        """One decode_steps call for every sequence of `work` when all are decoding and the units for their next
        tokens are free (taken here); else None. Each row may produce up to K tokens, at most its remaining
        max_new_tokens."""
        multi = self.entries(af.EntryKind.DECODE_STEPS)
        if not (multi and self.use_decode_steps and work):
            return None
        if not all(w.seq.decoding and w.n == 1 and self._multi_step_ok(w.seq) for w in work):
            return None
        e0 = multi[0]
        stop_slots = e0.inputs[e0.input_index(af.Role.STOP_IDS)].shape[1]
        if any(len(self.stop_ids(w.seq)) > stop_slots for w in work):
            return None
        limits = tuple(min(e0.steps, w.seq.max_new_tokens - len(w.seq.generated)) for w in work)
        entry = self.pick(af.EntryKind.DECODE_STEPS, len(work), max(w.start + n for w, n in zip(work, limits)), 1)
        if entry is None or min(limits) < 1:
            return None
        taken = []
        for w, n in zip(work, limits):
            before = self.kv.held_counts(w.seq)
            if not self.kv.allocate_slots(w.seq, w.start + n):
                for s, counts in taken:         # give back what the longer call took; single steps run instead
                    self.kv.truncate(s, counts)
                return None
            taken.append((w.seq, before))
        rows = tuple(row_call([w.seq.generated[-1]], w.start, w.seq.held) for w in work)
        return ScheduledCall(entry, tuple(w.seq for w in work), rows, limits)
