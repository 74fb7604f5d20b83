"""vLLM's worker for a tlaloc artifact: vLLM keeps its scheduler, block manager, tokenizer and detokenizer; each
scheduler step becomes calls of the artifact's prefill and decode entries. No torch model is ever built.

The KV cache vLLM's block manager allocates is the artifact's paged pool, on the device through the runtime: the
worker reports one full-attention layer per pool layer with the pool's page shape, vLLM is told the pool's page
count (`num_gpu_blocks_override`, set by the platform), and vLLM's block ids are used as page ids.

A step's `SchedulerOutput` names, per request, how many tokens to compute from its `num_computed_tokens` on: a
prompt's chunk (chunked prefill as vLLM schedules it, prefix-cache hits skipped), one decode token, or a resumed
request's recomputation. Each request's part is cut into pieces the artifact's entries hold (at most its prefill
chunk), and the pieces of every request run in rounds: round k runs the k-th piece of each, one-token pieces on the
decode entries and longer ones on the prefill entries, as many rows a call as the smallest entry that holds them
(rows right-aligned, as the entries expect). The row that reaches the end of a request's known tokens gives its
next token (token_choice.py says where it is chosen); earlier chunks give none, as in vLLM's own runner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from tlaloc_jax import artifact as af

from ...engine import DEFAULT_CACHE_DIR
from ...lora_slots import Adapter, LoraError
from .config import TORCH_DTYPES
from .platform import ArtifactRefused
from .runtime import ArtifactRuntime, Row
from .side_pools import SidePools
from .token_choice import HostRow, HostSampler, allowed_words, body_sampling, logprobs_lists, request_seed

log = logging.getLogger("tlaloc_jax.serve.vllm")


@dataclass
class _Request:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    pages: list[int]                 # vLLM's block ids of the KV cache group: the pool's pages, in position order
    computed: int                    # vLLM's num_computed_tokens
    body: object                     # the in-body Sampling, or None: vLLM's sampler chooses (token_choice.py)
    seed: int
    generator: torch.Generator | None
    lora: Adapter | None = None      # its vLLM LoRARequest's adapter as read (kept if the adapter is removed)
    output: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class _Piece:
    req: _Request
    start: int
    token_ids: list[int]
    produces: bool                   # reaches the end of the request's known tokens: its next token is wanted


class ArtifactWorker(WorkerBase):
    """The worker vLLM's executor drives (parallel_config.worker_cls, set by TlalocPlatform)."""

    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.runtime: ArtifactRuntime | None = None
        self.requests: dict[str, _Request] = {}
        self._scheduled = None
        self._host_sampler: HostSampler | None = None
        self._loras: dict[int, str] = {}      # vLLM's lora_int_id -> its name in ArtifactRuntime.lora
        # Plugin options ride in vLLM's --additional-config '{"tlaloc": {...}}': the PJRT plugin and the
        # compiled-executable cache ("none" disables it).
        self.options = dict((vllm_config.additional_config or {}).get("tlaloc", {}))
        # What the steps did (tlaloc_stats): calls per entry kind, rows per call, requests resumed after a
        # preemption, prompt tokens vLLM's prefix cache spared, tokens chosen in the body or by vLLM's sampler.
        self.stats = dict(steps=0, calls={}, rows_per_call={}, resumed=0, prefix_hit_tokens=0, split_requests=0,
                          body_sampled=0, host_sampled=0)

    # -- start-up --------------------------------------------------------------------------------

    def init_device(self) -> None:
        self.device = torch.device("cpu")

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ArtifactRefused("--load-format dummy: an artifact's weights are its own")
        cache = self.options.get("cache_dir", str(DEFAULT_CACHE_DIR))
        lora = self.vllm_config.lora_config
        self.runtime = ArtifactRuntime(self.model_config.hf_config.artifact_dir, plugin=self.options.get("plugin"),
                                       cache_dir=None if cache == "none" else Path(cache).expanduser(),
                                       max_cpu_loras=lora.max_cpu_loras or 0 if lora else 0)
        self._host_sampler = HostSampler(self.vllm_config)
        self.side = SidePools(self.runtime.manifest)
        log.info("tlaloc artifact %s loaded in %.1f s (%s sampler)", self.model_config.hf_config.artifact_dir,
                 self.runtime.load_seconds, "in-body" if self.runtime.sampler else "no in-body")

    def _pool(self) -> af.Pool:
        return self.runtime.manifest.pools_of(af.PoolKind.PAGED_KV)[0]

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One full-attention layer per layer of the paged pool ([L, 2, P, S, K, D]), pages of S positions."""
        pool = self._pool()
        layers, _, _, block, kv_heads, head_dim = pool.shape
        spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads, head_size=head_dim,
                                 dtype=TORCH_DTYPES[pool.dtype])
        return {f"tlaloc.{pool.name}.{i}": spec for i in range(layers)}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]             # the pool's own layout; vLLM's kernels never read it

    def determine_available_memory(self) -> int:
        """The pool's bytes: vLLM's block manager is to hand out exactly its pages."""
        return self._pool().nbytes

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        pages = self.runtime.capacity(af.PoolKind.PAGED_KV)
        if kv_cache_config.num_blocks != pages:
            raise ArtifactRefused(f"vLLM planned {kv_cache_config.num_blocks} KV blocks; the artifact's pool holds "
                                  f"{pages} pages")

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)   # compiled when loaded (load_model)

    def get_supported_tasks(self):
        return ("generate",)

    def get_model(self):
        raise RuntimeError("a tlaloc artifact has no torch model: its worker runs the artifact's entries")

    def get_cache_block_size_bytes(self) -> int:
        pool = self._pool()
        return pool.nbytes // pool.capacity

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    # -- LoRA: vLLM's adapters (lora_int_id) served from the artifact's slots (ArtifactRuntime.lora) -----------

    def add_lora(self, lora_request) -> bool:
        """Read and check the PEFT adapter at lora_request.lora_path (refused by name if the slots cannot hold it)."""
        self._adapter(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Stop serving adapter `lora_id`; a request that runs with it keeps it until it ends."""
        name = self._loras.pop(lora_id, None)
        if name is not None:
            self.runtime.lora.remove(name)
        return name is not None

    def pin_lora(self, lora_id: int) -> bool:
        # A served adapter stays loadable until removed; each step writes its own adapters into the slots.
        return lora_id in self._loras

    def list_loras(self) -> set[int]:
        return set(self._loras)

    def _adapter(self, lora_request) -> str:
        """The name adapter lora_request.lora_int_id is served under, read from its path the first time (again with
        load_inplace; requests running with the old one keep it)."""
        if getattr(lora_request, "load_inplace", False):
            self.remove_lora(lora_request.lora_int_id)
        name = self._loras.get(lora_request.lora_int_id)
        if name is None:
            if self.runtime.lora is None:
                raise ArtifactRefused("LoRA adapters: the artifact has no adapter slots; export it with --max-loras")
            name = f"{lora_request.lora_name} (id {lora_request.lora_int_id})"
            try:
                self.runtime.lora.add(name, lora_request.lora_path)
            except LoraError as e:
                raise ArtifactRefused(str(e)) from None
            self._loras[lora_request.lora_int_id] = name
        return name

    def _take_slots(self, rids) -> dict[str, int]:
        """Each scheduled request's adapter slot (requests without one: none). vLLM schedules at most --max-loras
        adapters a step, which the platform held to the artifact's slots, so every one finds a slot."""
        slots = {}
        for rid in rids:
            adapter = self.requests[rid].lora
            if adapter is not None:
                slot = self.runtime.lora.acquire(adapter)
                if slot is None:
                    self._give_slots(slots)
                    raise RuntimeError(f"request {rid}: no adapter slot is free for {adapter.name} (the artifact "
                                       f"has {self.runtime.lora.shape.max_loras})")
                slots[rid] = slot
        return slots

    def _give_slots(self, slots: dict[str, int]) -> None:
        for slot in slots.values():
            self.runtime.lora.release(slot)

    def tlaloc_stats(self) -> dict:
        """The worker's counters (vLLM's `collective_rpc("tlaloc_stats")` reads them)."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self.stats.items()}

    def take_draft_token_ids(self):
        return None

    def execute_dummy_batch(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    # -- steps -----------------------------------------------------------------------------------

    def execute_model(self, scheduler_output):
        """Take in the step's request changes; the calls run in sample_tokens, once vLLM's grammar bitmask (the
        structured-output requests' allowed tokens) is known, since the entries sample in the same call."""
        self._update_requests(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self._scheduled = scheduler_output
        return None

    def _update_requests(self, so) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.side.give_back(rid)
        for rid in so.preempted_req_ids or ():
            self.side.give_back(rid)                         # its ring and state are computed again on resumption
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            if new.prompt_token_ids is None or sp is None:
                raise ArtifactRefused(f"request {new.req_id}: a tlaloc artifact takes token ids and sampling "
                                      "parameters (no prompt embeddings, no pooling)")
            generator = None
            if sp.seed is not None:
                generator = torch.Generator().manual_seed(sp.seed)
            self.stats["prefix_hit_tokens"] += new.num_computed_tokens
            lora = new.lora_request if new.lora_request and new.lora_request.lora_int_id > 0 else None
            self.requests[new.req_id] = _Request(
                new.req_id, list(new.prompt_token_ids), sp, list(new.block_ids[0]), new.num_computed_tokens,
                body_sampling(sp, self.runtime.sampler), request_seed(sp), generator,
                self.runtime.lora.adapter(self._adapter(lora)) if lora else None)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            r = self.requests[rid]
            r.computed = cached.num_computed_tokens[i]
            del r.output[cached.num_output_tokens[i]:]      # tokens vLLM discarded
            blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                r.pages = list(blocks[0])                    # preempted and resumed: all its pages are new
                self.side.give_back(rid)
                self.stats["resumed"] += 1
            elif blocks is not None:
                r.pages.extend(blocks[0])

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        so, self._scheduled = self._scheduled, None
        grammar = {}
        if grammar_output is not None:
            grammar = dict(zip(grammar_output.structured_output_request_ids, grammar_output.grammar_bitmask))
        order = list(so.num_scheduled_tokens)
        rounds: list[list[_Piece]] = []
        self.stats["steps"] += 1
        for rid in order:
            self.side.take(rid)
            pieces = self._pieces(self.requests[rid], so.num_scheduled_tokens[rid])
            self.stats["split_requests"] += len(pieces) > 1
            for k, piece in enumerate(pieces):
                if k == len(rounds):
                    rounds.append([])
                rounds[k].append(piece)
        chosen: dict[str, int] = {}
        logits_of: dict[str, np.ndarray] = {}
        slots = self._take_slots(order)
        try:
            for pieces in rounds:
                for kind in (af.EntryKind.DECODE, af.EntryKind.PREFILL):
                    group = [p for p in pieces if (len(p.token_ids) == 1) == (kind == af.EntryKind.DECODE)]
                    for entry, calls in self._calls(group, kind):
                        self._run(entry, calls, grammar, chosen, logits_of, slots)
        finally:
            self._give_slots(slots)
        index = {rid: i for i, rid in enumerate(order)}
        sampled = [[chosen[rid]] if rid in chosen else [] for rid in order]
        for rid, tok in chosen.items():
            self.requests[rid].output.append(tok)
        logprobs = None
        asked = [self.requests[rid].params.logprobs for rid in logits_of]
        if asked:
            vocab = self.runtime.vocab
            width = max(vocab if k == -1 else k for k in asked)
            logprobs = logprobs_lists({index[rid]: x for rid, x in logits_of.items()},
                                      {index[rid]: chosen[rid] for rid in logits_of}, width, len(order))
        return ModelRunnerOutput(req_ids=order, req_id_to_index=index, sampled_token_ids=sampled, logprobs=logprobs)

    def _pieces(self, r: _Request, n: int) -> list[_Piece]:
        """A request's scheduled tokens as pieces the entries hold (at most the prefill chunk each, and no more
        than a ring lets one call write)."""
        tokens = r.tokens
        start, end = r.computed, r.computed + n
        if end > len(tokens):
            raise RuntimeError(f"request {r.req_id}: {n} tokens scheduled from {start}, but it has {len(tokens)}")
        cap = self.runtime.manifest.buckets.prefill_chunk or max(self.runtime.manifest.buckets.context_ladder)
        out, s = [], start
        while s < end:
            e = min(s + min(cap, self.side.call_limit(s) or cap), end)
            out.append(_Piece(r, s, tokens[s:e], e == end == len(tokens)))
            s = e
        return out

    def _calls(self, pieces: list[_Piece], kind: af.EntryKind):
        """(entry, pieces) per call: pieces in order, as many a call as the smallest entry of `kind` holds."""
        group: list[_Piece] = []

        def fits(g):
            return self.runtime.pick(kind, len(g), max(p.start + len(p.token_ids) for p in g),
                                     max(len(p.token_ids) for p in g), sum(len(p.token_ids) for p in g))

        for p in pieces + [None]:
            if p is not None and fits(group + [p]):
                group.append(p)
                continue
            if group:
                yield fits(group), group
            if p is not None:
                if not fits([p]):
                    raise RuntimeError(f"request {p.req.req_id}: no {kind} entry holds {len(p.token_ids)} tokens "
                                       f"from position {p.start}")
                group = [p]

    def _run(self, entry: af.Entry, pieces: list[_Piece], grammar: dict, chosen: dict, logits_of: dict,
             slots: dict[str, int]) -> None:
        """One call, each row in its request's adapter slot (`slots`); the producing rows' tokens go to `chosen`,
        their logits (when wanted) to `logits_of`."""
        rt = self.runtime
        words = af.mask_words(rt.vocab)
        rows, host, masks = [], [], {}
        for b, p in enumerate(pieces):
            r = p.req
            body = r.body if p.produces else None
            if p.produces:
                masks[b] = allowed_words(r.params, len(r.output), rt.vocab, words, grammar.get(r.req_id))
                if r.body is None or (masks[b] is not None and rt.sampler is None):
                    host.append(b)
                    body = None
            rows.append(Row(p.token_ids, p.start, r.pages, self.side.state_slot(r.req_id), self.side.ring(r.req_id),
                            sampling=body, seed=r.seed, prompt=r.prompt,
                            generated=r.output, mask=masks.get(b) if body is not None else None,
                            lora_slot=slots.get(r.req_id, 0)))
        want_logits = bool(host) or any(p.produces and p.req.params.logprobs is not None for p in pieces)
        out = rt.run(entry, rows, logits=want_logits)
        calls, sizes = self.stats["calls"], self.stats["rows_per_call"]
        calls[str(entry.kind)] = calls.get(str(entry.kind), 0) + 1
        sizes[len(rows)] = sizes.get(len(rows), 0) + 1
        self.stats["host_sampled"] += len(host)
        self.stats["body_sampled"] += sum(r.sampling is not None for r in rows)
        if host:
            hrows = [HostRow(pieces[b].req.params, pieces[b].req.prompt, pieces[b].req.output,
                             pieces[b].req.generator, masks[b]) for b in host]
            for b, tok in zip(host, self._host_sampler.sample(out.logits[host], hrows)):
                out.tokens[b] = tok
        for b, p in enumerate(pieces):
            if p.produces:
                chosen[p.req.req_id] = int(out.tokens[b])
                if p.req.params.logprobs is not None:
                    logits_of[p.req.req_id] = out.logits[b]
