"""EngineLoop: the one thread that owns the Engine (which is not thread-safe).

Request handlers hand it an admission (all of a request's sequences, queued together or refused together) and
later aborts, through a queue. Between steps the loop hands new requests to the engine, whose scheduler runs
up to `max_running` sequences at once (the others wait their turn there), then runs `engine.step()`. Each
step's tokens go back to their requests' sinks in one call per request. A request is refused (503) only when
`max_waiting` sequences already wait (for good, "exceeds_queue", when it alone holds more), or fails when it waited
longer than `max_wait_seconds` before any of its sequences started.

Work a sequence needs between its steps that can take long (a grammar advancing past the sampled token and
computing the next mask) runs on StepWork's thread, not on the loop's: before a step the loop waits for it at
most half a step's time, and a sequence whose work is not done yet sits that step out (Constraint.ready) while
the others run. A slow grammar slows its own sequence, never the others by more than half a step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from .engine import Constraint, Engine, RequestRefused
from .host_sampling import Sampling
from .metrics import Metrics
from .readiness import Readiness, get_ready

log = logging.getLogger("tlaloc_jax.serve.loop")


@dataclass(frozen=True)
class SeqSpec:
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    sampling: Sampling
    constraint: Constraint | None = None
    single_step: bool = False        # stop strings: the server checks each token (engine.add_request)
    cache_salt: str | None = None    # shares cached prefixes only with the same salt (engine.add_request)
    priority: int = 0                # lower runs first (engine.add_request)
    lora: str | None = None          # the LoRA adapter it runs with (engine.add_request)


@dataclass(frozen=True)
class Update:
    """A token of one of a request's sequences (token None: the sequence failed; request_error: through its own
    request's fault, its grammar or min_tokens), with its logprobs when asked (engine.StepEvent)."""

    seq: int
    token: int | None
    finished: bool
    reason: str | None = None
    error: str | None = None
    logprob: float | None = None
    top_logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None
    request_error: bool = False


Sink = Callable[[list[Update]], None]


