"""The JAX-free engine: load an artifact, keep weights and KV pools on the device, batch sequences.

    engine = Engine.load("artifact/")                  # validate, compile (disk cache), upload
    engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)

or, driving the loop yourself (what the HTTP server does):

    rid = engine.add_request([1, 2, 3], max_new_tokens=16)
    while engine.has_unfinished():
        for event in engine.step(): ...

Scheduling is continuous batching. Each step advances every sequence that is still reading its
prompt by one chunk (prompts that fit one prefill entry share a call; a prompt longer than the
entry's tokens per sequence takes several calls, each on the smallest entry whose context holds its
last position), then runs one decode token for every sequence that was already generating, in one
call on the smallest decode entry that holds them. New requests join between steps.

With decode_steps entries in the artifact (`--decode-steps K`), a step in which every sequence is decoding
and none is reading its prompt runs up to K tokens per sequence in one call (`_steps_call` says which
requests qualify); the events of that call come back in step order. A request that arrives meanwhile waits
for that one call only: the next step sees its prompt and runs single steps.

A request reserves the pages for its prompt and all its new tokens when it is admitted and takes them
as it grows, so a live sequence never runs out of pages and is never preempted: a request that does not
fit now is refused (RequestRefused, kind "pool_exhausted") and may be sent again once other sequences
end; one that would not fit even the empty pool is refused for good (kind "exceeds_pool";
`check_could_fit` answers that for several sequences at once, without touching the pool).
The engine knows an artifact's pools by kind only (manifest PoolKind), never by name or model: for each
kind it keeps one allocator, and a sequence holds, of each, what the kind's rule (tlaloc_jax.paging)
says a sequence of its length holds: a page per block for paged KV, at most a ring of pages for ring KV
(sliding layers; a piece of prompt is split so that each call fits the ring), one slot for its life for
state pools (a recurrent layer's state: carried across a prompt's chunks, freed when it ends).

The invariant, per request: whatever one request does (bad sampling parameters, a refused admission, a
failure while its token is sampled, an exception anywhere on its path), its own pages, held and
promised, are released, it alone fails, and every other sequence's ids are those of its solo run.
  - Admission checks everything (prompt, lengths, stop ids, sampling, could-ever-fit) before it promises
    a page: the promise is its last step, so a refused request leaves the pools as they were.
  - In a step, a failure sampling one sequence's token ends that sequence (finish_reason "error", a
    StepEvent naming the cause, its pages freed); the other sequences of the call keep their tokens.
  - A call that fails as a whole (building its inputs, or the execution) ends the sequences it held:
    they shared the failed call. Nothing else changes, and the engine keeps serving.
"""

from __future__ import annotations

import enum
import itertools
import logging
import numbers
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from tlaloc_jax import manifest as mf
from tlaloc_jax.paging import PageAllocator, PoolExhausted, RowCall, build_step_inputs, pool_rule, row_call

from . import sharded
from .pjrt import Buffer, Device, Executable, TooFewDevicesError
from .sampling import GREEDY, NEUTRAL_ROW, Sampling, log_softmax, sample, seed_words, top_logprobs, unpack_mask

log = logging.getLogger("tlaloc_jax.serve")

DEFAULT_CACHE_DIR = Path("~/.cache/tlaloc-jax/executables")
ADDRESS_CHECK_RUNS = 100


class _ArgSource(enum.Enum):
    """Where an entry's argument comes from (Engine._arg_plan)."""
    STEP = "step input"
    POOL = "pool"
    WEIGHT = "weight"


class RequestRefused(ValueError):
    """A request the engine will not run; nothing of any sequence changed.

    kind: "empty_prompt", "placeholder_token", "out_of_vocabulary", "too_long", "bad_request",
    "exceeds_pool" (more pages than the whole pool: never admitted), or "pool_exhausted" (retry after
    other sequences end).
    """

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class StepEvent:
    """A token produced for a request in one step (token None: the request failed).

    logprob and top_logprobs (when the request asked for logprobs): the token's logprob under the model
    (log_softmax of the logits) and the `logprobs` largest as (id, logprob) pairs. prompt_logprobs (with a
    request's first token, when it asked for them): per prompt token, None for the first, else
    (its logprob, its rank, the top pairs)."""

    request_id: str
    token: int | None
    finished: bool
    finish_reason: str | None = None   # "stop" | "length" | "error" | "aborted"
    error: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    prompt_logprobs: tuple | None = None


class Constraint:
    """What a structured-output request asks of each token (serve/structured.py implements it with a grammar).

    fill(words): clear, in `words` (the packed mask: [ceil(V / 32)] int32, bit t % 32 of word t // 32, all ones
    on entry), the tokens the constraint forbids now. accept(token): advance past the chosen token; False if
    the constraint refuses it."""

    def fill(self, words: np.ndarray) -> None:
        raise NotImplementedError

    def accept(self, token: int) -> bool:
        raise NotImplementedError


@dataclass
class _Seq:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    stop: frozenset[int]
    sampling: Sampling
    rng: np.random.Generator
    held: dict[mf.PoolKind, list[int]]   # pages (or state slots) the sequence holds, per kind of pool
    reserved: dict[mf.PoolKind, int]     # units promised to the sequence and not yet taken, per kind
    arrival: float
    seed: int = 0                        # the body's 64-bit seed (the request's, else a random one)
    constraint: Constraint | None = None
    single_step: bool = False            # the caller checks each token (stop strings): no decode_steps calls
    prompt_logprobs: list | None = None  # filled while the prompt is read, when the request asked
    prefilled: int = 0
    first_scheduled: float | None = None     # when the first call that reads this sequence started
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt) and not self.finished


@dataclass(frozen=True)
class _Call:
    entry: mf.Entry
    seqs: tuple[_Seq, ...]
    rows: tuple[RowCall, ...]
    limits: tuple[int, ...] = ()         # decode_steps: the most tokens each row may produce in the call


