"""Which sequences a step advances, and by how many tokens.

The model it keeps, as vLLM v1's scheduler: a sequence has `computed` positions written in the pools, out of
`length` (prompt + generated). Each step gives it the next n positions, [computed, computed + n): a chunk of its
prompt while it reads it, one token once it decodes. There is no prefill or decode phase of a step, only sequences
catching up with their length. A step's budget is `max_num_batched_tokens` positions and `max_num_seqs` sequences:
running sequences first (in priority, then arrival order), then waiting ones while budget, room and units last.

Units (KV pages, ring pages, state slots) are the KV-cache manager's (core/kv_cache_manager.py): a sequence takes
them as its positions are written. When a running sequence needs a unit and none is free, the youngest running
sequence (lowest priority, latest arrival) is preempted: it gives back everything and waits again with its tokens
so far, which it computes again when it runs (what it already sent is not sent again). A waiting sequence first
asks the manager for its cached prefix (full pages shared by hash; recurrent states through snapshots) and starts
after it. How the step's work becomes calls of the artifact's entries is core/call_plan.py's job.

With speculative decoding on (`speculative`), a decoding sequence that may draft (serve/speculative.py) advances
by its last token and the tokens the proposer drafts after it, all counted in the budget; a verify call checks them
and the sequence emits what the target confirms. The step's drafting sequences are proposed for together, before
any is given units (a draft model runs them as one batch).

The scheduler knows an artifact's pools by kind only, never by name or model.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Sequence

from tlaloc_jax import artifact as af

from .call_plan import CallPlanner, ScheduledCall, Work
from .kv_cache_manager import KVCacheManager
from .prefix_cache import Copy
from .request import Request, RequestRefused
from .. import speculative as spec

log = logging.getLogger("tlaloc_jax.serve")


@dataclass(frozen=True)
class Step:
    """What one engine step runs: state snapshots restored into new sequences' slots, then the calls."""

    restores: list[Copy]
    calls: list[ScheduledCall]