class StepWork:
    """A thread for work due before a sequence's next step (serve/openai/structured.py submits each grammar step here).
    `wait(timeout)` returns once no job is pending or at the timeout; `on_done` runs when a job ends (the loop
    uses it to wake up when only sequences waiting on their work are running)."""

    def __init__(self, workers: int = 1):
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="tlaloc-step-work")
        self._pending: set[cf.Future] = set()
        self._lock = threading.Lock()
        self.on_done: Callable[[], None] | None = None

    def submit(self, fn: Callable, *args) -> cf.Future:
        fut = self._pool.submit(fn, *args)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: cf.Future) -> None:
        with self._lock:
            self._pending.discard(fut)
        if self.on_done is not None:
            self.on_done()

    def wait(self, timeout: float) -> None:
        with self._lock:
            pending = list(self._pending)
        if pending:
            cf.wait(pending, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Arrival:
    """A request the server is reading (its body, prompt and checks) before it submits it to the loop: while any
    is open, a step that would only start new prompts waits a little for it (EngineLoop.arrival_wait_s). Closed
    by the submit, or by the server when the request ends before it (idempotent)."""

    def __init__(self, loop: "EngineLoop"):
        self._loop = loop
        self._open = True
        loop._count_arrival(1)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._loop._count_arrival(-1)


@dataclass
class _Admission:
    specs: list[SeqSpec]
    sink: Sink
    arrival: float
    future: cf.Future
    started: bool = False           # one of its sequences has started: the others no longer count as waiting


@dataclass
class _Running:
    sink: Sink
    seq: int
    arrival: float
    admission: _Admission


class EngineLoop:
    """The one thread that drives the Engine. Everything else talks to it through `submit`, `abort`, `call`."""

    def __init__(self, engine: Engine, max_running: int, metrics: Metrics, max_waiting: int = 1024,
                 max_wait_seconds: float | None = None, step_work: StepWork | None = None, warm_up: bool = True,
                 compile_all: bool = False, progress: str | None = "log"):
        self.engine = engine
        self.max_running = max_running
        engine.scheduler.configure(max_num_seqs=max_running)
        self.max_waiting = max_waiting
        self.max_wait_seconds = max_wait_seconds
        self.metrics = metrics
        self.step_work = step_work or StepWork()
        self.step_work.on_done = self._wake
        self._step_seconds = 0.0            # a running mean of the steps that ran calls
        self.steps = 0                      # the steps that ran calls (read by tests to count delays in steps)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[_Admission] = deque()
        self._running: dict[str, _Running] = {}
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        # Requests that arrive together (clients of a closed loop whose answers ended in one step) are read one
        # after another; a step that would only start new prompts waits up to this long for those still being
        # read, so that they share its calls instead of waiting for a call of the first one alone.
        self.arrival_wait_s = 0.02
        # Requests read one after another open their Arrival a few ms apart: the wait also lasts while the last one
        # came under arrival_gap_s ago, though none is being read at that moment.
        self.arrival_gap_s = 0.005
        self._last_arrival = float("-inf")
        # Once nothing has run nor come for warm_up_idle_s, the loop warms the entries not yet run, one call at a time
        # (Engine.warm_up): not in the brief idle moment between a closed loop's requests, which would wait for it.
        self.warm_up = warm_up
        self.warm_up_idle_s = 0.5
        # compile_all: the loop compiles every entry in neither compile cache, and waits for a preloading Runner's
        # loads (readiness.get_ready), before its first step; `readiness.reason()` says how far it got. None: it serves
        # at once, entries compile on first use.
        loading = len(engine.runner.loading()) + sum(name is not None for name, _ in engine.runner.background())
        words = ("loading or compiling", "loaded or compiled") if loading else ("compiling", "compiled")
        self.readiness = Readiness(len(engine.entries_to_compile()) + loading, progress, words) if compile_all else None
        self._idle_since = time.perf_counter()
        self._arriving = 0
        self._arriving_lock = threading.Lock()
        self._held_since: float | None = None

    # called from other threads

    def start(self) -> None:
        """Start the loop thread: refused while another loop runs on the same Engine (one thread drives an Engine;
        two servers on one Engine would each have the other's steps refused mid-request)."""
        other = self.engine.serving_loop
        if other is not None and other is not self and other.alive:
            raise RuntimeError("EngineLoop.start: another engine loop runs on this Engine (a server on it has not "
                               "stopped); stop it first, or load the artifact again for a second server")
        self.engine.serving_loop = self
        self._thread = threading.Thread(target=self._run, name="tlaloc-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, warn_every: float = 30.0) -> None:
        """Fail what is pending and end the loop thread. Returns once the thread has ended (after the step or warm-up
        it is in): until then it drives the Engine, and a later loop on the same Engine would be refused its steps."""
        if self._thread is not None:
            self._cmds.put(("stop",))
            self._thread.join(warn_every)
            while self._thread.is_alive():
                log.warning("stopping: the engine loop is still in its step; waiting for it to end")
                self._thread.join(warn_every)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def arriving(self) -> Arrival:
        """Say that a request is being read; pass it to submit (or close it if the request ends first)."""
        return Arrival(self)

    def _count_arrival(self, n: int) -> None:
        with self._arriving_lock:
            self._arriving += n
            self._last_arrival = time.perf_counter()
        if n < 0:
            self._wake()

    def submit(self, specs: list[SeqSpec], sink: Sink, arrival: float, ticket: Arrival | None = None) -> cf.Future:
        """Admit all of `specs` or none; the future gives their engine ids or raises RequestRefused."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("add", _Admission(specs, sink, arrival, fut)))
        if ticket is not None:
            ticket.close()
        return fut

    def abort(self, rids, reason: str) -> None:
        if rids:
            self._cmds.put(("abort", tuple(rids), reason))

    def _wake(self) -> None:
        self._cmds.put(("wake",))

    def call(self, fn: Callable[["EngineLoop"], Any]) -> cf.Future:
        """Run fn(loop) on the loop thread, between steps (for reading the engine's state)."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("call", fn, fut))
        return fut

    # the loop thread

    def _run(self) -> None:
        stalled = False     # the last step ran nothing: every running sequence waits on its step work
        try:
            if self.readiness is not None and not self._get_ready():
                return
            while True:
                idle = not self._running and not self._waiting
                cold = self.engine.cold_entries() if idle and self.warm_up else []
                warm_in = self.warm_up_idle_s - (time.perf_counter() - self._idle_since) if cold else None
                if warm_in is not None and warm_in <= 0 and self._cmds.empty():
                    self._warm_one(cold[0])
                    continue
                cmds = []
                try:
                    # Stalled, the loop sleeps until a job ends (a "wake") or a command comes; the timeout is a
                    # safety net only.
                    held = None if idle else self._hold_left()
                    timeout = (warm_in if warm_in is not None and warm_in > 0 else None) if idle else \
                        held if held is not None else 0.05
                    if idle and timeout is None and self.warm_up and self.engine.runner.still_loading():
                        timeout = 0.25      # entries load in the background: warm each once loaded
                    cmds.append(self._cmds.get(block=idle or stalled or held is not None, timeout=timeout))
                    while True:
                        cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                if not idle or any(cmd[0] == "add" for cmd in cmds):
                    self._idle_since = time.perf_counter()
                for cmd in cmds:
                    if cmd[0] == "stop":
                        self._fail_all("the server is shutting down")
                        return
                    self._handle(cmd)
                self._expire()          # before admitting: a new request gets one step's chance to start first
                self._admit()
                stalled = False
                if self._running and self._hold_left() is not None:
                    continue            # requests still being read join this step's prompts
                if self._running:
                    self._held_since = None
                    # Work due before this step (a grammar's next mask) gets at most half a step to finish.
                    self.step_work.wait(max(0.0002, 0.5 * self._step_seconds))
                    t0 = time.perf_counter()
                    self._step()
                    if self.engine.last_step_calls:
                        self.steps += 1
                        self._step_seconds += 0.1 * (time.perf_counter() - t0 - self._step_seconds)
                    else:
                        stalled = True
        except BaseException as e:  # noqa: BLE001 - a bug in the loop: fail what is pending, /health says so
            log.exception("engine loop failed")
            self.failure = e
            self._fail_all("the engine loop failed; the server log has the cause")

    def _hold_left(self) -> float | None:
        """How much longer the next step waits for requests still being read, or for one more while the last came
        under arrival_gap_s ago (None: it need not wait): only while every running sequence is new (nothing decodes,
        no prompt has started) and the wait began under arrival_wait_s ago."""
        now = time.perf_counter()
        gap = self.arrival_gap_s - (now - self._last_arrival)
        if not (self._arriving or gap > 0) or any(s.first_scheduled is not None for s in self.engine.scheduler.running):
            return None
        if self._held_since is None:
            self._held_since = now
        left = self.arrival_wait_s - (now - self._held_since)
        if not self._arriving:
            left = min(left, gap)
        return left if left > 0 else None

    def _handle_pending(self) -> bool:
        """Handle the commands queued so far; -> False on a stop (what was pending failed)."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True
            if cmd[0] == "stop":
                self._fail_all("the server is shutting down")
                return False
            self._handle(cmd)

    def _get_ready(self) -> bool:
        """readiness.get_ready, handling commands meanwhile. -> False on a stop."""
        return get_ready(self.readiness, self.engine, self._handle_pending)

    def _warm_one(self, e) -> None:
        """Warm one entry (Engine.warm_up); a failure is logged, not retried (the entry counts as warmed)."""
        try:
            self.engine.warm_up(e)
        except Exception as err:  # noqa: BLE001 - the entry's first request fails the same way, by name
            log.error("warming up %s failed: %s", e.name, err)

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            self._waiting.append(cmd[1])
            self._last_arrival = time.perf_counter()
        elif cmd[0] == "abort":
            for rid in cmd[1]:
                self._end(rid, cmd[2])
        elif cmd[0] == "call":
            fn, fut = cmd[1], cmd[2]
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _admit(self) -> None:
        while self._waiting:
            adm = self._waiting.popleft()
            if not adm.future.set_running_or_notify_cancel():
                continue                    # the client went away while it waited
            if len(adm.specs) > self.max_waiting:
                adm.future.set_exception(RequestRefused(
                    "exceeds_queue", f"{len(adm.specs)} sequences in one request, and the server's --max-waiting is "
                                     f"{self.max_waiting}: it could never be admitted"))
                continue
            waiting = len(self.engine.scheduler.waiting)
            if waiting + len(adm.specs) > self.max_waiting:
                adm.future.set_exception(RequestRefused(
                    "queue_full", f"{waiting} sequences wait to run (the server's --max-waiting is {self.max_waiting})"))
                continue
            rids: list[str] = []
            try:
                for spec in adm.specs:
                    rids.append(self.engine.add_request(spec.prompt, spec.max_new_tokens, spec.stop_token_ids,
                                                        spec.sampling, constraint=spec.constraint,
                                                        single_step=spec.single_step, priority=spec.priority,
                                                        cache_salt=spec.cache_salt, lora=spec.lora))
            except Exception as e:  # noqa: BLE001 - RequestRefused, or a bug: nothing of it stays admitted
                for rid in rids:
                    self.engine.release(rid)
                adm.future.set_exception(e)
                continue
            for i, rid in enumerate(rids):
                self._running[rid] = _Running(adm.sink, i, adm.arrival, adm)
            adm.future.set_result(rids)

    def _expire(self) -> None:
        """Fail the sequences that waited past max_wait_seconds without starting (not while the loop itself holds
        their first step for arrivals, at most arrival_wait_s). The wait is the request's: once one of its sequences
        has started, the others wait behind their own request, not the queue (n > --max-num-seqs runs its choices
        one after another)."""
        if not self.max_wait_seconds or self._held_since is not None:
            return
        sched = self.engine.scheduler
        for s in (*sched.running, *sched.waiting):
            run = self._running.get(s.rid)
            if run is not None and s.first_scheduled is not None:
                run.admission.started = True
        now = time.perf_counter()
        late: dict[int, tuple[Sink, list[Update]]] = {}
        for s in list(sched.waiting):
            run = self._running.get(s.rid)
            if run is None or run.admission.started or now - run.arrival <= self.max_wait_seconds:
                continue
            self._end(s.rid, "timeout")
            late.setdefault(id(run.sink), (run.sink, []))[1].append(Update(
                run.seq, None, True, "timeout", f"waited {now - run.arrival:.1f} s without starting (the server's "
                                                f"--max-wait-seconds is {self.max_wait_seconds:g})"))
        for sink, updates in late.values():
            _deliver(sink, updates)

    def _step(self) -> None:
        try:
            events = self.engine.step(on_events=self._send)     # each call's tokens go out as soon as it has run
        except Exception:  # noqa: BLE001 - a bug in the engine: the running requests fail; the loop goes on
            log.exception("engine step failed")
            self._fail_all("an engine step failed; the server log has the cause")
            return
        for ev in events:                       # forgotten once the step is over
            if ev.finished:
                self._end(ev.request_id, ev.finish_reason or "stop")

    def _send(self, events: list) -> None:
        """Each running request's updates of these events, one delivery per request."""
        out: dict[int, tuple[Sink, list[Update]]] = {}
        for ev in events:
            run = self._running.get(ev.request_id)
            if run is None:
                continue
            run.admission.started = True        # a sequence that started and ended between two _expire calls
            out.setdefault(id(run.sink), (run.sink, []))[1].append(
                Update(run.seq, ev.token, ev.finished, ev.finish_reason, ev.error, ev.logprob, ev.top_logprobs,
                       ev.prompt_logprobs, ev.request_error))
        for sink, updates in out.values():
            _deliver(sink, updates)

    def _end(self, rid: str, reason: str) -> None:
        """Forget a running sequence: abort it if it still runs, record its times, free its pages."""
        run = self._running.pop(rid, None)
        if run is None:
            return
        self.engine.abort(rid)
        self.metrics.observe_sequence(self.engine.request_info(rid), run.arrival, reason)
        self.engine.release(rid)

    def _fail_all(self, message: str) -> None:
        for adm in self._waiting:
            if adm.future.set_running_or_notify_cancel():
                adm.future.set_exception(RuntimeError(message))
        self._waiting.clear()
        sinks: dict[int, tuple[Sink, list[Update]]] = {}
        for rid, run in list(self._running.items()):
            with contextlib.suppress(Exception):
                self._end(rid, "error")
            self._running.pop(rid, None)
            sinks.setdefault(id(run.sink), (run.sink, []))[1].append(Update(run.seq, None, True, "error", message))
        for sink, updates in sinks.values():
            _deliver(sink, updates)

    def snapshot(self) -> dict:
        """The engine's counters plus the loop's queue (call on the loop thread)."""
        st = self.engine.stats()
        queued = [spec for a in self._waiting for spec in a.specs]
        if "lora" in st:        # requests still in the loop's queue wait too
            waiting = st["lora"]["waiting"]
            for spec in queued:
                if spec.lora is not None:
                    waiting[spec.lora] = waiting.get(spec.lora, 0) + 1
        return dict(st, waiting=st["waiting"] + len(queued), cold_entries=len(self.engine.cold_entries()))


def _deliver(sink: Sink, updates: list[Update]) -> None:
    try:
        sink(updates)
    except RuntimeError:        # the request's event loop has closed (shutdown)
        pass


class Inbox:
    """A request's end of the loop: updates arrive on its asyncio queue, one list per engine step."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list[Update]] = asyncio.Queue()

    def __call__(self, updates: list[Update]) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, updates)