class Engine:
    """Serve one artifact on one PJRT device, or on the N devices of its mesh (a tensor-parallel artifact: one
    execution per step runs on all of them). Not thread-safe: one caller drives `step()`."""

    def __init__(self, artifact_dir: str | Path, plugin: str | None = None, *,
                 cache_dir: str | Path | None = DEFAULT_CACHE_DIR, memory_fraction: float = 0.75,
                 donate: bool = True, progress: bool = True, trust_weights: bool = False,
                 manifest: mf.Manifest | None = None, max_model_len: int | None = None,
                 use_decode_steps: bool = True):
        """Load an artifact: validate it all (files, hashes, every body's @main against its entry, the memory its
        weights and pools need), then compile, upload the weights and allocate the pools. A bad artifact is
        refused (ManifestError naming what is wrong) before anything is compiled or allocated.

        trust_weights: skip hashing the weight files (their sizes are still checked), for very large
        artifacts whose weights are known good; the log says so.
        manifest: this artifact's manifest as `mf.load_manifest` returned it, when the caller has validated it
        already (the server does, to read the tokenizer before anything compiles): it is not read again.
        max_model_len: the longest sequence (prompt plus new tokens) served, at most the artifact's largest
        context (default: that context).
        use_decode_steps: run the artifact's decode_steps entries when every sequence is decoding (the attribute
        of that name may be changed between steps; False serves with single decode steps only).
        """
        t0 = time.perf_counter()
        self.artifact_dir = Path(artifact_dir)
        # Refuses a bad artifact before anything runs.
        self.manifest = m = manifest or mf.load_manifest(self.artifact_dir, verify_weights=not trust_weights)
        if trust_weights:
            log.warning("--trust-weights: the weight files of %s are not hashed", self.artifact_dir)
        elif any(not w.sha256 and not w.shards for w in m.weights):
            log.warning("%s (%s) carries no hashes of its weight and tokenizer files: they are not verified",
                        self.artifact_dir, m.schema)
        try:
            self.device = Device(plugin, memory_fraction=memory_fraction, cache_dir=cache_dir, devices=m.devices)
        except TooFewDevicesError as e:
            mesh = ", ".join(f"{a.name}={a.size}" for a in m.mesh.axes)
            raise mf.ManifestError(f"{self.artifact_dir} runs on {e.asked} devices (mesh {mesh}); the plugin has "
                                   f"{e.available}: nothing was allocated") from None
        want = {"cpu": "cpu", "cuda": "cuda"}[m.versions.platform]
        if self.device.platform_name.lower() not in (want, "gpu" if want == "cuda" else want):
            self.device.close()
            raise mf.ManifestError(f"artifact was exported for {m.versions.platform}, the plugin "
                                   f"{self.device.plugin_path} is {self.device.platform_name}")
        try:
            self._check_memory()
        except BaseException:
            self.device.close()
            raise
        self.donate = donate
        self.use_decode_steps = use_decode_steps
        self.block_size = m.block_size
        self.ring_pages = m.ring.ring_pages if m.ring else 0
        self.rules = {kind: pool_rule(m.pools_of(kind)[0], m.block_size) for kind in m.pool_kinds}
        self.vocab = m.model.vocab
        self.max_context = max(m.buckets.context_ladder)
        if max_model_len is not None:
            if not isinstance(max_model_len, int) or not 0 < max_model_len <= self.max_context:
                raise ValueError(f"max_model_len {max_model_len!r} must be a positive integer at most the artifact's "
                                 f"largest context ({self.max_context})")
            self.max_context = max_model_len
        self.sampler = m.sampler           # None: the host samples from pulled logits
        self.scorer = m.scorer             # None: a prompt whose logprobs are asked is read a token a call
        # Device buffers: a Buffer each, or on a mesh a tuple of one per device (serve/sharded.py).
        self._neutral: dict[tuple[str, mf.Role], sharded.Placed] = {}
        # The last host value of each (entry, input role) and its device buffer: an input equal to the previous
        # call's (block tables, seeds, stop ids, ...) is not uploaded again.
        self._kept_inputs: dict[tuple[str, mf.Role], tuple[bytes, sharded.Placed]] = {}
        self.refused = {r.token_id: r.config_key for r in m.refused_tokens}
        self._by_kind = {kind: sorted((e for e in m.entries if e.kind == kind), key=lambda e: (e.context, e.batch))
                         for kind in mf.EntryKind}
        self.executables: dict[str, Executable] = {}
        try:
            self._compile_all(progress)
            self.weights = {w.slot: sharded.upload_weight(self.device, self.artifact_dir, w, m.mesh)
                            for w in m.weights}
            self.pools: dict[str, sharded.Placed] = {p.name: sharded.zeros(self.device, p.dtype, p.shape, p.partition,
                                                                           m.mesh) for p in m.pools}
        except BaseException:
            self.device.close()
            raise
        self.allocators = {kind: PageAllocator(m.capacity(kind), *_KIND_NAMES.get(kind, (str(kind), "units")))
                           for kind in m.pool_kinds}
        self._seqs: dict[str, _Seq] = {}
        self._ids = itertools.count()
        self._runs = 0
        self._entries_checked: set[str] = set()
        # Per entry, where each argument comes from: (STEP, key in the inputs dict), (POOL, slot), (WEIGHT, slot).
        self._arg_plans: dict[str, list[tuple[_ArgSource, object, mf.Role]]] = {}
        self._stats = dict(steps=0, executions=0, prefill_calls=0, decode_calls=0, tokens_generated=0,
                           prompt_tokens=0, requests_finished=0, requests_failed=0, requests_refused=0,
                           decode_steps_calls=0, pool_address_checks=0, pool_in_place=0, logits_pulled=0,
                           sampled_in_body=0,
                           executions_by_entry={}, batch_sizes={})
        self.load_seconds = time.perf_counter() - t0
        log.info("loaded %s: %d entries (%s), weights %.1f MiB, pools %.1f MiB (%s; pages of %d), %.1f s",
                 self.artifact_dir, len(self.executables),
                 ", ".join(f"{k}: {v}" for k, v in self.compile_report().items()),
                 self.weight_bytes / 2**20, self.pool_bytes / 2**20,
                 ", ".join(f"{p.name} ({p.kind}) {p.capacity}" for p in m.pools), self.block_size, self.load_seconds)

    @classmethod
    def load(cls, artifact_dir: str | Path, plugin: str | None = None, **kwargs) -> "Engine":
        return cls(artifact_dir, plugin, **kwargs)

    # -- loading ---------------------------------------------------------------------------------

    def _compile_all(self, progress: bool) -> None:
        """Compile every entry but the scoring prefills, which only requests for prompt logprobs run: they are
        compiled on first use (`_executable`), so a server that never scores a prompt never compiles them."""
        from tqdm.auto import tqdm
        entries = [e for e in self.manifest.entries if e.kind != mf.EntryKind.PREFILL_SCORED]
        bar = tqdm(entries, desc="compile", unit="entry", disable=not progress)
        for e in bar:
            bar.set_postfix_str(e.name)
            self._executable(e)

    def _executable(self, e: mf.Entry) -> Executable:
        exe = self.executables.get(e.name)
        if exe is None:
            t0 = time.perf_counter()
            exe = self.device.compile((self.artifact_dir / e.serialized).read_bytes(), name=e.name)
            self.executables[e.name] = exe
            if e.kind == mf.EntryKind.PREFILL_SCORED:
                log.info("compiled %s on first use (%s), %.1f s", e.name, exe.cache, time.perf_counter() - t0)
        return exe

    def _check_memory(self) -> None:
        """Refuse an artifact whose weights and pools cannot fit the device's free memory, before any of it is
        allocated (on a mesh, each device's share against each device's memory; the CPU plugin's devices share
        the host's, which must hold them all)."""
        weights, pools = sharded.bytes_per_device(self.manifest)
        shared = self.device.platform_name.lower() == "cpu"
        copies = self.device.devices if shared else 1
        need = (weights + pools) * copies
        each = not shared and self.device.devices > 1
        frees = [self.device.memory_available(d) for d in range(self.device.devices)] if each else \
            [self.device.memory_available()]
        for d, free in enumerate(frees):
            if free is not None and need > free:
                names = ", ".join(f"{p.name} {p.nbytes / 2**20:.1f} MiB" for p in self.manifest.pools)
                where = f"device {d}" if each else "the device"
                raise mf.ManifestError(f"the artifact needs {need / 2**20:.1f} MiB on {where} (weights "
                                       f"{weights * copies / 2**20:.1f} MiB; pools {names}), and "
                                       f"{self.device.platform_name} has {free / 2**20:.1f} MiB free")

    def compile_report(self) -> dict[str, int]:
        """How the entries were obtained: {"hit": n, "miss": n, ...} (hit = from the disk cache)."""
        out: dict[str, int] = {}
        for exe in self.executables.values():
            out[exe.cache] = out.get(exe.cache, 0) + 1
        return out

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.manifest.weights)

    @property
    def pool_bytes(self) -> int:
        return sum(p.nbytes for p in self.manifest.pools)

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 16, stop_token_ids: Iterable[int] = (),
                    sampling: Sampling | None = None, request_id: str | None = None,
                    constraint: Constraint | None = None, single_step: bool = False) -> str:
        """Admit a request (its pages reserved) or raise RequestRefused; returns its id.

        constraint: the tokens it may choose at each step (structured output); applied before sampling.
        single_step: the caller looks at every token before the next is due (stop strings): the request never
        runs in a decode_steps call, which would compute tokens past the caller's stop."""
        try:
            prompt = self._check_prompt(prompt, max_new_tokens)
            stop = _check_stop(stop_token_ids)
            s = _check_sampling(sampling)
            self._check_sampler_fits(s)
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._seqs:
                raise RequestRefused("bad_request", f"request id {rid!r} is already in use")
            rng = np.random.default_rng(s.seed)
            self.check_could_fit([(len(prompt), max_new_tokens)])
            # The promise of pages comes last: whatever is refused above leaves the pools as they were.
            reserved = self._reserve(len(prompt) + max_new_tokens - 1)
        except RequestRefused:
            self._stats["requests_refused"] += 1
            raise
        seed = s.seed if s.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._seqs[rid] = _Seq(rid, prompt, int(max_new_tokens), stop, s, rng, {kind: [] for kind in self.allocators},
                               reserved, time.perf_counter(), seed=seed, constraint=constraint,
                               single_step=bool(single_step),
                               prompt_logprobs=[None] if s.prompt_logprobs is not None else None)
        return rid

    def _check_sampler_fits(self, s: Sampling) -> None:
        """What the artifact's sampler cannot carry is refused by name (the host fallback carries anything)."""
        if self.sampler is None:
            return
        if len(s.logit_bias) > self.sampler.logit_bias:
            raise RequestRefused("bad_request", f"logit_bias has {len(s.logit_bias)} entries; this artifact's sampler "
                                                f"takes at most {self.sampler.logit_bias}")
        if s.logprobs is not None and s.logprobs > self.sampler.top_logprobs:
            raise RequestRefused("bad_request", f"{s.logprobs} top logprobs asked; this artifact's sampler returns at "
                                                f"most {self.sampler.top_logprobs}")
        for t, _ in s.logit_bias:
            if not 0 <= t < self.vocab:
                raise RequestRefused("out_of_vocabulary", f"logit_bias token id {t} is outside the vocabulary (size "
                                                          f"{self.vocab})")

    def check_could_fit(self, sizes: Sequence[tuple[int, int]]) -> None:
        """Refuse sequences, given as (prompt tokens, max_new_tokens), that together would not fit the pools
        even if every page were free: RequestRefused kind "too_long" (one is past the largest context) or
        "exceeds_pool". Reads only the pools' sizes, never their state, so any thread may call it."""
        for prompt_len, max_new_tokens in sizes:
            self._check_length(prompt_len, max_new_tokens)
        for kind, alloc in self.allocators.items():
            need = sum(self.rules[kind].units(p + m - 1) for p, m in sizes)
            if need > alloc.num_pages:
                seqs = f"{len(sizes)} sequence needs" if len(sizes) == 1 else f"{len(sizes)} sequences need"
                raise RequestRefused("exceeds_pool", f"{seqs} {need} {alloc.name} {alloc.unit} together (each its "
                                                     f"prompt plus max_new_tokens), and the pool holds "
                                                     f"{alloc.num_pages} {alloc.unit}: they could never run at once")

    def _reserve(self, length: int) -> dict[mf.PoolKind, int]:
        """Promise a sequence of `length` positions what it will hold of each kind of pool; all or nothing."""
        got: dict[mf.PoolKind, int] = {}
        try:
            for kind, alloc in self.allocators.items():
                n = self.rules[kind].units(length)
                alloc.reserve(n)
                got[kind] = n
        except PoolExhausted as e:
            for kind, n in got.items():
                self.allocators[kind].unreserve(n)
            raise RequestRefused("pool_exhausted", f"{e}; {len(self.active_requests())} sequences hold pages; "
                                                   "retry after one ends") from None
        return got

    def _grow(self, s: _Seq, end: int) -> None:
        """Take, from the sequence's reservation, what its positions up to `end` hold of each kind of pool."""
        for kind, held in s.held.items():
            n = self.rules[kind].units(end) - len(held)
            if n > 0:
                held.extend(self.allocators[kind].alloc(n, reserved=True))
                s.reserved[kind] -= n

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
        self._check_length(len(ids), max_new_tokens)
        return ids

    def _check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len > self.max_context:
            raise RequestRefused("too_long", f"prompt of {prompt_len} tokens is longer than the largest context "
                                             f"{self.max_context}")
        if prompt_len + max_new_tokens - 1 > self.max_context:
            raise RequestRefused("too_long", f"prompt of {prompt_len} tokens plus max_new_tokens {max_new_tokens} "
                                             f"exceeds the largest context {self.max_context}")

    def abort(self, request_id: str) -> None:
        """End a request now (a client went away) and free its pages."""
        s = self._seqs.get(request_id)
        if s is not None and not s.finished:
            self._finish(s, "aborted")

    def release(self, request_id: str) -> None:
        """Forget a finished request (its output is no longer needed)."""
        s = self._seqs.get(request_id)
        if s is not None:
            if not s.finished:
                self._finish(s, "aborted")
            del self._seqs[request_id]

    def output(self, request_id: str) -> list[int]:
        return list(self._seqs[request_id].generated)

    def request_info(self, request_id: str) -> _Seq:
        return self._seqs[request_id]

    def active_requests(self) -> list[str]:
        return [s.rid for s in self._seqs.values() if not s.finished]

    def has_unfinished(self) -> bool:
        return any(not s.finished for s in self._seqs.values())

    def _finish(self, s: _Seq, reason: str, error: str | None = None) -> None:
        s.finish_reason = reason
        s.error = error
        for kind, held in s.held.items():
            self.allocators[kind].free(held)
        for kind, n in s.reserved.items():
            self.allocators[kind].unreserve(n)
        s.held, s.reserved = {kind: [] for kind in s.held}, {}
        self._stats["requests_failed" if reason == "error" else "requests_finished"] += 1

    # -- scheduling ------------------------------------------------------------------------------

    def _entries(self, kind: str) -> list[mf.Entry]:
        """The entries of `kind`, smallest first (by context, then batch)."""
        return self._by_kind[kind]

    def _pick(self, kind: str, batch: int, context: int, tokens: int) -> mf.Entry | None:
        """The smallest entry of `kind` that holds `batch` rows of `tokens` tokens reaching `context` positions."""
        for e in self._entries(kind):
            if e.batch >= batch and e.context >= context and e.tokens_per_seq >= tokens:
                return e
        return None

    def _scored(self, s: _Seq) -> bool:
        """Whether the sequence's prompt logprobs come from the scoring prefill entries (the artifact has them,
        with as many top logprobs as the request asks)."""
        return (s.prompt_logprobs is not None and self.scorer is not None
                and s.sampling.prompt_logprobs <= self.scorer.top_logprobs)

    def _chunk(self, s: _Seq) -> tuple[int, int]:
        """(start, length) of the next piece of the prompt this sequence prefills."""
        start = s.prefilled
        cap = self.manifest.buckets.prefill_chunk or self.max_context
        if s.prompt_logprobs is not None and not self._scored(s):
            # The fallback for artifacts without scoring entries (or with fewer top logprobs than asked): prompt
            # logprobs need the distribution after every prompt token, and a plain entry returns the logits of
            # each row's last token: such a prompt is read one token a call.
            cap = 1
        for rule in self.rules.values():
            limit = rule.call_limit(start)
            if limit is not None:
                cap = min(cap, limit)
        return start, min(len(s.prompt) - start, cap)

    def _prefill_calls(self, prefilling: list[_Seq], kind: mf.EntryKind) -> list[_Call]:
        """The calls that read the next chunk of each prompt: sequences in order, as many a call as an entry of
        `kind` holds."""
        calls: list[_Call] = []
        group: list[_Seq] = []
        for s in prefilling + [None]:
            if s is not None:
                trial = group + [s]
                ends = [self._chunk(x) for x in trial]
                if self._pick(kind, len(trial), max(a + n for a, n in ends), max(n for _, n in ends)):
                    group = trial
                    continue
            if group:
                ends = [self._chunk(x) for x in group]
                entry = self._pick(kind, len(group), max(a + n for a, n in ends), max(n for _, n in ends))
                rows = tuple(row_call(x.prompt[a:a + n], a, x.held) for x, (a, n) in zip(group, ends))
                calls.append(_Call(entry, tuple(group), rows))
            group = [s] if s is not None else []
        return calls

    def _plan(self) -> list[_Call]:
        calls: list[_Call] = []
        prefilling = [s for s in self._seqs.values() if not s.finished and s.prefilled < len(s.prompt)]
        # Prompts scored in the body run the scoring prefill entries, the others the plain ones (no T x V logits).
        calls += self._prefill_calls([s for s in prefilling if not self._scored(s)], mf.EntryKind.PREFILL)
        calls += self._prefill_calls([s for s in prefilling if self._scored(s)], mf.EntryKind.PREFILL_SCORED)
        decoding = [s for s in self._seqs.values() if s.decoding]
        if decoding and not prefilling:
            call = self._steps_call(decoding)
            if call is not None:
                return [call]
        max_batch = max(e.batch for e in self._entries(mf.EntryKind.DECODE))
        for i in range(0, len(decoding), max_batch):
            part = decoding[i:i + max_batch]
            rows = tuple(row_call([s.generated[-1]], len(s.prompt) + len(s.generated) - 1, s.held) for s in part)
            entry = self._pick(mf.EntryKind.DECODE, len(part), max(r.start + 1 for r in rows), 1)
            calls.append(_Call(entry, tuple(part), rows))
        return calls

    def _multi_step_ok(self, s: _Seq) -> bool:
        """Whether a decoding sequence's next tokens may come from one decode_steps call: nothing the host decides
        between its tokens. Single steps keep a grammar or other constraint, a stop id masked until min_tokens,
        penalties (the history grows each step), logprobs, stop strings (single_step), more stop ids than the
        entry's STOP_IDS slots, and (an artifact without a sampler) any request that is not plain greedy."""
        sp = s.sampling
        return (s.constraint is None and not s.single_step and sp.logprobs is None and not sp.penalized
                and not (s.stop and len(s.generated) < sp.min_tokens)
                and (self.sampler is not None or sp.plain))

    def _stop_ids(self, s: _Seq) -> list[int]:
        """The stop ids a token can be (those inside the vocabulary), sorted."""
        return sorted(t for t in s.stop if 0 <= t < self.vocab)

    def _steps_call(self, decoding: list[_Seq]) -> _Call | None:
        """One decode_steps call for every decoding sequence, or None (no such entry holds them, or one of them
        must stay on single steps). Each row may produce up to K tokens, at most its remaining max_new_tokens."""
        multi = self._entries(mf.EntryKind.DECODE_STEPS)
        if not (multi and self.use_decode_steps) or not all(self._multi_step_ok(s) for s in decoding):
            return None
        e0 = multi[0]
        stop_slots = e0.inputs[e0.input_index(mf.Role.STOP_IDS)].shape[1]
        if any(len(self._stop_ids(s)) > stop_slots for s in decoding):
            return None
        rows = tuple(row_call([s.generated[-1]], len(s.prompt) + len(s.generated) - 1, s.held) for s in decoding)
        limits = tuple(min(e0.steps, s.max_new_tokens - len(s.generated)) for s in decoding)
        entry = self._pick(mf.EntryKind.DECODE_STEPS, len(decoding), max(r.start + n for r, n in zip(rows, limits)), 1)
        if entry is None or min(limits) < 1:
            return None
        return _Call(entry, tuple(decoding), rows, limits)

    def step(self) -> list[StepEvent]:
        """Run one scheduling step; returns the tokens produced (and the requests that failed)."""
        events: list[StepEvent] = []
        for call in self._plan():
            now = time.perf_counter()
            for s in call.seqs:
                if s.first_scheduled is None:
                    s.first_scheduled = now
            events.extend(self._run_call(call))
        if events:
            self._stats["steps"] += 1
        return events

    def _fail(self, s: _Seq, error: str) -> StepEvent:
        self._finish(s, "error", error)
        return StepEvent(s.rid, None, True, "error", error)

    def _run_call(self, call: _Call) -> list[StepEvent]:
        e = call.entry
        if e.kind == mf.EntryKind.DECODE_STEPS:
            return self._run_steps_call(call)
        # The rows whose last token is a new one (decoding, or reading the end of their prompt): they get a token.
        producing = [e.kind == mf.EntryKind.DECODE or row.start + len(row.token_ids) == len(s.prompt)
                     for s, row in zip(call.seqs, call.rows)]
        scoring = e.kind == mf.EntryKind.PREFILL_SCORED
        try:
            for s, row in zip(call.seqs, call.rows):
                self._grow(s, row.start + len(row.token_ids))
            # Rows read what each sequence holds now that it has grown (a new sequence takes its state slot here).
            rows = [row_call(row.token_ids, row.start, s.held) for s, row in zip(call.seqs, call.rows)]
            inputs = build_step_inputs(rows, batch=e.batch, tokens=e.tokens_per_seq,
                                       width=e.context // self.block_size, block_size=self.block_size,
                                       ring_pages=self.ring_pages,
                                       state_slots=mf.PoolKind.STATE_SLOTS in self.allocators)
            allowed = [self._allowed(s) if p else None for s, p in zip(call.seqs, producing)]
            if self.sampler is not None:
                inputs.update(self._sampler_inputs(e, call, producing, allowed))
            if scoring:
                inputs[mf.Role.SCORE_TARGETS] = score_targets(call, e.batch, e.tokens_per_seq)
            out = self._execute(e, inputs, self._wanted(call, producing, allowed))
            if isinstance(out, tuple):      # an _execute wrapped in its earlier form: (next ids, logits)
                out = {mf.Role.NEXT_TOKEN: out[0], **({mf.Role.LOGITS: out[1]} if out[1] is not None else {})}
        except Exception as err:   # noqa: BLE001 - the call's requests fail, the engine keeps serving
            log.error("call of %s failed: %s", e.name, err)
            return [self._fail(s, f"{e.name} failed: {err}") for s in call.seqs]
        prefill = e.kind in (mf.EntryKind.PREFILL, mf.EntryKind.PREFILL_SCORED)
        self._stats["prefill_calls" if prefill else "decode_calls"] += 1
        bs = self._stats["batch_sizes"]
        bs[len(call.seqs)] = bs.get(len(call.seqs), 0) + 1
        now = time.perf_counter()
        events = []
        for b, (s, row) in enumerate(zip(call.seqs, call.rows)):
            lsm = None
            if scoring:
                s.prompt_logprobs.extend(prompt_scores(out, b, s, row, e.tokens_per_seq))
            elif s.prompt_logprobs is not None and s.prefilled < len(s.prompt):
                # The distribution after this prompt token scores the next one (the last one's is the first
                # generated token's, reported with it).
                lsm = log_softmax(out[mf.Role.LOGITS][b])
                nxt = row.start + len(row.token_ids)
                if nxt < len(s.prompt):
                    t = s.prompt[nxt]
                    s.prompt_logprobs.append((float(lsm[t]), int(np.sum(lsm > lsm[t])) + 1,
                                              tuple(top_logprobs(lsm, s.sampling.prompt_logprobs))))
            if prefill:
                s.prefilled = row.start + len(row.token_ids)
                self._stats["prompt_tokens"] += len(row.token_ids)
                if not producing[b]:
                    continue      # more of the prompt to read; this call's logits are not a token yet
            try:
                tok, logprob, top = self._token(out, b, s, allowed[b], lsm)
                if s.constraint is not None and not s.constraint.accept(tok):
                    raise ValueError(f"token {tok} is outside the request's grammar")
            except Exception as err:   # noqa: BLE001 - this sequence fails; the call's others keep their tokens
                log.error("sampling %s failed: %s", s.rid, err)
                events.append(self._fail(s, f"sampling failed: {err}"))
                continue
            first = not s.generated
            s.generated.append(tok)
            s.token_times.append(now)
            if s.first_token_time is None:
                s.first_token_time = now
            self._stats["tokens_generated"] += 1
            reason = "stop" if tok in s.stop else "length" if len(s.generated) >= s.max_new_tokens else None
            if reason:
                self._finish(s, reason)
            events.append(StepEvent(s.rid, tok, reason is not None, reason, logprob=logprob, top_logprobs=top,
                                    prompt_logprobs=tuple(s.prompt_logprobs) if first and s.prompt_logprobs else None))
        return events

    def _run_steps_call(self, call: _Call) -> list[StepEvent]:
        """Run a decode_steps call: the pages for each row's tokens are taken before it; its tokens come back as
        [B, K] (-1 past a row's stop) and are emitted in step order, each checked as a single step's would be."""
        e = call.entry
        n = len(call.seqs)
        try:
            for s, row, limit in zip(call.seqs, call.rows, call.limits):
                self._grow(s, row.start + limit)
            rows = [row_call(row.token_ids, row.start, s.held) for s, row in zip(call.seqs, call.rows)]
            inputs = build_step_inputs(rows, batch=e.batch, tokens=1, width=e.context // self.block_size,
                                       block_size=self.block_size, ring_pages=self.ring_pages,
                                       state_slots=mf.PoolKind.STATE_SLOTS in self.allocators)
            limit = np.zeros(e.batch, np.int32)
            limit[:n] = call.limits
            stop = np.full(e.inputs[e.input_index(mf.Role.STOP_IDS)].shape, -1, np.int32)
            for b, s in enumerate(call.seqs):
                ids = self._stop_ids(s)
                stop[b, :len(ids)] = ids
            inputs[mf.Role.STEP_LIMIT], inputs[mf.Role.STOP_IDS] = limit, stop
            if self.sampler is not None:
                inputs.update(self._sampler_inputs(e, call, [True] * n, [None] * n))
            tokens = self._execute(e, inputs, {mf.Role.STEP_TOKENS})[mf.Role.STEP_TOKENS]
        except Exception as err:   # noqa: BLE001 - the call's requests fail, the engine keeps serving
            log.error("call of %s failed: %s", e.name, err)
            return [self._fail(s, f"{e.name} failed: {err}") for s in call.seqs]
        self._stats["decode_calls"] += 1
        self._stats["decode_steps_calls"] += 1
        bs = self._stats["batch_sizes"]
        bs[n] = bs.get(n, 0) + 1
        now = time.perf_counter()
        events = []
        for i in range(e.steps):
            for b, s in enumerate(call.seqs):
                tok = int(tokens[b, i])
                if s.finished or tok < 0:
                    continue
                if not 0 <= tok < self.vocab:
                    events.append(self._fail(s, f"{e.name} returned token {tok}, outside the vocabulary"))
                    continue
                s.generated.append(tok)
                s.token_times.append(now)
                self._stats["tokens_generated"] += 1
                reason = "stop" if tok in s.stop else "length" if len(s.generated) >= s.max_new_tokens else None
                if reason:
                    self._finish(s, reason)
                events.append(StepEvent(s.rid, tok, reason is not None, reason))
        return events

    def _allowed(self, s: _Seq) -> np.ndarray | None:
        """The packed mask of the tokens the sequence may choose now ([ceil(V / 32)] int32: its constraint, and
        no stop token before min_tokens), or None when it may choose any."""
        words = None
        if s.constraint is not None:
            words = np.full((self.vocab + 31) // 32, -1, np.int32)
            s.constraint.fill(words)
        if len(s.generated) < s.sampling.min_tokens and s.stop:
            words = np.full((self.vocab + 31) // 32, -1, np.int32) if words is None else words
            bits = words.view(np.uint32)
            for t in s.stop:
                if 0 <= t < self.vocab:
                    bits[t // 32] &= ~np.uint32(1 << (t % 32))
        return words

    def _wanted(self, call: _Call, producing: list[bool], allowed: list) -> set[mf.Role]:
        """The outputs to pull to the host for this call."""
        want = set()
        if call.entry.kind == mf.EntryKind.PREFILL_SCORED:
            want |= set(mf.SCORER_OUTPUTS) if any(s.sampling.prompt_logprobs for s in call.seqs) else \
                {mf.Role.PROMPT_LOGPROB, mf.Role.PROMPT_RANK}
        elif any(s.prompt_logprobs is not None and s.prefilled < len(s.prompt) for s in call.seqs):
            want.add(mf.Role.LOGITS)
        if self.sampler is not None:
            want.add(mf.Role.SAMPLED_TOKEN)
            if any(s.sampling.logprobs is not None for s in call.seqs):
                want.add(mf.Role.TOKEN_LOGPROB)
            if any(s.sampling.logprobs for s in call.seqs):
                want |= {mf.Role.TOP_LOGPROBS, mf.Role.TOP_IDS}
            return want
        want.add(mf.Role.NEXT_TOKEN)
        if any(p and (not s.sampling.plain or s.sampling.logprobs is not None or a is not None)
               for s, p, a in zip(call.seqs, producing, allowed)):
            want.add(mf.Role.LOGITS)
        return want

    def _token(self, out: dict, b: int, s: _Seq, allowed: np.ndarray | None, lsm: np.ndarray | None):
        """Row b's token, its logprob and top logprobs (None unless asked), from the body's sampler or, without
        one, sampled here from the pulled logits."""
        n = s.sampling.logprobs
        if self.sampler is not None:
            tok = int(out[mf.Role.SAMPLED_TOKEN][b])
            if allowed is not None and not (int(allowed.view(np.uint32)[tok // 32]) >> (tok % 32)) & 1:
                raise ValueError(f"the sampler chose token {tok}, which the mask forbids (no allowed token left?)")
            if n is None:
                return tok, None, None
            top = tuple(zip(out[mf.Role.TOP_IDS][b][:n].tolist(), out[mf.Role.TOP_LOGPROBS][b][:n].tolist())) \
                if n else ()
            return tok, float(out[mf.Role.TOKEN_LOGPROB][b]), top
        if mf.Role.LOGITS not in out:
            return int(out[mf.Role.NEXT_TOKEN][b]), None, None
        logits = out[mf.Role.LOGITS][b]
        if s.sampling.plain and allowed is None:
            tok = int(out[mf.Role.NEXT_TOKEN][b])
        else:
            extra = {}
            if s.sampling.penalized:
                extra.update(history=s.prompt + s.generated, generated=len(s.generated))
            if allowed is not None:
                extra["allowed"] = unpack_mask(allowed, self.vocab)
            tok = sample(logits, s.sampling, s.rng, **extra)
        if n is None:
            return tok, None, None
        lsm = log_softmax(logits) if lsm is None else lsm
        return tok, float(lsm[tok]), tuple(top_logprobs(lsm, n))

    def _sampler_inputs(self, e: mf.Entry, call: _Call, producing: list[bool], allowed: list) -> dict:
        """The sampler's inputs of a call, by role: a host array, or a device buffer of neutral rows kept for the
        entry when no row of the call needs that input (nothing is uploaded for it)."""
        sp, B, C = self.sampler, e.batch, e.context
        seqs = call.seqs
        out: dict = {}
        params = np.array([[NEUTRAL_ROW[c] for c in sp.columns]] * B, np.float32)
        seeds = np.zeros((B, 2), np.int32)
        steps = np.zeros(B, np.int32)
        for b, (s, p) in enumerate(zip(seqs, producing)):
            if p:
                params[b] = s.sampling.row(sp.columns)
                seeds[b] = seed_words(s.seed)
                steps[b] = len(s.generated)
        out[mf.Role.SAMPLING], out[mf.Role.RNG_SEED], out[mf.Role.RNG_STEP] = params, seeds, steps
        if not params[:, sp.columns.index("temperature")].any():
            # No row draws: no row reads its seed (a greedy row is argmax of the processed logits).
            del out[mf.Role.RNG_SEED]
            if (params == np.array([NEUTRAL_ROW[c] for c in sp.columns], np.float32)).all():
                # Nor its counter, which presence and frequency penalties also read (the generated tokens are
                # the history's last `step`): only when no row is penalised.
                del out[mf.Role.RNG_STEP], out[mf.Role.SAMPLING]
        if any(a is not None for a in allowed):
            mask = np.full((B, sp.mask_words), -1, np.int32)
            for b, a in enumerate(allowed):
                if a is not None:
                    mask[b] = a
            out[mf.Role.TOKEN_MASK] = mask
        if any(p and s.sampling.logit_bias for s, p in zip(seqs, producing)):
            ids = np.full((B, sp.logit_bias), -1, np.int32)
            vals = np.zeros((B, sp.logit_bias), np.float32)
            for b, (s, p) in enumerate(zip(seqs, producing)):
                if p and s.sampling.logit_bias:
                    pairs = s.sampling.logit_bias
                    ids[b, :len(pairs)] = [t for t, _ in pairs]
                    vals[b, :len(pairs)] = [v for _, v in pairs]
            out[mf.Role.LOGIT_BIAS_IDS], out[mf.Role.LOGIT_BIAS] = ids, vals
        if any(p and s.sampling.penalized for s, p in zip(seqs, producing)):
            history = np.full((B, C), -1, np.int32)
            for b, (s, row, p) in enumerate(zip(seqs, call.rows, producing)):
                if p:
                    tokens = (s.prompt + s.generated)[:row.start + len(row.token_ids)]
                    history[b, :len(tokens)] = tokens
            out[mf.Role.TOKEN_HISTORY] = history
        for role in mf.SAMPLER_INPUTS:
            if role not in out:
                out[role] = self._neutral_buffer(e, role)
        return out

    def _input_buffer(self, e: mf.Entry, role: mf.Role, value: np.ndarray) -> Buffer:
        """The device buffer of an input's host value: the one kept from the entry's previous call when the value is
        the same (never donated, so it outlives the call), else a new upload that replaces it."""
        key = (e.name, role)
        data = value.tobytes()            # the entry fixes the role's shape and dtype: the bytes say the value
        kept = self._kept_inputs.get(key)
        if kept is not None and kept[0] == data:
            return kept[1]
        buf = sharded.upload_whole(self.device, value)
        if kept is not None:
            sharded.close(kept[1])
        self._kept_inputs[key] = (data, buf)
        return buf

    def _neutral_buffer(self, e: mf.Entry, role: mf.Role) -> Buffer:
        key = (e.name, role)
        if key not in self._neutral:
            sig = e.inputs[e.input_index(role)]
            fill = {mf.Role.TOKEN_MASK: -1, mf.Role.LOGIT_BIAS_IDS: -1, mf.Role.TOKEN_HISTORY: -1}.get(role, 0)
            if role == mf.Role.SAMPLING:
                fill = np.array([NEUTRAL_ROW[c] for c in self.sampler.columns], np.float32)
            self._neutral[key] = sharded.upload_whole(
                self.device, np.broadcast_to(fill, sig.shape).astype(mf.numpy_dtype(sig.dtype)))
        return self._neutral[key]

    def _arg_plan(self, e: mf.Entry) -> list[tuple[_ArgSource, object, mf.Role]]:
        """Where each of the entry's arguments comes from, in signature order (made once per entry)."""
        plan = self._arg_plans.get(e.name)
        if plan is None:
            plan = []
            for sig in e.inputs:
                if (sig.role in mf.STEP_FIELDS or sig.role in mf.SAMPLER_INPUTS or sig.role in mf.SCORER_INPUTS
                        or sig.role in mf.DECODE_STEPS_INPUTS):
                    plan.append((_ArgSource.STEP, mf.STEP_FIELDS.get(sig.role, sig.role), sig.role))
                elif sig.role == mf.Role.POOL_IN:
                    plan.append((_ArgSource.POOL, sig.slot, sig.role))
                else:
                    plan.append((_ArgSource.WEIGHT, sig.slot, sig.role))
            self._arg_plans[e.name] = plan
        return plan

    def _execute(self, e: mf.Entry, inputs: dict, want: set[mf.Role] | bool) -> dict[mf.Role, np.ndarray]:
        """Run entry `e` on `inputs` (step inputs by field name, the sampler's by role: host arrays, or device
        buffers kept for the entry); -> the outputs of `want`, pulled to the host, by role. (want a bool, the
        earlier form that tests wrap: -> (NEXT_TOKEN, LOGITS or None).)"""
        if isinstance(want, bool):
            # The class's own method: `self._execute` may be the wrapper that called this one.
            out = Engine._execute(self, e, inputs, {mf.Role.NEXT_TOKEN} | ({mf.Role.LOGITS} if want else set()))
            return out[mf.Role.NEXT_TOKEN], out.get(mf.Role.LOGITS)
        exe = self._executable(e)
        check = self._runs < ADDRESS_CHECK_RUNS or e.name not in self._entries_checked
        args: list[sharded.Placed] = []
        pool_args: dict[int, str] = {}
        for i, (source, key, role) in enumerate(self._arg_plan(e)):
            if source is _ArgSource.STEP:
                value = inputs[key]
                if isinstance(value, np.ndarray):
                    buf = self._input_buffer(e, role, value)
                else:
                    buf = value          # a kept neutral buffer: read, never donated
            elif source is _ArgSource.POOL:
                buf = self.pools[key]
                pool_args[i] = key
            else:
                buf = self.weights[key]
            args.append(buf)
        before = {name: sharded.address(self.device, self.pools[name]) for name in pool_args.values()} if check else {}
        donated_outs = {o for o, _ in e.donations}
        keep = donated_outs | {i for i, sig in enumerate(e.outputs) if sig.role in want}
        outs = sharded.execute(self.device, exe, args, set(pool_args) if self.donate else set(), keep)
        for out_i, in_i in e.donations:
            name = pool_args[in_i]
            if not self.donate:
                sharded.close(self.pools[name])      # the control path: the updated pool is a new buffer
            self.pools[name] = outs[out_i]
        self._runs += 1
        self._stats["executions"] += 1
        by = self._stats["executions_by_entry"]
        by[e.name] = by.get(e.name, 0) + 1
        if check:
            self._entries_checked.add(e.name)
            moved = {n: (a, sharded.address(self.device, self.pools[n])) for n, a in before.items()}
            moved = {n: ab for n, ab in moved.items() if ab[0] != ab[1]}
            self._stats["pool_address_checks"] += 1
            self._stats["pool_in_place"] += int(not moved)
            if moved:
                log.warning("run %d (%s): pools moved (copied, not donated): %s", self._runs, e.name,
                            ", ".join(f"{n} {a} -> {b}" for n, (a, b) in moved.items()))
            else:
                log.debug("run %d (%s): pools updated in place", self._runs, e.name)
        pulled = {}
        for i, sig in enumerate(e.outputs):
            if i in donated_outs or outs[i] is None:
                continue
            if sig.role in want:
                pulled[sig.role] = self.device.to_host(sharded.first(outs[i]))
            sharded.close(outs[i])
        if mf.Role.LOGITS in want:
            self._stats["logits_pulled"] += 1
        if mf.Role.SAMPLED_TOKEN in want:
            self._stats["sampled_in_body"] += 1
        return pulled

    # -- conveniences ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16,
                 sampling: Sampling | None = None, stop_token_ids: Iterable[int] = ()) -> list[list[int]]:
        """Decode the prompts together; returns each one's new ids. Refuses (nothing admitted) if any is bad;
        raises RuntimeError naming the first sequence that failed. Its requests are released either way."""
        stop = tuple(stop_token_ids)
        rids: list[str] = []
        try:
            for p in prompts:
                rids.append(self.add_request(p, max_new_tokens, stop, sampling))
            while any(not self._seqs[r].finished for r in rids):
                self.step()
            for rid in rids:
                if self._seqs[rid].finish_reason == "error":
                    raise RuntimeError(f"request {rid} failed: {self._seqs[rid].error}")
            return [list(self._seqs[rid].generated) for rid in rids]
        finally:
            for rid in rids:
                self.release(rid)

    def stats(self) -> dict:
        st = dict(self._stats, executions_by_entry=dict(self._stats["executions_by_entry"]),
                  batch_sizes=dict(self._stats["batch_sizes"]))
        # The headline numbers are the first kind's in PoolKind order: paged KV pages when there are some.
        first = self.allocators[self.manifest.pool_kinds[0]]
        pools = {}
        for p in self.manifest.pools:     # pools of one kind share their allocator (pages, or state slots)
            a = self.allocators[p.kind]
            pools[p.name] = dict(kind=str(p.kind), pages_in_use=a.pages_in_use, pages_reserved=a.reserved,
                                 pages_free=a.free_pages, num_pages=a.num_pages)
        st.update(pages_in_use=first.pages_in_use, pages_free=first.free_pages, num_pages=first.num_pages,
                  pools=pools,
                  active_requests=len(self.active_requests()),
                  weight_bytes=self.weight_bytes, pool_bytes=self.pool_bytes, devices=self.device.devices,
                  bytes_per_device=sum(sharded.bytes_per_device(self.manifest)), entries=len(self.executables),
                  compile=self.compile_report(), load_seconds=self.load_seconds, donate=self.donate)
        return st

    def close(self) -> None:
        self.device.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def score_targets(call: _Call, batch: int, tokens: int) -> np.ndarray:
    """SCORE_TARGETS [B, T] of a scoring prefill: each position's next prompt token, right-aligned as the rows'
    tokens are (paging.build_step_inputs); -1 where there is none (padding, the prompt's last token)."""
    targets = np.full((batch, tokens), -1, np.int32)
    for b, (s, row) in enumerate(zip(call.seqs, call.rows)):
        n = len(row.token_ids)
        nxt = s.prompt[row.start + 1:row.start + n + 1]
        targets[b, tokens - n:tokens - n + len(nxt)] = nxt
    return targets


def prompt_scores(out: dict, b: int, s: _Seq, row: RowCall, tokens: int) -> list[tuple]:
    """Row b's prompt logprob entries from a scoring prefill's outputs: per position whose next token is a prompt
    token, (that token's logprob, its rank, the top (id, logprob) pairs the request asked for)."""
    n = len(row.token_ids)
    scored = min(n, len(s.prompt) - 1 - row.start)
    k = s.sampling.prompt_logprobs
    cols = range(tokens - n, tokens - n + scored)
    lp, rank = out[mf.Role.PROMPT_LOGPROB][b], out[mf.Role.PROMPT_RANK][b]
    if not k:
        return [(float(lp[c]), int(rank[c]), ()) for c in cols]
    ids, vals = out[mf.Role.PROMPT_TOP_IDS][b], out[mf.Role.PROMPT_TOP_LOGPROBS][b]
    return [(float(lp[c]), int(rank[c]), tuple(zip(ids[c, :k].tolist(), vals[c, :k].tolist()))) for c in cols]


def _check_stop(stop_token_ids: Iterable[int]) -> frozenset[int]:
    try:
        items = list(stop_token_ids)
    except TypeError:
        raise RequestRefused("bad_request", f"stop_token_ids must be an iterable of token ids, got "
                                            f"{type(stop_token_ids).__name__}") from None
    for t in items:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise RequestRefused("bad_request", f"stop_token_ids must be integer token ids, got {t!r}")
    return frozenset(int(t) for t in items)


def _check_sampling(sampling: Sampling | None) -> Sampling:
    """The request's sampling, checked again here: a frozen dataclass can still be changed after it was built."""
    if sampling is None:
        return GREEDY
    if not isinstance(sampling, Sampling):
        raise RequestRefused("bad_request", f"sampling must be a Sampling, got {type(sampling).__name__}")
    try:
        sampling.validate()
    except ValueError as e:
        raise RequestRefused("bad_request", f"bad sampling parameters: {e}") from None
    return sampling


# How refusals and logs name each kind's allocator and what it hands out.
_KIND_NAMES = {mf.PoolKind.PAGED_KV: ("KV", "pages"), mf.PoolKind.RING_KV: ("windowed KV", "pages"),
               mf.PoolKind.STATE_SLOTS: ("state", "slots")}
