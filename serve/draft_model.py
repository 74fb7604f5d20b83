"""A draft model for speculative decoding (vLLM's method "draft_model"): a second artifact, run by the same engine on
the same device, proposes k greedy tokens for each drafting sequence, the step's sequences in one batch.

As vLLM's draft-model proposer does, the draft keeps KV pages of its own for each sequence (its own KV-cache manager
over its own pools). Each step it first reads the tokens of the sequence it has not seen (the whole prompt the first
time; then the drafts the target accepted and the target's own token after them) and takes its greedy token after
the last of them, then runs k - 1 decode steps on its own drafts, every sequence of the step in the same calls. The
positions it holds valid are the longest common prefix of what it read and the sequence's tokens now: what the
target rejected is written again later. A sequence that finishes or is preempted gives the draft's pages back.

Sampled rows stay exact: the draft is greedy, so its proposal is a function of the sequence, one-hot (q(d) = 1),
which is what the verify body's rejection sampler takes every draft to be (kernels/rejection_sampler.py).

A draft is refused at start, by name: a missing artifact, another vocabulary or tokenizer than the target's, state
pools (a recurrent state cannot drop a rejected draft's update here) and windowed rings of pages.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from tlaloc_jax import artifact as af

from .core import inputs as call_inputs
from .core.call_plan import CallPlanner, Work
from .core.kv_cache_manager import KVCacheManager
from .core.request import Request
from .host_sampling import GREEDY
from .runtime.pjrt import Device
from .runtime.runner import Runner
from .speculative import NgramProposer, Proposer, SpeculativeConfig, SpeculativeConfigError

log = logging.getLogger("tlaloc_jax.serve")


def read_draft(config: SpeculativeConfig | None, target: af.Manifest, cache_dir, trust_weights: bool) \
        -> af.Manifest | None:
    """The draft artifact's manifest (None without method "draft_model"), checked against the target's: refused by
    name when missing, of another vocabulary or tokenizer, with state pools or a ring of windowed pages."""
    if config is None or config.method != "draft_model":
        return None
    path = Path(config.model).expanduser()
    if not (path / af.MANIFEST_NAME).is_file():
        raise SpeculativeConfigError(f"speculative_config model: {str(path)!r} is not a tlaloc artifact (no "
                                     f"{af.MANIFEST_NAME}); give the directory python -m tlaloc_jax.export wrote for "
                                     "the draft model")
    m = af.load_remembering(af.load_manifest, path, cache_dir, verify_weights=not trust_weights)
    kinds = [p.name for p in m.pools if p.kind in (af.PoolKind.STATE_SLOTS, af.PoolKind.RING_KV)]
    if kinds:
        raise SpeculativeConfigError(f"speculative_config model: the draft {str(path)!r} has pools {kinds} (recurrent "
                                     "state or a windowed ring), which cannot roll back a rejected draft here; use a "
                                     "draft of full-attention layers only")
    if m.model.vocab != target.model.vocab:
        raise SpeculativeConfigError(f"speculative_config model: the draft's vocabulary has {m.model.vocab} tokens, "
                                     f"the target's {target.model.vocab}; a draft must share the target's tokenizer "
                                     "and vocabulary")
    # The file that maps text to ids; the others (chat template, generation defaults) may differ between models.
    mine = {t.file: t.sha256 for t in m.tokenizer_files if t.file == "tokenizer.json"}
    theirs = {t.file: t.sha256 for t in target.tokenizer_files if t.file == "tokenizer.json"}
    if mine != theirs:
        differ = sorted(f for f in set(mine) | set(theirs) if mine.get(f) != theirs.get(f))
        raise SpeculativeConfigError(f"speculative_config model: the draft's tokenizer differs from the target's "
                                     f"(files {differ}); a draft must share the target's tokenizer and vocabulary")
    return m


def proposer_for(config: SpeculativeConfig | None, draft: af.Manifest | None, device: Device, progress: bool,
                 donate: bool) -> Proposer | None:
    """The proposer of an engine's speculative config: the draft model on the engine's device (which the engine
    closes), or n-gram lookup; None without speculation or with an MTP head."""
    if config is None or config.method == "mtp":
        return None                 # MTP: the engine sets serve/mtp_proposer.py's once its model runner exists
    if draft is None:
        return NgramProposer(config)
    return DraftModelProposer(config.model, draft, device, progress=progress, donate=donate)


def seen_prefix(read: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading positions of what the draft read are still the sequence's tokens."""
    n = min(len(read), len(tokens))
    for i in range(n):
        if read[i] != tokens[i]:
            return i
    return n


