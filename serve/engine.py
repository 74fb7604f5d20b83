"""The JAX-free engine: load an artifact, keep weights and KV pools on the device, batch sequences.

    engine = Engine.load("artifact/")                  # validate, compile (disk cache), upload
    engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)

or, driving the loop yourself (what the HTTP server does):

    rid = engine.add_request([1, 2, 3], max_new_tokens=16)
    while engine.has_unfinished():
        for event in engine.step(): ...

The engine is a façade over three jobs: `core.scheduler` (which sequences a step advances, what each holds of
the pools), `model_runner` (a step's calls run and their tokens emitted) and `runtime.Runner` (the artifact's
entries, weights and pools on the device). New requests join between steps.

The invariant, per request: whatever one request does (bad sampling parameters, a refused admission, a
failure while its token is sampled, an exception anywhere on its path), the pages it holds are released, it
alone fails, and every other sequence's ids are those of its solo run.
  - Admission checks everything (prompt, lengths, stop ids, sampling, could-ever-fit) before the request is
    queued; it takes no page until it is scheduled, so a refused request leaves the pools as they were.
  - In a step, a failure sampling one sequence's token ends that sequence (finish_reason "error", a
    StepEvent naming the cause, its pages freed); the other sequences of the call keep their tokens.
  - A call that fails as a whole (building its inputs, or the execution) ends the sequences it held:
    they shared the failed call. Nothing else changes, and the engine keeps serving.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from tlaloc_jax import artifact as af

from .core import inputs as call_inputs
from .core.call_plan import covering
from .core.request import (Constraint, Request, RequestRefused, StepEvent, check_cache_salt, check_sampler_fits,
                           check_sampling, check_stop)
from .core.scheduler import Scheduler
from .draft_model import proposer_for, read_draft
from .host_sampling import Sampling
from .lora_slots import LoraError, LoraSlots
from .model_runner import ModelRunner, new_stats
from .runtime import host_memory
from .runtime.native_log import native_stderr_to_log
from .runtime.pjrt import Device, TooFewDevicesError
from .runtime.runner import Runner
from .runtime.sharded import device_count_mismatch
from .mtp_proposer import MtpProposer
from .speculative import SpeculativeConfig, check_fits, parse_speculative_config

__all__ = ["Constraint", "DEFAULT_CACHE_DIR", "Engine", "RequestRefused", "StepEvent"]

log = logging.getLogger("tlaloc_jax.serve")

DEFAULT_CACHE_DIR = Path("~/.cache/tlaloc-jax/executables")


class Engine:
    """Serve one artifact on one PJRT device. Not thread-safe: one thread drives `step()` (Runner.driving refuses a
    second one that runs entries while the first does)."""

    def __init__(self, artifact_dir: str | Path, plugin: str | None = None, *,
                 cache_dir: str | Path | None = DEFAULT_CACHE_DIR, memory_fraction: float = 0.75,
                 donate: bool = True, progress: bool = True, trust_weights: bool = False, preload: bool = False,
                 manifest: af.Manifest | None = None, max_model_len: int | None = None,
                 use_decode_steps: bool = True, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool | None = None,
                 lora_modules: dict | None = None, max_cpu_loras: int | None = None,
                 speculative_config: dict | str | SpeculativeConfig | None = None, map_weights: bool = False,
                 compile_processes: int | None = None):
        """Load an artifact: validate it all (files, hashes, every body's @main against its entry, the memory its
        weights and pools need), then compile one entry of each kind (the others compile, or load from the compile
        cache, on first use: Runner._compile_kinds), upload the weights and allocate the pools. A bad artifact is
        refused (ManifestError naming what is wrong) before anything is compiled or allocated.

        trust_weights: skip hashing the weight files (sizes still checked), for large artifacts known good; logged.
        manifest: this artifact's manifest as `af.load_manifest` returned it, when the caller has validated it
        already (the server does, to read the tokenizer before anything compiles): it is not read again.
        max_model_len: the longest sequence (prompt plus new tokens) served, at most the artifact's largest
        context (default: that context).
        use_decode_steps: run the artifact's decode_steps entries when every sequence is decoding (the attribute
        of that name may be changed between steps; False serves with single decode steps only).
        max_num_seqs: the most sequences running at once (default: the artifact's largest decode batch); more wait.
        max_num_batched_tokens: the tokens one step computes at most, decode tokens first, then prompt chunks
        (default: the longest prefill chunk times the largest prefill batch, plus max_num_seqs).
        enable_prefix_caching: reuse the pages of a prefix computed before (default: on where every pool can be
        reused exactly; True where one cannot is refused by name).
        lora_modules: {name: PEFT adapter directory, or {"path": ..., "base_model_name": ...}} served on an artifact
        staged with adapter slots (--max-loras); a request picks one by name (add_request's lora). max_cpu_loras:
        adapters kept read in host memory beyond the slots (default: as many as the slots).
        speculative_config: vLLM's speculative config (a dict, its JSON, or a SpeculativeConfig), checked in the
        artifact's verify entries (export --speculative-tokens; sampled requests where they take the sampler, grammar
        rows where they take a mask per position): up to k drafts a step by {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_min": ..., "prompt_lookup_max": ...} (prompt lookup), by
        "draft_model" with "model" (an artifact of the same vocabulary and tokenizer), by "mtp" (or "deepseek_mtp",
        "qwen3_next_mtp": its MTP head); "disable_by_batch_size": n, none while n or more sequences run. None: off.
        map_weights: serve the weights from their files' mappings, not read into huge-page memory (a load without fresh
        memory; 4 KiB pages in every step). preload: every entry loads in the background now (Runner's preload), those
        in neither compile cache compiled meanwhile by `compile_processes` worker processes (default one a core); those
        that hold every call (call_plan.covering) first, which a server waits for, the others while it serves."""
        t0 = time.perf_counter()
        self.artifact_dir = Path(artifact_dir)
        if isinstance(cache_dir, str) and cache_dir.lower() == "none":
            cache_dir = None            # the CLI's spelling of no cache
        if manifest is None:
            # Refuses a bad artifact before anything runs. A file unchanged since a load before is not hashed
            # again: its digest is kept in the cache directory (FileDigests).
            manifest = af.load_remembering(af.load_manifest, self.artifact_dir, cache_dir,
                                           verify_weights=not trust_weights)
        self.manifest = m = manifest
        if trust_weights:
            log.warning("--trust-weights: the weight files of %s are not hashed", self.artifact_dir)
        elif any(not w.sha256 and not w.shards for w in m.weights):
            log.warning("%s (%s) carries no hashes of its weight and tokenizer files: they are not verified",
                        self.artifact_dir, m.schema)
        max_context = max(m.buckets.context_ladder)
        if max_model_len is not None:
            if not isinstance(max_model_len, int) or not 0 < max_model_len <= max_context:
                raise ValueError(f"max_model_len {max_model_len!r} must be a positive integer at most the artifact's "
                                 f"largest context ({max_context})")
            max_context = max_model_len
        self.speculative_config = parse_speculative_config(speculative_config)
        check_fits(self.speculative_config, m)
        draft = read_draft(self.speculative_config, m, cache_dir, trust_weights)     # None: no draft model
        self.scheduler = Scheduler(m, max_context, use_decode_steps=use_decode_steps, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   prefix_caching=enable_prefix_caching, identity=m.identity)
        self.scheduler.speculative = self.speculative_config
        try:
            with native_stderr_to_log():    # the plugin's start-up lines go to the log, not into a notebook
                device = Device(plugin, memory_fraction=memory_fraction, cache_dir=cache_dir, devices=m.devices)
        except TooFewDevicesError as e:
            raise af.ManifestError(device_count_mismatch(m, e.available)) from None
        self.runner = Runner(self.artifact_dir, m, device, progress=progress, donate=donate,
                             weight_arena=not map_weights, preload=preload, compile_processes=compile_processes,
                             ready_first=[e.name for e in covering(m.entries)])
        if preload:     # calls take loaded entries while the others load (CallPlanner.pick)
            self.scheduler.planner.loaded, self.scheduler.planner.hurry = self.runner.loaded, self.runner.hurry
        self.scheduler.proposer = proposer_for(self.speculative_config, draft, device, progress, donate)
        self.device = self.runner.device
        self.block_size = m.block_size
        self.ring_pages = m.ring.ring_pages if m.ring else 0
        self.vocab = m.model.vocab
        self.max_context = max_context
        self.sampler = m.sampler           # None: the host samples from pulled logits
        self.refused = {r.token_id: r.config_key for r in m.refused_tokens}
        self.last_step_calls = 0            # the calls the last step() ran (0: every sequence waited on its constraint)
        self.serving_loop = None            # the server loop (serve.loop.EngineLoop) started last on this Engine
        self._ids = itertools.count()
        self._order = itertools.count()
        self._warm: set[str] = set()       # entries run once by warm_up
        self._stats = new_stats()
        if self.speculative_config is not None:
            self._stats["spec_decode_num_accepted_tokens_per_pos"] = [0] * self.speculative_config.num_speculative_tokens
        self.model_runner = ModelRunner(m, self.runner, self.scheduler, self._stats)
        if self.speculative_config is not None and self.speculative_config.method == "mtp":
            self.scheduler.proposer = self.model_runner.proposer = MtpProposer(m, self.runner)
        self.lora = self._serve_adapters(lora_modules or {}, max_cpu_loras)
        self.load_seconds = time.perf_counter() - t0
        self.resident_at_load = host_memory.resident_bytes()
        log.info("loaded %s: %d entries (%s), weights %.1f MiB, pools %.1f MiB (%s; pages of %d), %.1f s; %s",
                 self.artifact_dir, sum(self.runner.compile_report().values()),
                 ", ".join(f"{k}: {v}" for k, v in self.runner.compile_report().items()),
                 self.runner.weight_bytes / 2**20, self.runner.pool_bytes / 2**20,
                 ", ".join(f"{p.name} ({p.kind}) {p.capacity}" for p in m.pools), self.block_size, self.load_seconds,
                 self._resident_line())
        if (self.resident_at_load or 0) > self.resident_bound:
            log.warning("the resident set at load, %.1f MiB, passes its bound of %.1f MiB (weights + pools + the "
                        "runtime's stated overhead)", self.resident_at_load / 2**20, self.resident_bound / 2**20)

    def _serve_adapters(self, modules: dict, max_cpu_loras: int | None) -> LoraSlots | None:
        """The adapter slots' keeper (None for an artifact without them), serving `modules`."""
        m = self.manifest
        if m.lora is None:
            if modules:
                self.close()
                raise LoraError(f"{self.artifact_dir} has no LoRA adapter slots, so it cannot serve adapters "
                                f"{sorted(modules)}; export it with --max-loras N")
            return None
        lora = LoraSlots(m.lora, lambda slot, a: self.runner.adapters.write(slot, a.weights, a.scale),
                         max_cpu_loras or 0)
        try:
            for name, spec in modules.items():
                spec = spec if isinstance(spec, dict) else {"path": spec}
                lora.add(name, spec["path"], spec.get("base_model_name"))
        except (LoraError, KeyError) as e:
            self.close()
            raise LoraError(f"lora_modules: {e}") from None
        self.scheduler.lora = lora
        return lora

    def load_lora_adapter(self, name: str, path: str | Path, base_model_name: str | None = None) -> None:
        """Serve one more adapter (any thread); requests may pick it by name once this returns."""
        if self.lora is None:
            raise LoraError(f"{self.artifact_dir} has no LoRA adapter slots; export it with --max-loras N")
        self.lora.add(name, path, base_model_name)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving an adapter (any thread): requests that picked it run to their end with it."""
        if self.lora is None:
            raise LoraError(f"{self.artifact_dir} has no LoRA adapter slots")
        self.lora.remove(name)

    @property
    def resident_bound(self) -> int:
        """The most this process holds resident serving the artifact: its weights and pools, plus the runtime's
        stated overhead (host_memory.RESIDENT_OVERHEAD)."""
        return self.runner.bytes_per_device + host_memory.RESIDENT_OVERHEAD

    def _resident_line(self) -> str:
        """The resident set at load against its bound (untouched pool pages are not resident yet); the runtime's
        own share is the resident set before the weights."""
        if self.resident_at_load is None:
            return "resident set unknown (no /proc/self/status)"
        own = self.runner.resident_before_weights
        return (f"resident set {self.resident_at_load / 2**20:.1f} MiB (the runtime's before the weights "
                f"{(own or 0) / 2**20:.1f} MiB), at most weights + pools + "
                f"{host_memory.RESIDENT_OVERHEAD / 2**30:.1f} GiB = {self.resident_bound / 2**20:.1f} MiB")

    @classmethod
    def load(cls, artifact_dir: str | Path, plugin: str | None = None, **kwargs) -> "Engine":
        """Load an artifact (`python -m tlaloc_jax.export`'s or `tlaloc_jax.stage`'s) and make it ready to serve.

        plugin: the PJRT plugin library (default: the CPU plugin of lammps-jax-pjrt-cpu). Keywords: see
        `Engine.__init__` (cache_dir: the compiled-executable cache, default ~/.cache/tlaloc-jax/executables;
        None or "none": no cache). Close it (or use `with`) to free the device."""
        return cls(artifact_dir, plugin, **kwargs)

    @property
    def use_decode_steps(self) -> bool:
        return self.scheduler.planner.use_decode_steps

    @use_decode_steps.setter
    def use_decode_steps(self, value: bool) -> None:
        self.scheduler.planner.use_decode_steps = bool(value)

    @property
    def executables(self):
        """Every entry's executable but the scoring prefills' (those still in the compile cache loaded now)."""
        for e in self.manifest.entries:
            if e.kind != af.EntryKind.PREFILL_SCORED:
                self.runner.executable(e)
        return self.runner.executables

    donate = property(lambda self: self.runner.donate)
    weight_bytes = property(lambda self: self.runner.weight_bytes)
    pool_bytes = property(lambda self: self.runner.pool_bytes)

    def compile_report(self) -> dict[str, int]:
        return self.runner.compile_report()

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 16, stop_token_ids: Iterable[int] = (),
                    sampling: Sampling | None = None, request_id: str | None = None,
                    constraint: Constraint | None = None, single_step: bool = False, priority: int = 0,
                    cache_salt: str | None = None, lora: str | None = None) -> str:
        """Queue a request (it runs when there is room) or raise RequestRefused if it could never run or is bad;
        returns its id.

        constraint: the tokens it may choose at each step (structured output); applied before sampling.
        single_step: the caller looks at every token before the next is due (stop strings): the request never
        runs in a decode_steps call, which would compute tokens past the caller's stop.
        priority: lower runs first, and is preempted last (ties: earlier arrival first).
        cache_salt: a non-empty string; the request shares cached prefix pages (and state snapshots) only with
        requests of the same salt (vLLM's cache_salt: one client's prompts stay unobservable to another's).
        lora: the name of a served LoRA adapter (lora_modules, load_lora_adapter) it runs with; None: the base model.
        It waits, unrefused, while every adapter slot is held by other adapters' requests."""
        sched = self.scheduler
        try:
            prompt = self._check_prompt(prompt, max_new_tokens)
            stop = check_stop(stop_token_ids)
            s = check_sampling(sampling)
            check_sampler_fits(self.sampler, s, self.vocab)
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise RequestRefused("bad_request", f"priority must be an integer, got {priority!r}")
            cache_salt = check_cache_salt(cache_salt)
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in sched.requests:
                raise RequestRefused("bad_request", f"request id {rid!r} is already in use")
            rng = np.random.default_rng(s.seed)
            sched.check_could_fit([(len(prompt), max_new_tokens)])
            adapter = self._adapter(lora)
        except RequestRefused:
            self._stats["requests_refused"] += 1
            raise
        seed = s.seed if s.seed is not None else int.from_bytes(os.urandom(8), "little")
        sched.add(Request(rid, prompt, int(max_new_tokens), stop, s, rng, {kind: [] for kind in sched.kv.pools},
                          time.perf_counter(), order=next(self._order), priority=priority, seed=seed,
                          cache_salt=cache_salt, lora=adapter,
                          constraint=constraint, single_step=bool(single_step),
                          prompt_logprobs=[None] if s.prompt_logprobs is not None else None))
        return rid

    def _adapter(self, name: str | None):
        if name is None:
            return None
        if self.lora is None:
            raise RequestRefused("bad_request", f"LoRA adapter {name!r}: this artifact has no adapter slots")
        try:
            return self.lora.adapter(name)
        except LoraError as e:
            raise RequestRefused("bad_request", str(e)) from None

    def check_could_fit(self, sizes: Sequence[tuple[int, int]]) -> None:
        """Refuse sequences, given as (prompt tokens, max_new_tokens), that together would not fit the pools even
        if every page were free (RequestRefused "too_long" or "exceeds_pool"); any thread may call it."""
        self.scheduler.check_could_fit(sizes)

    def _check_prompt(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise RequestRefused("bad_request", f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise RequestRefused("bad_request", "prompt must be a list of integer token ids") from None
        if not ids:
            raise RequestRefused("empty_prompt", "prompt is empty")
        for t in ids:
            if t in self.refused:
                raise RequestRefused("placeholder_token", f"refused token {t} (multimodal placeholder, config key "
                                                          f"{self.refused[t]}): this artifact is the text decoder only")
            if not 0 <= t < self.vocab:
                raise RequestRefused("out_of_vocabulary", f"token id {t} is outside the vocabulary (size {self.vocab})")
        self.scheduler.check_length(len(ids), max_new_tokens)
        return ids

    def abort(self, request_id: str) -> None:
        """End a request now (a client went away) and free its pages."""
        s = self.scheduler.requests.get(request_id)
        if s is not None and not s.finished:
            self.model_runner.finish(s, "aborted")

    def release(self, request_id: str) -> None:
        """Forget a finished request (its output is no longer needed)."""
        s = self.scheduler.requests.get(request_id)
        if s is not None:
            if not s.finished:
                self.model_runner.finish(s, "aborted")
            del self.scheduler.requests[request_id]

    def output(self, request_id: str) -> list[int]:
        return list(self.scheduler.requests[request_id].generated)

    def request_info(self, request_id: str) -> Request:
        return self.scheduler.requests[request_id]

    def active_requests(self) -> list[str]:
        return [s.rid for s in self.scheduler.requests.values() if not s.finished]

    def has_unfinished(self) -> bool:
        return any(not s.finished for s in self.scheduler.requests.values())

    def cold_entries(self) -> list[af.Entry]:
        """The entries never run yet (nor loading in the background), in the manifest's order (smallest first)."""
        ran = self.runner.stats["executions_by_entry"]
        return [e for e in self.manifest.entries if e.name not in ran and e.name not in self._warm
                and self.runner.loaded(e)]

    def warm_up(self, e: af.Entry) -> None:
        """Run entry `e` once with rows that read a few pages and write nothing (call_inputs.warm_up_inputs; the pools
        stay as they were): an executable's first run pays one-time costs (50-200 ms an entry on a 2-core CPU) that a
        server's first requests should not."""
        with self.runner.driving("Engine.warm_up"):
            self.runner.run(e, call_inputs.warm_up_inputs(e, self.runner, self.ring_pages), set(), count=False)
        self._warm.add(e.name)

    def uncompiled_entries(self) -> list[af.Entry]:
        """The entries not compiled (nor loaded from the compile cache) yet, in the manifest's order."""
        return [e for e in self.manifest.entries if e.name not in self.runner.executables]

    def entries_to_compile(self) -> list[af.Entry]:
        """The entries neither compiled nor in the compile cache: what a server compiles before it is ready (a cached
        one loads on first use or while idle, Runner.to_compile)."""
        return self.runner.to_compile()

    def compile_all(self) -> int:
        """Compile (or load from the compile cache) every entry not compiled yet: what a server that starts ready does
        before it serves, where no engine loop does it (a Ray Serve replica's constructor, the Triton model before it
        is bound). -> the entries compiled."""
        todo = self.uncompiled_entries()
        for e in todo:
            self.runner.executable(e)
        return len(todo)

    # -- steps ------------------------------------------------------------------------------------

    def step(self, on_events: Callable[[list[StepEvent]], None] | None = None) -> list[StepEvent]:
        """Run one scheduling step; returns the tokens produced (and the requests that failed).

        on_events: called with the step's events as soon as each group is known: the failures found before its
        calls, then each call's events right after that call, before the step's later calls (a server streams a
        token computed by a short call without waiting for a long prefill call of the same step)."""
        with self.runner.driving("Engine.step"):
            return self._step(on_events)

    def _step(self, on_events: Callable[[list[StepEvent]], None] | None) -> list[StepEvent]:
        events: list[StepEvent] = [
            self.model_runner.fail(s, why, request=True) for s in list(self.scheduler.requests.values())
            if s.constraint is not None and not s.finished and (why := s.constraint.failure()) is not None]
        if self.scheduler.planner.loaded is not None and not self.runner.still_loading():
            self.scheduler.planner.loaded = None        # every entry loaded: pick's answers are fixed
        step = self.scheduler.schedule()
        self.last_step_calls = len(step.calls)
        if step.restores and not self.model_runner.copy_slots(step.restores):
            events += [self.model_runner.fail(c.seq, "restoring its cached state failed") for c in step.restores]
        if on_events is not None and events:
            on_events(list(events))
        for call in step.calls:
            if any(s.finished for s in call.seqs):
                continue        # a failed restore: the call's other sequences run next step
            now = time.perf_counter()
            for s in call.seqs:
                if s.first_scheduled is None:
                    s.first_scheduled = now
            produced = self.model_runner.run_call(call)
            events.extend(produced)
            if on_events is not None and produced:
                on_events(produced)
        snapshots = self.scheduler.kv.snapshot_copies()
        if snapshots:
            self.model_runner.copy_slots(snapshots)
        if events:
            self._stats["steps"] += 1
        return events

    # -- conveniences ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16,
                 sampling: Sampling | None = None, stop_token_ids: Iterable[int] = (),
                 lora: str | Sequence[str | None] | None = None) -> list[list[int]]:
        """Decode the prompts together; returns each one's new ids. Refuses (nothing admitted) if any is bad;
        raises RuntimeError naming the first sequence that failed. Its requests are released either way. lora: one
        adapter name for every prompt, or one name (None: the base model) per prompt."""
        stop = tuple(stop_token_ids)
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        rids: list[str] = []
        requests = self.scheduler.requests
        try:
            for p, name in zip(prompts, loras, strict=True):
                rids.append(self.add_request(p, max_new_tokens, stop, sampling, lora=name))
            while any(not requests[r].finished for r in rids):
                self.step()
            for rid in rids:
                if requests[rid].finish_reason == "error":
                    raise RuntimeError(f"request {rid} failed: {requests[rid].error}")
            return [list(requests[rid].generated) for rid in rids]
        finally:
            for rid in rids:
                self.release(rid)

    def stats(self) -> dict:
        sched, run = self.scheduler, self.runner
        st = dict(self._stats, **run.stats)
        st.update(batch_sizes=dict(self._stats["batch_sizes"]),
                  spec_decode_num_accepted_tokens_per_pos=list(self._stats["spec_decode_num_accepted_tokens_per_pos"]),
                  executions_by_entry=dict(run.stats["executions_by_entry"]))
        # The headline numbers are the first kind's in PoolKind order: paged KV pages when there are some.
        first = sched.kv.pools[self.manifest.pool_kinds[0]]
        pools = {}
        for p in self.manifest.pools:     # pools of one kind share their units (pages, or state slots)
            u = sched.kv.pools[p.kind]
            pools[p.name] = dict(kind=str(p.kind), pages_in_use=u.in_use, pages_cached=u.cached_units,
                                 pages_free=u.free_units, num_pages=u.num_units)
        st.update(sched.stats, pages_in_use=first.in_use, pages_free=first.free_units, num_pages=first.num_units,
                  pools=pools, kv_cache_usage=sched.usage(), prefix_caching=sched.prefix_caching,
                  active_requests=len(self.active_requests()), running=len(sched.running),
                  waiting=len(sched.waiting),
                  weight_bytes=self.weight_bytes, pool_bytes=self.pool_bytes, devices=self.device.devices,
                  bytes_per_device=run.bytes_per_device, entries=sum(run.compile_report().values()),
                  compile=self.compile_report(), load_seconds=self.load_seconds, donate=self.donate,
                  resident_bytes_at_load=self.resident_at_load)
        if self.lora is not None:       # vllm:lora_requests_info's labels: requests by adapter, running and waiting
            st["lora"] = dict(max_lora=self.manifest.lora.max_loras, running=_by_adapter(sched.running),
                              waiting=_by_adapter(sched.waiting))
        return st

    def close(self) -> None:
        self.runner.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _by_adapter(seqs) -> dict[str, int]:
    """{adapter name: requests}, in the order the adapters first appear; base-model requests are not counted."""
    out: dict[str, int] = {}
    for s in seqs:
        if s.lora is not None:
            out[s.lora.name] = out.get(s.lora.name, 0) + 1
    return out
