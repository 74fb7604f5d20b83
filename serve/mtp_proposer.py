"""MTP drafts (vLLM's methods "mtp", "deepseek_mtp", "qwen3_next_mtp"): the artifact's MTP head (export/_mtp_entries.py)
proposes, whichever family's: the manifest's entries say what it reads.

The decoder's calls return each position's hidden state as the head reads it (HIDDEN_STATES); the model runner hands
a row's valid ones to `observe` (a verify row's: its last token's and its accepted drafts'). When the scheduler asks for
a step's drafts (`propose`), the head reads each decoding sequence's positions it has not read yet, [p0, computed),
token x_{t+1} at position t, batched in its mtp entries (a long run in several calls); its draft at the last position
is the first, and k - 1 calls of one position each chain the head on its own hidden state for the rest, as vLLM's
DeepSeekMTP does. The head's KV lives on the sequence's own pages (its pool shares the decoder's pages), so finishing
or preemption gives them back with the decoder's; what the proposer keeps of a sequence (its hidden states not read
yet) goes when it finishes or is preempted. A chained position past the pages the sequence holds is not written: its
drafts stop there. Drafts are greedy (the head's argmax); the verify call keeps the target's output exact.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tlaloc_jax import artifact as af

from .core.paging import build_step_inputs, row_call


class MtpProposer:
    """The MTP head's drafts for the engine's sequences; runs the artifact's mtp entries on `runner`."""

    def __init__(self, m: af.Manifest, runner):
        self.manifest = m
        self.runner = runner
        self.entries = sorted((e for e in m.entries if e.kind == af.EntryKind.MTP),
                              key=lambda e: (e.tokens_per_seq, e.batch, e.context))
        self.pending: dict[str, tuple[int, np.ndarray]] = {}   # rid -> (first position, hidden [n, E] not read yet)
        self.calls = 0

    def observe(self, s, start: int, hidden: np.ndarray) -> None:
        """A call computed the sequence's positions [start, start + n) with these hidden states [n, E]."""
        p0, h = self.pending.get(s.rid, (start, None))
        if h is not None and p0 + len(h) == start:
            hidden = np.concatenate([h, hidden])
        else:                    # a new run of positions (preempted and read again, or a cached prefix skipped)
            p0 = start
        self.pending[s.rid] = (p0, hidden)

    def release(self, s) -> None:
        """Proposer.release: the sequence finished or was preempted; what is kept of it goes (its pages go with the
        decoder's)."""
        self.pending.pop(s.rid, None)

    def propose(self, rows: Sequence[tuple]) -> list[tuple[int, ...]]:
        """Proposer.propose: each (sequence, k) row's drafts, the head run over all rows' unread positions at once."""
        drafts = self._draft([s for s, _ in rows], max(k for _, k in rows))
        return [tuple(drafts.get(s.rid, ())[:k]) for s, k in rows]

    def _draft(self, seqs: Sequence, k: int) -> dict[str, list[int]]:
        """Up to k drafts, by request id, for each decoding sequence of `seqs` whose unread positions reach its last
        token."""
        rows = []
        for s in seqs:
            if not s.decoding or s.rid not in self.pending:
                continue
            p0, h = self.pending[s.rid]
            if p0 + len(h) == s.computed and len(h):
                del self.pending[s.rid]
                rows.append((s, p0, h))
        if not rows:
            return {}
        longest = self.entries[-1].tokens_per_seq
        last: dict[str, tuple[int, np.ndarray]] = {}
        while rows:         # the head over each row's unread positions, at most `longest` a call
            part = [(s, p0, s.tokens[p0 + 1:p0 + 1 + min(len(h), longest)], h[:longest]) for s, p0, h in rows]
            for (s, _, _, _), out in zip(part, self._run(part)):
                last[s.rid] = out
            rows = [(s, p0 + longest, h[longest:]) for s, p0, h in rows if len(h) > longest]
        chain = [s for s in seqs if s.rid in last]
        drafts = {s.rid: [last[s.rid][0]] for s in chain}
        for j in range(1, k):
            # Draft j + 1 from draft j at position computed + j - 1, where the sequence holds a page.
            part = [(s, s.computed + j - 1, [drafts[s.rid][-1]], last[s.rid][1]) for s in chain
                    if s.computed + j - 1 < len(s.held.get(af.PoolKind.PAGED_KV, ())) * self.manifest.block_size]
            if not part:
                break
            for (s, _, _, _), out in zip(part, self._run(part)):
                drafts[s.rid].append(out[0])
                last[s.rid] = out
            chain = [p[0] for p in part]
        return drafts

    def _entry(self, rows: int, tokens: int, end: int) -> af.Entry:
        """The smallest mtp entry that takes `rows` rows of `tokens` tokens reaching position end - 1."""
        for e in self.entries:
            if e.tokens_per_seq >= tokens and e.batch >= rows and e.context >= end:
                return e
        raise ValueError(f"no mtp entry takes {rows} rows of {tokens} tokens reaching position {end - 1}")

    def _run(self, part: list) -> list[tuple[int, np.ndarray]]:
        """part: (sequence, first position, tokens, hidden [n, E]) per row -> per row (the draft after its last
        position, the head's hidden state there [1, E]); the rows in calls of the largest batch that fits."""
        most = max(e.batch for e in self.entries)
        out = []
        for at in range(0, len(part), most):
            group = part[at:at + most]
            e = self._entry(len(group), max(len(t) for _, _, t, _ in group),
                            max(p + len(t) for _, p, t, _ in group))
            m = self.manifest
            inputs = build_step_inputs([row_call(t, p, s.held) for s, p, t, _ in group], batch=e.batch,
                                       tokens=e.tokens_per_seq, width=e.context // m.block_size,
                                       block_size=m.block_size, state_slots=af.PoolKind.STATE_SLOTS in m.pool_kinds)
            hidden = np.zeros((e.batch, e.tokens_per_seq, m.model.hidden), np.float32)
            for b, (_, _, t, h) in enumerate(group):
                hidden[b, e.tokens_per_seq - len(t):] = h          # rows right-aligned
            inputs[af.Role.HIDDEN_STATES] = hidden
            result = self.runner.run(e, inputs, {af.Role.NEXT_TOKEN, af.Role.HIDDEN_STATES})
            self.calls += 1
            out += [(int(result[af.Role.NEXT_TOKEN][b]), np.asarray(result[af.Role.HIDDEN_STATES][b]))
                    for b in range(len(group))]
        return out
