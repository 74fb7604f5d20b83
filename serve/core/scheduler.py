"""Which sequences a step advances, by how many tokens, in which calls; what each holds of the pools.

Requests wait in a queue (priority, then arrival) and run while there is room: at most `max_num_seqs` at once,
and each step fills a budget of `max_num_batched_tokens` with the running sequences' next tokens first (one
each when decoding, one chunk each while reading a prompt) and then the first chunks of waiting sequences.
Pages are taken as positions are written. When a running sequence needs a page and none is free, the youngest
running sequence (lowest priority, latest arrival) is preempted: it gives back everything it holds and waits
again with its tokens so far, which it computes again when it runs (what it already sent is not sent again).

Prefix caching (core/prefix_cache.py): full pages are shared by the hash of their tokens and everything before
them, recurrent states through snapshots copied at page-aligned chunk ends by the artifact's copy_slots entry.
Pools whose content a later sequence cannot reuse exactly (a sliding window's ring of pages; state pools of an
artifact without a copy_slots entry) turn prefix caching off, by name.

The scheduler knows an artifact's pools by kind only (tlaloc_jax.paging rules), never by name or model.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Sequence

from tlaloc_jax import artifact as mf
from tlaloc_jax.paging import RowCall, pool_rule, row_call

from . import kv_cache
from .prefix_cache import Copy, PrefixCache
from .request import Request, RequestRefused

log = logging.getLogger("tlaloc_jax.serve")

# How refusals and logs name each kind's units.
KIND_NAMES = {mf.PoolKind.PAGED_KV: ("KV", "pages"), mf.PoolKind.RING_KV: ("windowed KV", "pages"),
              mf.PoolKind.STATE_SLOTS: ("state", "slots")}


@dataclass(frozen=True)
class ScheduledCall:
    """One execution: the entry, its sequences and each one's row."""

    entry: mf.Entry
    seqs: tuple[Request, ...]
    rows: tuple[RowCall, ...]
    limits: tuple[int, ...] = ()         # decode_steps: the most tokens each row may produce in the call

    @property
    def out_rows(self) -> tuple[int, ...]:
        """Each sequence's row of the outputs (and the sampler): in order, but a mixed call's chunk, which follows
        the entry's `batch` decode rows."""
        if self.entry.kind == mf.EntryKind.MIXED:
            return tuple(range(len(self.seqs) - 1)) + (self.entry.batch,)
        return tuple(range(len(self.seqs)))


# What a call costs beyond the positions it computes, in positions: reading the weights once. On a CPU an f32
# weight's bytes take about as long to read as the arithmetic of 16-20 positions (the FLOP rate over the read rate,
# times 2 bytes a FLOP of a multiply-add's f32 weight); the scheduler compares ways of running a step by it.
CALL_COST_POSITIONS = 16


def call_cost(calls: Sequence[ScheduledCall]) -> int:
    """The positions the calls compute, padding included, plus CALL_COST_POSITIONS each."""
    return sum(CALL_COST_POSITIONS + c.entry.positions for c in calls)


@dataclass(frozen=True)
class Step:
    """What one engine step runs: state snapshots restored into new sequences' slots, then the calls."""

    restores: list[Copy]
    calls: list[ScheduledCall]


@dataclass(frozen=True)
class _Work:
    seq: Request
    start: int
    n: int


