"""Running a step's calls and turning their outputs into tokens: the engine's model runner.

As vLLM's model runner takes the scheduler's output and returns sampled tokens, `ModelRunner.run_call` builds a
scheduled call's inputs (core/inputs.py), runs its entry on the device (runtime.Runner), and reads each row's token
from the outputs (core/outputs.py): a token is appended to its sequence, which finishes on a stop id or its length.
A failure stays with what it belongs to: a call that fails ends the sequences it held (a mixed call is run again
as the decode and prefill calls it stands for), a row whose token cannot be sampled ends that sequence alone.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from tlaloc_jax import artifact as af

from .core import inputs as call_inputs
from .core import outputs
from .core.request import Request, StepEvent
from .core.scheduler import ScheduledCall, Scheduler
from .host_sampling import log_softmax
from .runtime.runner import Runner

log = logging.getLogger("tlaloc_jax.serve")


def new_stats() -> dict:
    """The counters an engine reports (Engine.stats), zero."""
    return dict(steps=0, prefill_calls=0, decode_calls=0, tokens_generated=0, prompt_tokens=0, requests_finished=0,
                requests_failed=0, requests_refused=0, decode_steps_calls=0, mixed_calls=0, logits_pulled=0,
                sampled_in_body=0, slot_copies=0, batch_sizes={}, verify_calls=0, spec_decode_num_drafts=0,
                spec_decode_num_draft_tokens=0, spec_decode_num_accepted_tokens=0,
                spec_decode_num_accepted_tokens_per_pos=[])


class ModelRunner:
    """Runs scheduled calls on an artifact's entries and emits their tokens; counts into `stats`."""

    def __init__(self, m: af.Manifest, runner: Runner, scheduler: Scheduler, stats: dict):
        self.manifest = m
        self.runner = runner
        self.scheduler = scheduler
        self.stats = stats
        self.ring_pages = m.ring.ring_pages if m.ring else 0
        self.vocab = m.model.vocab
        self.sampler = m.sampler           # None: the host samples from pulled logits
        self.proposer = None               # serve/mtp_proposer.MtpProposer: reads the hidden states the calls return

    def finish(self, s: Request, reason: str, error: str | None = None) -> None:
        s.finish_reason = reason
        s.error = error
        self.scheduler.finish(s)
        self.stats["requests_failed" if reason == "error" else "requests_finished"] += 1

    def fail(self, s: Request, error: str, request: bool = False) -> StepEvent:
        """End a sequence with an error (request: through its own request's fault, its grammar or min_tokens)."""
        self.finish(s, "error", error)
        return StepEvent(s.rid, None, True, "error", error, request_error=request)

    def copy_slots(self, copies: list) -> bool:
        """Run the copy_slots entry for state-slot copies (snapshots taken or restored); True if all ran. The
        scheduler records snapshots only once copied."""
        e = self.scheduler.planner.entries(af.EntryKind.COPY_SLOTS)[0]
        ok = True
        try:
            for i in range(0, len(copies), e.batch):
                part = copies[i:i + e.batch]
                src = np.full(e.batch, -1, np.int32)
                dst = np.full(e.batch, -1, np.int32)
                src[:len(part)] = [c.src for c in part]
                dst[:len(part)] = [c.dst for c in part]
                self._execute(e, {af.Role.COPY_SRC: src, af.Role.COPY_DST: dst}, set())
                self.stats["slot_copies"] += len(part)
        except Exception as err:   # noqa: BLE001 - a failed copy records no snapshot; restored sequences fail
            log.error("copying state slots failed: %s", err)
            ok = False
        self.scheduler.kv.commit_copies(copies, ok)
        return ok

    def _execute(self, e: af.Entry, inputs: dict, want: set[af.Role]) -> dict[af.Role, np.ndarray]:
        """Run one entry (the runner's job) and count what was pulled."""
        out = self.runner.run(e, inputs, want)
        if af.Role.LOGITS in want:
            self.stats["logits_pulled"] += 1
        if af.Role.SAMPLED_TOKEN in want:
            self.stats["sampled_in_body"] += 1
        return out

    def _count_call(self, kind: af.EntryKind, n: int) -> None:
        key = {af.EntryKind.MIXED: "mixed_calls", af.EntryKind.DECODE: "decode_calls",
               af.EntryKind.DECODE_STEPS: "decode_calls", af.EntryKind.VERIFY: "verify_calls"}.get(kind, "prefill_calls")
        self.stats[key] += 1
        bs = self.stats["batch_sizes"]
        bs[n] = bs.get(n, 0) + 1

    def _emit(self, s: Request, tok: int, now: float, logprob=None, top=None, prompt_logprobs=None) -> StepEvent:
        """Append a generated token to its sequence, finish it on a stop id or its length, and report it."""
        s.generated.append(tok)
        s.token_times.append(now)
        if s.first_token_time is None:
            s.first_token_time = now
        self.stats["tokens_generated"] += 1
        reason = "stop" if tok in s.stop else "length" if len(s.generated) >= s.max_new_tokens else None
        if reason:
            self.finish(s, reason)
        return StepEvent(s.rid, tok, reason is not None, reason, logprob=logprob, top_logprobs=top,
                         prompt_logprobs=prompt_logprobs)

    def run_call(self, call: ScheduledCall) -> list[StepEvent]:
        e = call.entry
        if e.kind == af.EntryKind.DECODE_STEPS:
            return self._run_steps_call(call)
        if e.kind == af.EntryKind.VERIFY:
            return self._run_verify_call(call)
        ends = [row.start + len(row.token_ids) for row in call.rows]
        # The rows that write a sequence's last token get its next token.
        producing = [end == s.length for s, end in zip(call.seqs, ends)]
        scoring = e.kind == af.EntryKind.PREFILL_SCORED
        try:
            inputs = call_inputs.step_inputs(call, self.manifest, self.ring_pages)
            allowed = [outputs.allowed_mask(s, self.vocab) if p else None for s, p in zip(call.seqs, producing)]
            if self.sampler is not None:
                inputs.update(call_inputs.sampler_inputs(self.runner, call, producing, allowed))
            if scoring:
                inputs[af.Role.SCORE_TARGETS] = call_inputs.score_targets(call, e.batch, e.tokens_per_seq)
            t0 = time.perf_counter()
            want = outputs.wanted(call, producing, allowed, self.sampler) | self._hidden(e)
            out = self._execute(e, inputs, want)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("call %s: %d rows, %d tokens, %.1f ms", e.name, len(call.seqs),
                          sum(len(r.token_ids) for r in call.rows), 1e3 * (time.perf_counter() - t0))
        except Exception as err:   # noqa: BLE001 - the call's requests fail, the engine keeps serving
            log.error("call of %s failed: %s", e.name, err)
            if e.kind == af.EntryKind.MIXED:
                # A mixed call stands for a decode call and a prefill call: run them apart, so that a failure fails
                # only the sequences of the call it belongs to, as it would have without mixing.
                return [ev for part in self.scheduler.planner.unmix(call) for ev in self.run_call(part)]
            return [self.fail(s, f"{e.name} failed: {err}") for s in call.seqs]
        self._count_call(e.kind, len(call.seqs))
        now = time.perf_counter()
        events = []
        for i, (b, s, row, end) in enumerate(zip(call.out_rows, call.seqs, call.rows, ends)):
            lsm = None
            if scoring:
                s.prompt_logprobs.extend(outputs.prompt_scores(out, b, s, row.start, len(row.token_ids),
                                                               e.tokens_per_seq))
            elif s.prompt_logprobs is not None and not s.generated:
                # The distribution after this prompt token scores the next one (the last one's is the first
                # generated token's, reported with it).
                lsm = log_softmax(out[af.Role.LOGITS][b])
                entry = outputs.next_prompt_score(lsm, s, end)
                if entry is not None:
                    s.prompt_logprobs.append(entry)
            if row.start < len(s.prompt):
                self.stats["prompt_tokens"] += min(end, len(s.prompt)) - row.start
            self.scheduler.written(s, end)
            if af.Role.HIDDEN_STATES in want:     # rows right-aligned
                hidden = out[af.Role.HIDDEN_STATES][b]
                self.proposer.observe(s, row.start, hidden[len(hidden) - (end - row.start):])
            if not producing[i]:
                continue      # more of the sequence to read; this call's logits are not a token yet
            if allowed[i] is not None and not allowed[i].any():
                why = "its grammar and" if s.constraint is not None else "its stop ids and"
                events.append(self.fail(s, f"no token is allowed after {len(s.generated)} tokens: {why} min_tokens "
                                            f"leave none (min_tokens {s.sampling.min_tokens})", request=True))
                continue
            try:
                tok, logprob, top = outputs.row_token(out, b, s, allowed[i], lsm, self.sampler, self.vocab)
                if s.constraint is not None and not s.constraint.accept(tok):
                    raise ValueError(f"token {tok} is outside the request's grammar")
            except Exception as err:   # noqa: BLE001 - this sequence fails; the call's others keep their tokens
                log.error("sampling %s failed: %s", s.rid, err)
                events.append(self.fail(s, f"sampling failed: {err}"))
                continue
            first = not s.generated
            events.append(self._emit(s, tok, now, logprob, top,
                                     tuple(s.prompt_logprobs) if first and s.prompt_logprobs else None))
        return events

    def _run_steps_call(self, call: ScheduledCall) -> list[StepEvent]:
        """Run a decode_steps call: the pages for each row's tokens are taken before it; its tokens come back as
        [B, K] (-1 past a row's stop) and are emitted in step order, each checked as a single step's would be."""
        e = call.entry
        n = len(call.seqs)
        try:
            inputs = call_inputs.step_inputs(call, self.manifest, self.ring_pages)
            stops = [self.scheduler.planner.stop_ids(s) for s in call.seqs]
            inputs.update(call_inputs.decode_steps_inputs(call, stops))
            if self.sampler is not None:
                inputs.update(call_inputs.sampler_inputs(self.runner, call, [True] * n, [None] * n))
            t0 = time.perf_counter()
            tokens = self._execute(e, inputs, {af.Role.STEP_TOKENS})[af.Role.STEP_TOKENS]
            if log.isEnabledFor(logging.DEBUG):
                log.debug("call %s: %d rows, %.1f ms", e.name, n, 1e3 * (time.perf_counter() - t0))
        except Exception as err:   # noqa: BLE001 - the call's requests fail, the engine keeps serving
            log.error("call of %s failed: %s", e.name, err)
            return [self.fail(s, f"{e.name} failed: {err}") for s in call.seqs]
        self._count_call(e.kind, n)
        self.stats["decode_steps_calls"] += 1
        now = time.perf_counter()
        events = []
        for i in range(e.steps):
            for b, s in enumerate(call.seqs):
                tok = int(tokens[b, i])
                if s.finished or tok < 0:
                    continue
                if not 0 <= tok < self.vocab:
                    events.append(self.fail(s, f"{e.name} returned token {tok}, outside the vocabulary"))
                    continue
                self.scheduler.written(s, s.length)
                events.append(self._emit(s, tok, now))
        return events

    def _run_verify_call(self, call: ScheduledCall) -> list[StepEvent]:
        """Run a verify call (serve/speculative.py): each row emits the drafts the body accepts and then the token it
        chose after them (kernels/rejection_sampler.py), in order, stopping at a stop id or max_new_tokens; the units
        taken for the rejected drafts go back."""
        e = call.entry
        want = {af.Role.VERIFY_TOKENS, af.Role.VERIFY_ACCEPTED}
        if any(s.sampling.logprobs is not None for s in call.seqs):
            want.add(af.Role.VERIFY_LOGPROB)
        if any(s.sampling.logprobs for s in call.seqs):
            want |= {af.Role.VERIFY_TOP_LOGPROBS, af.Role.VERIFY_TOP_IDS}
        try:
            inputs = call_inputs.step_inputs(call, self.manifest, self.ring_pages)
            if call_inputs.takes_sampler(e):
                # A mask per position where the entry takes them (a grammar's after each draft); else one a row, and
                # the scheduler drafts only where every position's is the same (serve/speculative.py).
                allowed = [outputs.draft_masks(s, row.token_ids[1:], self.vocab)
                           for s, row in zip(call.seqs, call.rows)]
                inputs.update(call_inputs.sampler_inputs(self.runner, call, [True] * len(call.seqs), allowed))
            want |= self._hidden(e)
            out = self._execute(e, inputs, want)
        except Exception as err:   # noqa: BLE001 - the call's requests fail, the engine keeps serving
            log.error("call of %s failed: %s", e.name, err)
            return [self.fail(s, f"{e.name} failed: {err}") for s in call.seqs]
        self._count_call(e.kind, len(call.seqs))
        now = time.perf_counter()
        events = []
        for b, (s, row) in enumerate(zip(call.seqs, call.rows)):
            col = e.tokens_per_seq - len(row.token_ids)          # rows are right-aligned
            drafts = list(row.token_ids[1:])
            n = int(out[af.Role.VERIFY_ACCEPTED][b])
            if not 0 <= n <= len(drafts):
                events.append(self.fail(s, f"{e.name} accepted {n} of {len(drafts)} drafts"))
                continue
            if drafts:                         # a row without drafts rode along for its next token
                self._count_drafts(s, len(drafts), n)
            # The accepted drafts, then the target's own token after them; a grammar advances by all of them.
            emitted = drafts[:n] + [int(out[af.Role.VERIFY_TOKENS][b, col + n])]
            bad = [t for t in emitted if not 0 <= t < self.vocab]
            if bad:
                events.append(self.fail(s, f"{e.name} returned token {bad[0]}, outside the vocabulary"))
                continue
            if s.constraint is not None and not s.constraint.accept_tokens(emitted):
                events.append(self.fail(s, f"{e.name} returned tokens {emitted} outside the request's grammar"))
                continue
            for i, tok in enumerate(emitted):
                k, logprob, top = s.sampling.logprobs, None, None
                if k is not None:
                    logprob = float(out[af.Role.VERIFY_LOGPROB][b, col + i])
                    top = tuple(zip(out[af.Role.VERIFY_TOP_IDS][b, col + i, :k].tolist(),
                                    out[af.Role.VERIFY_TOP_LOGPROBS][b, col + i, :k].tolist())) if k else ()
                events.append(self._emit(s, tok, now, logprob, top))
                if s.finished:
                    break
            if not s.finished:
                self.scheduler.verified(s, row.start + n + 1)
                if af.Role.HIDDEN_STATES in want:  # its last token's and its accepted drafts'
                    self.proposer.observe(s, row.start, out[af.Role.HIDDEN_STATES][b, col:col + n + 1])
        return events

    def _hidden(self, e: af.Entry) -> set[af.Role]:
        """{HIDDEN_STATES} where an MTP proposer reads the entry's hidden states, else {}."""
        if self.proposer is None or not any(o.role == af.Role.HIDDEN_STATES for o in e.outputs):
            return set()
        return {af.Role.HIDDEN_STATES}

    def _count_drafts(self, s: Request, drafted: int, accepted: int) -> None:
        """vLLM's spec-decode counters, and the sequence's own (it backs off, or stops, when few are accepted)."""
        st = self.stats
        st["spec_decode_num_drafts"] += 1
        st["spec_decode_num_draft_tokens"] += drafted
        st["spec_decode_num_accepted_tokens"] += accepted
        per = st["spec_decode_num_accepted_tokens_per_pos"]
        per.extend([0] * (drafted - len(per)))
        for i in range(accepted):
            per[i] += 1
        s.spec.verified(drafted, accepted, len(s.generated))