class Scheduler:
    """The requests an engine holds, the queues they wait and run in, and what each step advances."""

    def __init__(self, m: af.Manifest, max_context: int, *, use_decode_steps: bool = True,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 prefix_caching: bool | None = None, identity: str = ""):
        self.manifest = m
        self.max_context = max_context
        self.block_size = m.block_size
        self.kv = KVCacheManager(m, prefix_caching=prefix_caching, identity=identity)
        self.planner = CallPlanner(m, self.kv, use_decode_steps=use_decode_steps)
        self.max_num_seqs = max_num_seqs or self.planner.max_decode_batch
        prefill = self.planner.entries(af.EntryKind.PREFILL)
        # A prompt read alone takes the longest chunk an entry holds; prompts read side by side take the longest
        # chunk of the entries of several rows, so that they share calls.
        self.chunk_cap = max(e.tokens_per_seq for e in prefill)
        self.shared_chunk_cap = max((e.tokens_per_seq for e in prefill if e.batch > 1), default=self.chunk_cap)
        # The largest prefill call beside a decode call of every sequence; flat entries: the largest call, which
        # holds both (vLLM's max_num_batched_tokens).
        largest = max(e.positions for e in prefill)
        self.max_num_batched_tokens = max_num_batched_tokens or largest + (0 if m.flat else self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} must be at least max_num_seqs "
                             f"{self.max_num_seqs} (every running sequence decodes a token a step)")
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []          # sorted by Request.key
        self.running: list[Request] = []          # sorted by Request.key
        self.stats = dict(preemptions=0, prefix_queries=0, prefix_hits=0)
        self.lora = None      # serve.lora_slots.LoraSlots of an artifact with adapter slots: a running request holds one
        self.speculative: spec.SpeculativeConfig | None = None     # set by the engine (checked against the artifact)
        self.proposer: spec.Proposer | None = None                 # set by the engine with `speculative`
        top = [e.outputs[e.output_index(af.Role.VERIFY_TOP_IDS)].shape[2] for e in self.planner.entries(
            af.EntryKind.VERIFY)]
        self.verify_top_logprobs = min(top, default=0)
        # Verify entries that take the sampler's inputs accept sampled rows too (serve/speculative.draft_limit).
        self.verify_samples = bool(top) and all(any(sig.role == af.Role.SAMPLING for sig in e.inputs)
                                                for e in self.planner.entries(af.EntryKind.VERIFY))
        self.verify_masks = spec.masks_per_position(self.planner.entries(af.EntryKind.VERIFY))

    @property
    def prefix_caching(self) -> bool:
        return self.kv.prefix_caching

    def configure(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Change the limits between steps (the server's --max-num-seqs); the token budget grows to hold them."""
        if max_num_seqs is not None:
            if max_num_seqs < 1:
                raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
            self.max_num_seqs = max_num_seqs
        if max_num_batched_tokens is not None:
            self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_num_seqs)

    # -- admission -------------------------------------------------------------------------------------

    def check_length(self, prompt_len: int, max_new_tokens: int, what: str = "max_new_tokens") -> None:
        if prompt_len > self.max_context:
            raise RequestRefused("too_long", f"prompt of {prompt_len} tokens is longer than the largest context "
                                             f"{self.max_context}")
        if prompt_len + max_new_tokens - 1 > self.max_context:
            raise RequestRefused("too_long", f"prompt of {prompt_len} tokens plus {what} {max_new_tokens} "
                                             f"exceeds the largest context {self.max_context}")

    def check_could_fit(self, sizes: Sequence[tuple[int, int]]) -> None:
        """Refuse sequences, given as (prompt tokens, max_new_tokens), one of which could never run: longer than the
        largest context ("too_long") or needing more units of a pool than the whole pool holds ("exceeds_pool").
        Sequences that fit alone are queued, however many; reads only the pools' sizes, so any thread may call it."""
        for prompt_len, max_new_tokens in sizes:
            self.check_length(prompt_len, max_new_tokens)
            self.kv.check_could_fit(prompt_len, max_new_tokens)

    def add(self, s: Request) -> None:
        self.requests[s.rid] = s
        bisect.insort(self.waiting, s, key=lambda r: r.key)

    def finish(self, s: Request) -> None:
        """A sequence ended (finish_reason set): it leaves the queues and gives back what it holds."""
        if s.running:
            self.running.remove(s)
            s.running = False
        elif s in self.waiting:
            self.waiting.remove(s)
        self.kv.free(s)
        self._give_adapter(s)
        self._release_drafts(s)

    def _release_drafts(self, s: Request) -> None:
        if self.proposer is not None:
            self.proposer.release(s)

    def _take_adapter(self, s: Request) -> bool:
        """A slot for the sequence's adapter (none needed without one); False: every slot is held, it waits."""
        if s.lora is None or s.lora_slot:
            return True
        slot = self.lora.acquire(s.lora)
        s.lora_slot = slot or 0
        return slot is not None

    def _give_adapter(self, s: Request) -> None:
        if s.lora_slot:
            self.lora.release(s.lora_slot)
            s.lora_slot = 0

    def _preempt(self, s: Request) -> None:
        """Send a running sequence back to the queue with its tokens so far; it gives back all it holds."""
        self.running.remove(s)
        s.running = False
        self.kv.free(s)
        self._give_adapter(s)
        self._release_drafts(s)
        s.computed = s.junction = 0
        s.preemptions += 1
        if s.prompt_logprobs is not None and not s.generated:
            s.prompt_logprobs[1:] = []           # scored again as the prompt is read again
        bisect.insort(self.waiting, s, key=lambda r: r.key)
        self.stats["preemptions"] += 1
        log.info("preempted %s (%d tokens so far; %d free units)", s.rid, s.length, self.kv.least_free())

    def written(self, s: Request, end: int) -> None:
        """A call wrote the sequence's positions up to `end` (its full pages join the prefix cache)."""
        s.computed = max(s.computed, end)
        self.kv.cache_written(s, end)

    def verified(self, s: Request, end: int) -> None:
        """A verify call left the sequence's positions up to `end` valid: the units it took for rejected drafts past
        its length go back (the positions there are written again by its next call)."""
        self.written(s, end)
        self.kv.trim(s, s.length)

    # -- a step --------------------------------------------------------------------------------------------

    def _chunk(self, s: Request, budget: int, alone: bool = True) -> int:
        """How many of the sequence's positions from `computed` its next call writes (at most `budget`; at most the
        shared chunk unless it is the only sequence reading its prompt)."""
        start = s.computed
        cap = self.chunk_cap if alone else self.shared_chunk_cap
        if s.prompt_logprobs is not None and not s.generated and not self.planner.scored(s):
            # Without scoring entries (or with fewer top logprobs than asked) prompt logprobs need the distribution
            # after every prompt token, and a plain entry returns the logits of each row's last token: such a
            # prompt is read one token a call.
            cap = 1
        limit = self.kv.call_limit(start)
        if limit is not None:
            cap = min(cap, limit)
        n = min(s.length - start, cap, budget)
        if start < s.junction:
            n = min(n, s.junction - start)
        end = start + n
        if end < s.length and end % self.block_size and end - end % self.block_size > start:
            n = end - end % self.block_size - start     # a chunk that stops short ends on a page boundary
        return max(n, 0)

    def _draft_limit(self, s: Request) -> int:
        """The most tokens the proposer may draft after a decoding sequence's last token (0: none): none where its
        sampling cannot be verified exactly (speculative.draft_limit), more logprobs are asked than the verify entries
        return, or its drafts are seldom accepted (backing off). A draft never reaches past max_new_tokens or the
        largest context."""
        cfg, sp = self.speculative, s.sampling
        exact = spec.draft_limit(s, self.verify_samples, self.verify_masks) if cfg is not None else 0
        if exact == 0 or not s.spec.may_draft(len(s.generated)) or (sp.logprobs or 0) > self.verify_top_logprobs:
            return 0
        k = cfg.num_speculative_tokens
        limit = self.kv.call_limit(s.computed)
        return max(0, min(k, s.max_new_tokens - len(s.generated) - 1, self.max_context - s.length,
                          (limit if limit is not None else k + 1) - 1, exact if exact > 0 else k))

    def _drafts(self, seqs: Sequence[Request]) -> dict[str, tuple[int, ...]]:
        """The drafts of the decoding sequences among `seqs`, by request id, from one ask of the proposer (none while
        disable_by_batch_size or more sequences run)."""
        off = self.speculative is not None and self.speculative.disable_by_batch_size
        if off and len(self.running) >= off:
            return {}
        rows = [(s, k) for s in seqs if s.decoding and (k := self._draft_limit(s)) > 0]
        if not rows:
            return {}
        drafts = {s.rid: spec.allowed_drafts(s, tuple(d[:k])) for (s, k), d in zip(rows, self.proposer.propose(rows))}
        # Only the drafts that pay for their verify rows at this step's batch (CallPlanner.drafts_that_pay): a cost
        # model of positions and each sequence's acceptance so far, never timings, so a seeded row's tokens do not
        # depend on the machine's speed.
        decoding = [s for s in seqs if s.decoding and (s.constraint is None or s.constraint.ready())]
        drafted = [(Work(s, s.computed, 1 + len(drafts[s.rid]), drafts[s.rid]),
                    s.spec.expected_accepted(len(drafts[s.rid]))) for s in decoding if drafts.get(s.rid)]
        paying = self.planner.drafts_that_pay([Work(s, s.computed, 1) for s in decoding], drafted, self._may_ride)
        for w, _ in drafted:
            if w not in paying:
                w.seq.spec.pause(len(w.seq.generated))     # not proposing every step only to be left out
        return {w.seq.rid: w.draft for w in paying}

    def schedule(self) -> Step:
        """This step's calls: every running sequence advanced (preempting the youngest when units run out), then
        waiting sequences admitted while there is budget, room and units."""
        budget = self.max_num_batched_tokens
        work: list[Work] = []
        preempted = False
        reading = sum(not s.decoding for s in self.running) + min(len(self.waiting),
                                                                   max(0, self.max_num_seqs - len(self.running)))
        alone = reading <= 1
        order = list(self.running)
        drafts = self._drafts(order)
        for i, s in enumerate(order):
            if not s.running:
                continue                  # preempted earlier in this loop
            if s.decoding and s.constraint is not None and not s.constraint.ready():
                continue                  # its grammar is still working out its next mask: it sits this step out
            n = self._chunk(s, budget, alone)
            if n == 0:
                continue
            # Drafts leave a token of the budget to each running sequence after this one.
            draft = drafts.get(s.rid, ())[:max(0, budget - n - (len(order) - 1 - i))] if s.decoding else ()
            if draft and not self.kv.allocate_slots(s, s.computed + n + len(draft)):
                draft = ()                # drafts never preempt a sequence: without the units, none this step
            n += len(draft)
            while not self.kv.allocate_slots(s, s.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
            if s.running:
                work.append(Work(s, s.computed, n, draft))
                budget -= n
        restores: list[Copy] = []
        i = 0                             # waiting sequences before i wait for a prefix a running one computes
        while i < len(self.waiting) and not preempted and len(self.running) < self.max_num_seqs and budget > 0:
            s = self.waiting[i]
            if not self._take_adapter(s):
                i += 1                    # its adapter waits for a slot; later requests may run meanwhile
                continue
            hit = self.kv.get_computed_blocks(s)
            if hit is not None and self.kv.computing(self.running, s, hit):
                self.kv.undo_computed_blocks(s, hit)
                self._give_adapter(s)
                i += 1
                continue
            n = self._chunk(s, budget, alone)
            end = s.computed + n
            if n == 0 or not self.kv.can_admit(s, end, bool(self.running)) or not self.kv.allocate_slots(s, end):
                self.kv.undo_computed_blocks(s, hit)
                self._give_adapter(s)
                break
            self.waiting.pop(i)
            if hit is not None:
                self.stats["prefix_queries"] += s.length
                self.stats["prefix_hits"] += hit.length
                if hit.snapshot is not None:
                    restores.append(Copy(hit.snapshot, s.held[af.PoolKind.STATE_SLOTS][0], seq=s))
            s.running = True
            bisect.insort(self.running, s, key=lambda r: r.key)
            work.append(Work(s, s.computed, n))
            budget -= n
        everyone = not self.waiting and len(work) == len(self.running)
        return Step(restores, self.planner.plan(work, everyone, self._may_ride if self.speculative else None))

    def _may_ride(self, s: Request) -> bool:
        """Whether a decoding sequence without drafts may take its token from a verify call's row: plain greedy (its
        token the row's argmax, however the call's other rows sample), no grammar, the logprobs the entries return."""
        return s.constraint is None and s.sampling.plain and (s.sampling.logprobs or 0) <= self.verify_top_logprobs

    def usage(self) -> float:
        """The fraction of the first pool kind's units held by sequences (vllm:kv_cache_usage_perc)."""
        return self.kv.usage()