class Scheduler:
    """The requests an engine holds, their units of each pool, and the calls of each step."""

    def __init__(self, m: mf.Manifest, max_context: int, *, use_decode_steps: bool = True,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 prefix_caching: bool | None = None, identity: str = ""):
        self.manifest = m
        self.max_context = max_context
        self.use_decode_steps = use_decode_steps
        self.use_mixed = True               # run decode rows and a prompt chunk in one call where an entry holds them
        self.scorer = m.scorer             # None: a prompt whose logprobs are asked is read a token a call
        self.block_size = m.block_size
        self.rules = {kind: pool_rule(m.pools_of(kind)[0], m.block_size) for kind in m.pool_kinds}
        self.pools = {kind: kv_cache.UnitPool(m.capacity(kind), *KIND_NAMES.get(kind, (str(kind), "units")))
                      for kind in m.pool_kinds}
        self._by_kind = {kind: sorted((e for e in m.entries if e.kind == kind), key=lambda e: e.size_key)
                         for kind in mf.EntryKind}
        self.max_decode_batch = max(e.batch for e in self._by_kind[mf.EntryKind.DECODE])
        self.max_num_seqs = max_num_seqs or self.max_decode_batch
        prefill = self._by_kind[mf.EntryKind.PREFILL]
        # A prompt read alone takes the longest chunk an entry holds; prompts read side by side take the longest
        # chunk of the entries of several rows, so that they share calls.
        self.chunk_cap = max(e.tokens_per_seq for e in prefill)
        self.shared_chunk_cap = max((e.tokens_per_seq for e in prefill if e.batch > 1), default=self.chunk_cap)
        self.max_num_batched_tokens = max_num_batched_tokens or max(e.positions for e in prefill) \
            + self.max_num_seqs
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} must be at least max_num_seqs "
                             f"{self.max_num_seqs} (every running sequence decodes a token a step)")
        self.prefix_caching = self._caching(prefix_caching)
        self.prefix = PrefixCache(self.pools, m.block_size, kv_cache.artifact_seed(identity),
                                  snapshots=bool(self._by_kind.get(mf.EntryKind.COPY_SLOTS))) \
            if self.prefix_caching else None
        self.watermark = max(1, self.pools[mf.PoolKind.PAGED_KV].num_units // 100) \
            if mf.PoolKind.PAGED_KV in self.pools else 0
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []          # sorted by Request.key
        self.running: list[Request] = []          # sorted by Request.key
        self.stats = dict(preemptions=0, prefix_queries=0, prefix_hits=0)

    def configure(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Change the limits between steps (the server's --max-num-seqs); the token budget grows to hold them."""
        if max_num_seqs is not None:
            if max_num_seqs < 1:
                raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
            self.max_num_seqs = max_num_seqs
        if max_num_batched_tokens is not None:
            self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_num_seqs)

    def _caching(self, asked: bool | None) -> bool:
        """Prefix caching, unless a pool's content cannot be reused exactly (refused by name when asked for)."""
        copies = bool(self._by_kind.get(mf.EntryKind.COPY_SLOTS))
        blocking = [p for p in self.manifest.pools if p.kind == mf.PoolKind.RING_KV
                    or (p.kind == mf.PoolKind.STATE_SLOTS and not copies)]
        if asked is False:
            return False
        if blocking:
            why = ", ".join(f"{p.name} ({p.kind}{'' if p.kind == mf.PoolKind.RING_KV else ', no copy_slots entry'})"
                            for p in blocking)
            if asked:
                raise ValueError(f"prefix caching cannot reuse pool {why} exactly: a later sequence would need what "
                                 f"the pool held at the end of the prefix; serve without prefix caching")
            log.info("prefix caching is off: pool %s cannot be reused exactly by a later sequence", why)
            return False
        return True

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
            for kind, pool in self.pools.items():
                need = self.rules[kind].units(prompt_len + max_new_tokens - 1)
                if need > pool.num_units:
                    size = "" if kind == mf.PoolKind.STATE_SLOTS else \
                        f" of {prompt_len} prompt tokens plus max_new_tokens {max_new_tokens}"
                    raise RequestRefused("exceeds_pool", f"a sequence{size} needs {need} {pool.name} {pool.unit}, and "
                                                         f"the pool holds {pool.num_units}: it could never run",
                                         pool=str(kind))

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
        self._release(s)

    # -- units -----------------------------------------------------------------------------------------

    def _grow(self, s: Request, end: int) -> bool:
        """Take what the sequence's positions up to `end` hold of each kind of pool; all or nothing."""
        got: dict[mf.PoolKind, list[int]] = {}
        for kind, pool in self.pools.items():
            need = self.rules[kind].units(end) - len(s.held[kind])
            if need > 0:
                units = pool.take(need)
                if units is None:
                    for k, us in got.items():
                        self.pools[k].release(us)
                    return False
                got[kind] = units
        for kind, units in got.items():
            s.held[kind].extend(units)
        return True

    def _release(self, s: Request) -> None:
        for kind, held in s.held.items():
            self.pools[kind].release(held[::-1])
            held.clear()
        s.cached_pages = 0

    def _admissible(self, s: Request, end: int) -> bool:
        """Whether a waiting sequence may start with positions up to `end`: every kind has the units, and while others
        run, `watermark` KV pages stay free for their next tokens (a new sequence should not cause a preemption at
        once)."""
        for kind, pool in self.pools.items():
            left = pool.free_units - max(0, self.rules[kind].units(end) - len(s.held[kind]))
            if left < 0 or (self.running and kind == mf.PoolKind.PAGED_KV and left < self.watermark):
                return False
        return True

    def _preempt(self, s: Request) -> None:
        """Send a running sequence back to the queue with its tokens so far; it gives back all it holds."""
        self.running.remove(s)
        s.running = False
        self._release(s)
        s.computed = s.junction = 0
        s.preemptions += 1
        if s.prompt_logprobs is not None and not s.generated:
            s.prompt_logprobs[1:] = []           # scored again as the prompt is read again
        bisect.insort(self.waiting, s, key=lambda r: r.key)
        self.stats["preemptions"] += 1
        log.info("preempted %s (%d tokens so far; %d free pages)", s.rid, s.length,
                 min(p.free_units for p in self.pools.values()))

    def written(self, s: Request, end: int) -> None:
        """A call wrote the sequence's positions up to `end` (its full pages join the prefix cache)."""
        s.computed = max(s.computed, end)
        if self.prefix is not None:
            self.prefix.written(s, end, end <= len(s.prompt))

    def snapshot_copies(self) -> list[Copy]:
        """The state snapshots this step's calls left to take (core/prefix_cache.py); commit them once copied."""
        return self.prefix.snapshot_copies() if self.prefix is not None else []

    def commit_copies(self, copies: list[Copy], ok: bool) -> None:
        if copies:
            self.prefix.commit(copies, ok)

    # -- the calls of a step -------------------------------------------------------------------------------

    def entries(self, kind: str) -> list[mf.Entry]:
        """The entries of `kind`, smallest first (by context, then batch)."""
        return self._by_kind[kind]

    def pick(self, kind: str, batch: int, context: int, tokens: int, total: int = 0) -> mf.Entry | None:
        """The smallest entry of `kind` that holds `batch` rows of `tokens` tokens reaching `context` positions
        (a packed prefill: `total` tokens in all)."""
        return next((e for e in self.entries(kind) if e.holds(batch, context, tokens, total)), None)

    def scored(self, s: Request) -> bool:
        """Whether the sequence's prompt logprobs come from the scoring prefill entries (the artifact has them,
        with as many top logprobs as the request asks) while it reads its prompt."""
        return (s.prompt_logprobs is not None and not s.generated and self.scorer is not None
                and s.sampling.prompt_logprobs <= self.scorer.top_logprobs)

    def _chunk(self, s: Request, budget: int, alone: bool = True) -> int:
        """How many of the sequence's positions from `computed` its next call writes (at most `budget`; at most the
        shared chunk unless it is the only sequence reading its prompt)."""
        start = s.computed
        cap = self.chunk_cap if alone else self.shared_chunk_cap
        if s.prompt_logprobs is not None and not s.generated and not self.scored(s):
            # Without scoring entries (or with fewer top logprobs than asked) prompt logprobs need the distribution
            # after every prompt token, and a plain entry returns the logits of each row's last token: such a
            # prompt is read one token a call.
            cap = 1
        for rule in self.rules.values():
            limit = rule.call_limit(start)
            if limit is not None:
                cap = min(cap, limit)
        n = min(s.length - start, cap, budget)
        if start < s.junction:
            n = min(n, s.junction - start)
        end = start + n
        if end < s.length and end % self.block_size and end - end % self.block_size > start:
            n = end - end % self.block_size - start     # a chunk that stops short ends on a page boundary
        return max(n, 0)

    def schedule(self) -> Step:
        """This step's calls: every running sequence advanced (preempting the youngest when pages run out), then
        waiting sequences admitted while there is budget, room and pages."""
        budget = self.max_num_batched_tokens
        work: list[_Work] = []
        preempted = False
        reading = sum(not s.decoding for s in self.running) + min(len(self.waiting),
                                                                   max(0, self.max_num_seqs - len(self.running)))
        alone = reading <= 1
        for s in list(self.running):
            if not s.running:
                continue                  # preempted earlier in this loop
            if s.decoding and s.constraint is not None and not s.constraint.ready():
                continue                  # its grammar is still working out its next mask: it sits this step out
            n = self._chunk(s, budget, alone)
            if n == 0:
                continue
            while not self._grow(s, s.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
            if s.running:
                work.append(_Work(s, s.computed, n))
                budget -= n
        restores: list[Copy] = []
        i = 0                             # waiting sequences before i wait for a prefix a running one computes
        while i < len(self.waiting) and not preempted and len(self.running) < self.max_num_seqs and budget > 0:
            s = self.waiting[i]
            hit = self._lookup(s)
            if hit is not None and self._prefix_in_flight(s, hit):
                self._unlookup(s, hit)
                i += 1
                continue
            n = self._chunk(s, budget, alone)
            if n == 0 or not self._admissible(s, s.computed + n) or not self._grow(s, s.computed + n):
                self._unlookup(s, hit)
                break
            self.waiting.pop(i)
            if hit is not None:
                self.stats["prefix_queries"] += s.length
                self.stats["prefix_hits"] += hit.length
                if hit.snapshot is not None:
                    restores.append(Copy(hit.snapshot, s.held[mf.PoolKind.STATE_SLOTS][0], seq=s))
            s.running = True
            bisect.insort(self.running, s, key=lambda r: r.key)
            work.append(_Work(s, s.computed, n))
            budget -= n
        return Step(restores, self._calls(work))

    def _lookup(self, s: Request):
        """A new (or preempted) sequence's prefix hit, its units held; it starts after it. None: no lookup (caching
        off, or its prompt logprobs are asked: every prompt position is computed)."""
        if self.prefix is None or s.computed or (s.prompt_logprobs is not None and not s.generated):
            return None
        hit = self.prefix.lookup(s)
        if hit.pages:
            s.held[mf.PoolKind.PAGED_KV] = list(hit.pages)
        s.computed = s.cached_pages = hit.length
        s.cached_pages = len(hit.pages)
        s.junction = hit.junction
        return hit

    def _unlookup(self, s: Request, hit) -> None:
        """Undo _lookup for a sequence that does not start this step."""
        if hit is not None:
            self.prefix.give_back(hit)
        for held in s.held.values():
            held.clear()
        s.computed = s.cached_pages = s.junction = 0

    def _prefix_in_flight(self, s: Request, hit) -> bool:
        """Whether the page after a waiting sequence's cached prefix is one a running sequence is computing now
        (the same tokens, in a prompt it is still reading): the waiting one starts once that page is cached rather
        than compute it too (requests that share a system prompt and arrive together compute it once)."""
        c = hit.length // self.block_size
        if c >= (s.length - 1) // self.block_size:
            return False                  # nothing more of its prompt could come from the cache
        h = s.hashes[c]
        return any(r.reading_prompt and r.computed < (c + 1) * self.block_size and len(r.hashes) > c
                   and r.hashes[c] == h for r in self.running)

    def _calls(self, work: list[_Work]) -> list[ScheduledCall]:
        steps = self._steps_call(work)
        if steps is not None:
            return [steps]
        scored = [w for w in work if self.scored(w.seq)]
        single = [w for w in work if w not in scored and w.n == 1]
        chunks = [w for w in work if w not in scored and w.n > 1]       # in scheduling order
        calls = self._group(scored, mf.EntryKind.PREFILL_SCORED)
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

    def _joined(self, single: list[_Work], chunks: list[_Work]) -> list[ScheduledCall] | None:
        """The chunks' packed prefill calls with every one-token row riding in them (a packed call computes a
        one-token row as one position); None without packed prefills, or when their rows cannot hold them all: the
        rows that ride would save no decode call, and attend with a chunk's query slots (bench/serving.py, 32
        clients with a shared prefix: 292 tok/s letting 8 - chunks of 32 decode rows ride, 333 tok/s without)."""
        rows = max((e.batch for e in self.entries(mf.EntryKind.PREFILL) if e.packed_tokens), default=0)
        if not (chunks and single and rows >= len(chunks) + len(single)):
            return None
        return self._group(sorted(chunks + single, key=lambda w: w.start + w.n), mf.EntryKind.PREFILL)

    def _apart(self, single: list[_Work], chunks: list[_Work]) -> list[ScheduledCall]:
        """The calls of prompt chunks (prefill entries, those that end near each other together) and one-token rows
        (decode entries)."""
        calls = self._group(sorted(chunks, key=lambda w: w.start + w.n), mf.EntryKind.PREFILL)
        for i in range(0, len(single), self.max_decode_batch):
            calls += self._group(single[i:i + self.max_decode_batch], mf.EntryKind.DECODE)
        return calls

    def _mixed_call(self, single: list[_Work], chunks: list[_Work]) -> ScheduledCall | None:
        """The decode rows (as many as the largest mixed entry holds) and the first prompt chunk in one mixed call,
        when the artifact has one that holds them (bench/mixed_step.py: the decode rows then cost next to
        nothing beside the chunk)."""
        mixed = self.entries(mf.EntryKind.MIXED)
        if not (mixed and self.use_mixed and single and chunks):
            return None
        rows = single[:max(e.batch for e in mixed)]
        chunk = chunks[0]
        entry = self.pick(mf.EntryKind.MIXED, len(rows), max(w.start + w.n for w in rows + [chunk]), chunk.n)
        if entry is None:
            return None
        work = rows + [chunk]
        return ScheduledCall(entry, tuple(w.seq for w in work),
                             tuple(row_call(w.seq.tokens[w.start:w.start + w.n], w.start, w.seq.held) for w in work))

    def unmix(self, call: ScheduledCall) -> list[ScheduledCall]:
        """A mixed call as the decode call and the prefill call it stands for."""
        work = [_Work(s, row.start, len(row.token_ids)) for s, row in zip(call.seqs, call.rows)]
        return self._group(work[:-1], mf.EntryKind.DECODE) + self._group(work[-1:], mf.EntryKind.PREFILL)

    def _group(self, work: list[_Work], kind: mf.EntryKind) -> list[ScheduledCall]:
        """The calls of entries of `kind` that run `work`: rows in order, as many a call as an entry holds."""
        calls: list[ScheduledCall] = []
        group: list[_Work] = []
        for w in work + [None]:
            if w is not None:
                trial = group + [w]
                if self.pick(kind, len(trial), max(x.start + x.n for x in trial), max(x.n for x in trial),
                             sum(x.n for x in trial)):
                    group = trial
                    continue
            if group:
                entry = self.pick(kind, len(group), max(x.start + x.n for x in group), max(x.n for x in group),
                                  sum(x.n for x in group))
                if entry is None:
                    raise RuntimeError(f"no {kind} entry holds a row of {group[0].n} tokens reaching position "
                                       f"{group[0].start + group[0].n}")
                rows = tuple(row_call(x.seq.tokens[x.start:x.start + x.n], x.start, x.seq.held) for x in group)
                calls.append(ScheduledCall(entry, tuple(x.seq for x in group), rows))
            group = [w] if w is not None else []
        return calls

    def _multi_step_ok(self, s: Request) -> bool:
        """Whether a decoding sequence's next tokens may come from one decode_steps call: nothing the host decides
        between its tokens. Single steps keep a grammar or other constraint, a stop id masked until min_tokens,
        penalties (the history grows each step), logprobs, stop strings (single_step), more stop ids than the
        entry's STOP_IDS slots, and (an artifact without a sampler) any request that is not plain greedy."""
        sp = s.sampling
        return (s.constraint is None and not s.single_step and sp.logprobs is None and not sp.penalized
                and not (s.stop and len(s.generated) < sp.min_tokens)
                and (self.manifest.sampler is not None or sp.plain))

    def stop_ids(self, s: Request) -> list[int]:
        """The stop ids a token can be (those inside the vocabulary), sorted."""
        return s.stop_ids(self.manifest.model.vocab)

    def _steps_call(self, work: list[_Work]) -> ScheduledCall | None:
        """One decode_steps call for every running sequence when all are decoding, none waits and the pages for
        their next tokens are free; else None. Each row may produce up to K tokens, at most its remaining
        max_new_tokens."""
        multi = self.entries(mf.EntryKind.DECODE_STEPS)
        if not (multi and self.use_decode_steps) or self.waiting or not work:
            return None
        if len(work) != len(self.running) or not all(w.seq.decoding and w.n == 1 and self._multi_step_ok(w.seq)
                                                     for w in work):
            return None
        e0 = multi[0]
        stop_slots = e0.inputs[e0.input_index(mf.Role.STOP_IDS)].shape[1]
        if any(len(self.stop_ids(w.seq)) > stop_slots for w in work):
            return None
        limits = tuple(min(e0.steps, w.seq.max_new_tokens - len(w.seq.generated)) for w in work)
        entry = self.pick(mf.EntryKind.DECODE_STEPS, len(work), max(w.start + n for w, n in zip(work, limits)), 1)
        if entry is None or min(limits) < 1:
            return None
        taken = []
        for w, n in zip(work, limits):
            before = {kind: len(units) for kind, units in w.seq.held.items()}
            if not self._grow(w.seq, w.start + n):
                for s, counts in taken:         # give back what the longer call took; single steps run instead
                    for kind, count in counts.items():
                        extra = s.held[kind][count:]
                        del s.held[kind][count:]
                        self.pools[kind].release(extra[::-1])
                return None
            taken.append((w.seq, before))
        rows = tuple(row_call([w.seq.generated[-1]], w.start, w.seq.held) for w in work)
        return ScheduledCall(entry, tuple(w.seq for w in work), rows, limits)

    # -- reading -------------------------------------------------------------------------------------------

    def usage(self) -> float:
        """The fraction of the first pool kind's units held by sequences (vllm:kv_cache_usage_perc)."""
        pool = self.pools[self.manifest.pool_kinds[0]]
        return pool.in_use / pool.num_units