class DraftModelProposer:
    """A draft artifact on the target's device, proposing greedy drafts for many sequences at once (a Proposer)."""

    def __init__(self, path: str | Path, m: af.Manifest, device: Device, *, progress: bool = False,
                 donate: bool = True):
        self.manifest = m
        self.runner = Runner(Path(path).expanduser(), m, device, progress=progress, donate=donate)
        self.kv = KVCacheManager(m, prefix_caching=False)
        self.planner = CallPlanner(m, self.kv, use_decode_steps=False)
        self.max_context = max(m.buckets.context_ladder)
        self.chunk = max(e.tokens_per_seq for e in self.planner.entries(af.EntryKind.PREFILL))
        self.token_role = af.Role.SAMPLED_TOKEN if m.sampler is not None else af.Role.NEXT_TOKEN
        self.seqs: dict[str, Request] = {}     # per target sequence, the draft's own: its tokens read and pages
        self.stats = dict(calls=0, rows=0, failures=0)

    def _own(self, s: Request) -> Request:
        d = self.seqs.get(s.rid)
        if d is None:
            d = Request(s.rid, [], 1, frozenset(), GREEDY, None, {kind: [] for kind in self.manifest.pool_kinds}, 0.0)
            self.seqs[s.rid] = d
        return d

    def release(self, s: Request) -> None:
        d = self.seqs.pop(s.rid, None)
        if d is not None:
            self.kv.free(d)

    def propose(self, rows: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Up to k greedy drafts per row; none for a row whose draft positions pass the draft's largest context or
        find no free page, and none at all when a draft call fails (the target decodes on, as without drafts)."""
        drafts: list[list[int]] = [[] for _ in rows]
        live: list[tuple[int, Request, int]] = []
        for i, (s, k) in enumerate(rows):
            tokens = s.tokens
            # The draft writes positions up to len(tokens) + k - 2.
            k = min(k, self.max_context - len(tokens) + 1)
            if k < 1:
                continue
            d = self._own(s)
            d.computed = min(seen_prefix(d.prompt[:d.computed], tokens), len(tokens) - 1)
            d.prompt = list(tokens)
            live.append((i, d, k))
        try:
            self._catch_up(live, drafts)
            for step in range(1, max((k for _, _, k in live), default=0)):
                more = [(i, d) for i, d, k in live if len(drafts[i]) == step < k]
                for i, d in more:
                    d.prompt.append(drafts[i][-1])
                self._run([(i, Work(d, d.computed, 1)) for i, d in more if self._take(d, d.computed + 1)], drafts)
        except Exception as err:   # noqa: BLE001 - the target decodes without drafts; the draft starts afresh
            log.error("the draft model failed: %s", err)
            self.stats["failures"] += 1
            for d in list(self.seqs.values()):
                self.kv.free(d)
            self.seqs.clear()
            return [[] for _ in rows]
        return drafts

    def _take(self, d: Request, end: int) -> bool:
        """The draft's pages for its positions up to `end`; without them it gives back all it holds (it reads the
        sequence afresh next time)."""
        if self.kv.allocate_slots(d, end):
            return True
        self.kv.free(d)
        d.computed = 0
        return False

    def _catch_up(self, live: list[tuple[int, Request, int]], drafts: list[list[int]]) -> None:
        """Read each row's unseen tokens, a chunk a call, until each has its first draft. A row that finds no free
        page gives back its own and drafts nothing this step: retried at once, rows would take each other's freed
        pages in turn and never finish."""
        out_of_pages: set[int] = set()
        while True:
            work = []
            for i, d, _ in live:
                if not drafts[i] and d.computed < d.length and i not in out_of_pages:
                    limit = self.kv.call_limit(d.computed)
                    n = min(d.length - d.computed, self.chunk, limit if limit is not None else self.chunk)
                    if self._take(d, d.computed + n):
                        work.append((i, Work(d, d.computed, n)))
                    else:
                        out_of_pages.add(i)
            if not work:
                return
            self._run(work, drafts)

    def _run(self, work: list[tuple[int, Work]], drafts: list[list[int]]) -> None:
        """Run the rows' calls; a row that writes its sequence's last token appends its greedy token to its drafts."""
        if not work:
            return
        index = {id(w.seq): i for i, w in work}
        for call in self.planner.plan([w for _, w in work], False):
            e = call.entry
            inputs = call_inputs.step_inputs(call, self.manifest, 0)
            for sig in e.inputs:          # greedy: every sampler input at its neutral value
                if sig.role in af.SAMPLER_INPUTS:
                    inputs[sig.role] = self.runner.neutral_buffer(e, sig.role)
            out = self.runner.run(e, inputs, {self.token_role})[self.token_role]
            self.stats["calls"] += 1
            self.stats["rows"] += len(call.seqs)
            for b, d, row in zip(call.out_rows, call.seqs, call.rows):
                d.computed = row.start + len(row.token_ids)
                if d.computed == d.length:
                    drafts[index[id(d)]].append(int(np.asarray(out[b]).reshape(-1)[0]))
