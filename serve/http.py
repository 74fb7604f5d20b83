"""An OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn; JAX-free).

    app = create_app(Engine.load("artifact/"))          # or: python -m tlaloc_jax.serve artifact/
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions and POST /v1/chat/completions (`stream: true` answers with server-sent
events in OpenAI's chunk format), GET /v1/models, GET /health, GET /metrics (Prometheus text format).

One engine loop thread owns the Engine (which is not thread-safe). Request handlers run on the asyncio
loop: they tokenize, then hand the loop an admission (all of a request's sequences, admitted together
or not at all) and later aborts, through a queue. Between steps the loop admits waiting requests (up to
`max_batch` running sequences; more wait their turn), then runs `engine.step()`, which advances every
running sequence: their decode tokens share calls. Each step's tokens go back to their requests'
asyncio queues in one wake-up per request. A client that disconnects, or a choice that meets a stop
string, aborts its sequences and frees their pages at the next step boundary.

Errors are OpenAI-style JSON, {"error": {"message", "type", "param", "code"}}:
  400  malformed JSON, an unknown field, a field of the wrong type or value, a placeholder or
       out-of-vocabulary token id, a prompt longer than the largest context, max_tokens past it
  401  a missing or wrong API key (when the server has one)
  404  an unknown model or route
  413  a body over the size limit
  503  the KV page pool is full (code "kv_pool_exhausted", Retry-After: 1). Nothing was admitted;
       the same request succeeds once other sequences end. (503 rather than 429: the server is
       momentarily out of capacity, the client is not over a rate limit; the openai client retries
       both, honouring Retry-After.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import hmac
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, RequestRefused
from .sampling import Sampling
from .tokenizer import ChatTemplateError, IncrementalDetokenizer, StopStrings, TextTokenizer, load_tokenizer

log = logging.getLogger("tlaloc_jax.serve.http")

DEFAULT_MAX_BODY_BYTES = 1 << 20
MAX_SEQS_PER_REQUEST = 64          # prompts x n
RETRY_AFTER_S = 1
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


# -- errors ------------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _refusal(e: RequestRefused, prompt_param: str, longest_prompt: int, max_context: int) -> APIError:
    """The engine's refusal as an HTTP error; its message names the cause."""
    msg = str(e)
    if e.kind == "pool_exhausted":
        return APIError(503, msg, type="service_unavailable_error", code="kv_pool_exhausted",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if e.kind == "too_long":
        param = prompt_param if longest_prompt > max_context else "max_tokens"
        return APIError(400, msg, param=param, code="context_length_exceeded")
    code = {"placeholder_token": "placeholder_token", "out_of_vocabulary": "out_of_vocabulary",
            "empty_prompt": "empty_prompt"}.get(e.kind)
    return APIError(400, msg, param=prompt_param if code else None, code=code)


# -- request validation ------------------------------------------------------------------------------

_JSON_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
               dict: "an object", type(None): "null"}


def _bad_type(name: str, want: str, value: Any) -> APIError:
    got = _JSON_NAMES.get(type(value), type(value).__name__)
    return APIError(400, f"Invalid type for '{name}': expected {want}, but got {got} instead.", param=name,
                    code="invalid_type")


def _bad_value(name: str, why: str) -> APIError:
    return APIError(400, f"Invalid value for '{name}': {why}", param=name, code="invalid_value")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(lo: int | None = None, hi: int | None = None):
    def check(name, v):
        if not _is_int(v):
            raise _bad_type(name, "an integer", v)
        if lo is not None and v < lo:
            raise _bad_value(name, f"must be >= {lo}, got {v}.")
        if hi is not None and v > hi:
            raise _bad_value(name, f"must be <= {hi}, got {v}.")
        return v
    return check


def _number(lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False):
    def check(name, v):
        if not (_is_int(v) or isinstance(v, float)):
            raise _bad_type(name, "a number", v)
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            raise _bad_value(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}.")
        return float(v)
    return check


def _bool(name, v):
    if not isinstance(v, bool):
        raise _bad_type(name, "a boolean", v)
    return v


def _str(name, v):
    if not isinstance(v, str):
        raise _bad_type(name, "a string", v)
    return v


def _unsupported(*allowed):
    """A field OpenAI defines that this server serves only at its neutral value."""
    def check(name, v):
        if v in allowed and type(v) in {type(a) for a in allowed}:
            return v
        raise APIError(400, f"'{name}' = {json.dumps(v)} is not supported by this server (only "
                            f"{' or '.join(json.dumps(a) for a in allowed)}).", param=name, code="unsupported_parameter")
    return check


def _token_ids(name, v):
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise _bad_type(name, "an array of integer token ids", v)
    return list(v)


def _stop(name, v):
    """`stop`: a string or an array of strings and (an extension) integer token ids."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) or _is_int(s) for s in items):
        raise _bad_type(name, "a string or an array of strings and token ids", v)
    if any(s == "" for s in items):
        raise _bad_value(name, "stop strings must not be empty.")
    if len(items) > 64:
        raise _bad_value(name, f"at most 64 stop sequences, got {len(items)}.")
    return items


def _stream_options(name, v):
    if not isinstance(v, dict):
        raise _bad_type(name, "an object", v)
    for k, x in v.items():
        if k not in ("include_usage", "continuous_usage_stats"):
            raise APIError(400, f"Unrecognized request argument supplied: {name}.{k}", param=f"{name}.{k}",
                           code="unknown_parameter")
        _bool(f"{name}.{k}", x)
    return v


def _prompt(name, v):
    """-> ("text", [str, ...]) or ("ids", [[int, ...], ...]): one prompt or a batch of them."""
    want = "a string, an array of strings, an array of token ids or an array of arrays of token ids"
    if isinstance(v, str):
        return "text", [v]
    if not isinstance(v, list):
        raise _bad_type(name, want, v)
    if not v or all(_is_int(t) for t in v):
        return "ids", [list(v)]
    if all(isinstance(p, str) for p in v):
        return "text", list(v)
    if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in v):
        return "ids", [list(p) for p in v]
    raise _bad_type(name, want, v)


def _messages(name, v):
    if not isinstance(v, list):
        raise _bad_type(name, "an array of messages", v)
    if not v:
        raise _bad_value(name, "must hold at least one message.")
    out = []
    for i, m in enumerate(v):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise _bad_type(where, "an object", m)
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise _bad_type(f"{where}.role", "a string", role)
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise APIError(400, f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                        "are served; this artifact is the text decoder", param=f"{where}.content",
                                   code="invalid_value")
                parts.append(p["text"])
            content = "\n".join(parts)
        elif content is not None and not isinstance(content, str):
            raise _bad_type(f"{where}.content", "a string or an array of text parts", content)
        msg = {"role": role, "content": content if content is not None else ""}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _opt(check):
    return lambda name, v: None if v is None else check(name, v)


_COMMON = {
    "model": _opt(_str),
    "max_tokens": _opt(_int(lo=1)),
    "temperature": _opt(_number(lo=0.0)),
    "top_p": _opt(_number(lo=0.0, hi=1.0, lo_open=True)),
    "top_k": _opt(_int(lo=-1)),
    "seed": _opt(_int()),
    "stop": _opt(_stop),
    "stop_token_ids": _opt(_token_ids),
    "n": _opt(_int(lo=1, hi=MAX_SEQS_PER_REQUEST)),
    "stream": _opt(_bool),
    "stream_options": _opt(_stream_options),
    "return_token_ids": _opt(_bool),
    "ignore_eos": _opt(_bool),
    "user": _opt(_str),
    "presence_penalty": _opt(_unsupported(0, 0.0)),
    "frequency_penalty": _opt(_unsupported(0, 0.0)),
    "logit_bias": _opt(_unsupported({})),
}
_COMPLETION_FIELDS = {**_COMMON, "prompt": _prompt, "echo": _opt(_unsupported(False)),
                      "suffix": _opt(_unsupported("")), "logprobs": _opt(_unsupported(0)),
                      "best_of": _opt(_unsupported(1))}
_CHAT_FIELDS = {**_COMMON, "messages": _messages, "max_completion_tokens": _opt(_int(lo=1)),
                "logprobs": _opt(_unsupported(False)), "top_logprobs": _opt(_unsupported(0)),
                "add_generation_prompt": _opt(_bool),
                # Tool calling and structured output are not served; clients that send the neutral values pass.
                "tools": _opt(_unsupported([])), "tool_choice": _opt(_unsupported("none")),
                "parallel_tool_calls": _opt(_unsupported(True, False)),
                "response_format": _opt(_unsupported({"type": "text"}))}


def _validate(body: dict, fields: dict, required: str) -> dict:
    for k in body:
        if k not in fields:
            raise APIError(400, f"Unrecognized request argument supplied: {k}", param=k, code="unknown_parameter")
    if body.get(required) is None:
        raise APIError(400, f"Missing required parameter: '{required}'.", param=required,
                       code="missing_required_parameter")
    return {k: check(k, body.get(k)) for k, check in fields.items()}


# -- the engine loop ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _SeqSpec:
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    sampling: Sampling


@dataclass(frozen=True)
class _Update:
    """A token of one of a request's sequences (token None: the sequence failed)."""

    seq: int
    token: int | None
    finished: bool
    reason: str | None = None
    error: str | None = None


Sink = Callable[[list[_Update]], None]


@dataclass
class _Admission:
    specs: list[_SeqSpec]
    sink: Sink
    arrival: float
    future: cf.Future


@dataclass
class _Running:
    sink: Sink
    seq: int
    arrival: float


class EngineLoop:
    """The one thread that drives the Engine. Everything else talks to it through `submit`, `abort`, `call`."""

    def __init__(self, engine: Engine, max_running: int, metrics: "_Metrics"):
        self.engine = engine
        self.max_running = max_running
        self.metrics = metrics
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[_Admission] = deque()
        self._running: dict[str, _Running] = {}
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    # called from other threads

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tlaloc-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._cmds.put(("stop",))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, specs: list[_SeqSpec], sink: Sink, arrival: float) -> cf.Future:
        """Admit all of `specs` or none; the future gives their engine ids or raises RequestRefused."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("add", _Admission(specs, sink, arrival, fut)))
        return fut

    def abort(self, rids, reason: str) -> None:
        if rids:
            self._cmds.put(("abort", tuple(rids), reason))

    def call(self, fn: Callable[["EngineLoop"], Any]) -> cf.Future:
        """Run fn(loop) on the loop thread, between steps (for reading the engine's state)."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("call", fn, fut))
        return fut

    # the loop thread

    def _run(self) -> None:
        try:
            while True:
                idle = not self._running and not self._waiting
                cmds = []
                try:
                    cmds.append(self._cmds.get(block=idle))
                    while True:
                        cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                for cmd in cmds:
                    if cmd[0] == "stop":
                        self._fail_all("the server is shutting down")
                        return
                    self._handle(cmd)
                self._admit()
                if self._running:
                    self._step()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop: fail what is pending, /health says so
            log.exception("engine loop failed")
            self.failure = e
            self._fail_all(f"engine loop failed: {e}")

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            self._waiting.append(cmd[1])
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
            adm = self._waiting[0]
            if self._running and len(self._running) + len(adm.specs) > self.max_running:
                return
            self._waiting.popleft()
            if not adm.future.set_running_or_notify_cancel():
                continue                    # the client went away while it waited
            rids: list[str] = []
            try:
                for spec in adm.specs:
                    rids.append(self.engine.add_request(spec.prompt, spec.max_new_tokens, spec.stop_token_ids,
                                                        spec.sampling))
            except Exception as e:  # noqa: BLE001 - RequestRefused, or a bug: nothing of it stays admitted
                for rid in rids:
                    self.engine.release(rid)
                adm.future.set_exception(e)
                continue
            for i, rid in enumerate(rids):
                self._running[rid] = _Running(adm.sink, i, adm.arrival)
            adm.future.set_result(rids)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the running requests fail; the loop goes on serving
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {e}")
            return
        out: dict[int, tuple[Sink, list[_Update]]] = {}
        for ev in events:
            run = self._running.get(ev.request_id)
            if run is None:
                continue
            if ev.finished:
                self._end(ev.request_id, ev.finish_reason or "stop")
            out.setdefault(id(run.sink), (run.sink, []))[1].append(
                _Update(run.seq, ev.token, ev.finished, ev.finish_reason, ev.error))
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
        sinks: dict[int, tuple[Sink, list[_Update]]] = {}
        for rid, run in list(self._running.items()):
            with contextlib.suppress(Exception):
                self._end(rid, "error")
            self._running.pop(rid, None)
            sinks.setdefault(id(run.sink), (run.sink, []))[1].append(_Update(run.seq, None, True, "error", message))
        for sink, updates in sinks.values():
            _deliver(sink, updates)

    def snapshot(self) -> dict:
        """The engine's counters plus the loop's queue (call on the loop thread)."""
        return dict(self.engine.stats(), running=len(self._running),
                    waiting=sum(len(a.specs) for a in self._waiting))


def _deliver(sink: Sink, updates: list[_Update]) -> None:
    try:
        sink(updates)
    except RuntimeError:        # the request's event loop has closed (shutdown)
        pass


class _Inbox:
    """A request's end of the loop: updates arrive on its asyncio queue, one list per engine step."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list[_Update]] = asyncio.Queue()

    def __call__(self, updates: list[_Update]) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, updates)


# -- metrics -----------------------------------------------------------------------------------------

class _Metrics:
    """Prometheus metrics in a registry of their own (several apps may live in one process)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.http = Counter("tlaloc_http_requests", "HTTP requests by route and status code", ["route", "status"],
                            registry=r)
        self.finished = Counter("tlaloc_sequences_finished", "Sequences ended, by reason "
                                "(stop, length, abort: client gone, error)", ["reason"], registry=r)
        self.queue_time = Histogram("tlaloc_request_queue_seconds", "Arrival to the first call that reads the "
                                    "sequence", buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tlaloc_time_to_first_token_seconds", "Arrival to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tlaloc_inter_token_latency_seconds", "Time between a sequence's consecutive tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tlaloc_request_seconds", "Arrival to a sequence's end", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.engine = _EngineCollector()
        r.register(self.engine)

    def observe_sequence(self, info, arrival: float, reason: str) -> None:
        self.finished.labels(reason).inc()
        if info.first_scheduled is not None:
            self.queue_time.observe(max(0.0, info.first_scheduled - arrival))
        if info.first_token_time is not None:
            self.ttft.observe(max(0.0, info.first_token_time - arrival))
        times = info.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        self.e2e.observe(time.perf_counter() - arrival)


class _EngineCollector:
    """The engine's own counters, from a snapshot the /metrics handler takes on the loop thread."""

    def __init__(self):
        self.snapshot: dict | None = None

    def describe(self):
        return []

    def collect(self):
        s = self.snapshot
        if s is None:
            return
        for name, key, doc in (("tlaloc_engine_steps", "steps", "Engine scheduling steps that produced tokens"),
                               ("tlaloc_engine_executions", "executions", "Compiled-entry executions (calls)"),
                               ("tlaloc_engine_prefill_calls", "prefill_calls", "Prefill executions"),
                               ("tlaloc_engine_decode_calls", "decode_calls", "Decode executions"),
                               ("tlaloc_prompt_tokens", "prompt_tokens", "Prompt tokens prefilled"),
                               ("tlaloc_generation_tokens", "tokens_generated", "Tokens generated"),
                               ("tlaloc_requests_refused", "requests_refused", "Sequences the engine refused")):
            yield CounterMetricFamily(name, doc, value=s[key])
        for name, key, doc in (("tlaloc_kv_pages_in_use", "pages_in_use", "KV pages held by sequences"),
                               ("tlaloc_kv_pages_total", "num_pages", "KV pages in the pool"),
                               ("tlaloc_requests_running", "running", "Sequences admitted to the engine"),
                               ("tlaloc_requests_waiting", "waiting", "Sequences waiting for a batch slot")):
            yield GaugeMetricFamily(name, doc, value=s[key])
        for name, key, doc in (("tlaloc_pool_pages_in_use", "pages_in_use", "Pages held by sequences, per pool"),
                               ("tlaloc_pool_pages_total", "num_pages", "Pages per pool")):
            g = GaugeMetricFamily(name, doc, labels=["pool"])
            for pool, st in (s.get("pools") or {}).items():
                g.add_metric([pool], st[key])
            yield g
        sizes = s["batch_sizes"]
        buckets = []
        for le in _BATCH_BUCKETS:
            buckets.append((str(le), sum(c for b, c in sizes.items() if b <= le)))
        buckets.append(("+Inf", sum(sizes.values())))
        yield HistogramMetricFamily("tlaloc_batch_size", "Sequences per execution (its sum: sequence-steps run)",
                                    buckets=buckets, sum_value=sum(b * c for b, c in sizes.items()))


class _CountRequests:
    """ASGI middleware: count every HTTP answer by route and status (streams included)."""

    def __init__(self, app, metrics: _Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            route = scope["path"] if scope["path"] in _ROUTES else "other"
            self.metrics.http.labels(route, str(status["code"])).inc()


# -- a request's sequences ---------------------------------------------------------------------------

@dataclass
class _Choice:
    """One generated sequence of a request: its ids, its text (stop strings cut), what was sent so far."""

    index: int
    prompt: list[int]
    detok: IncrementalDetokenizer | None
    stops: StopStrings | None
    eos: frozenset[int]
    rid: str = ""
    ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_text: int = 0
    sent_ids: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    reported: bool = False          # the finish chunk went out
    needs_abort: bool = False       # a stop string ended it while the engine still runs it

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def apply(self, u: _Update) -> bool:
        if self.done:
            return False                # tokens already in flight after a stop string
        if u.token is None:
            self.finish_reason, self.error = "error", u.error or "the sequence failed"
            return True
        self.ids.append(u.token)
        stop_token = u.finished and u.reason == "stop"
        if self.detok is not None:
            # A stop token's own text is not output (the eos token is special and decodes to nothing anyway).
            piece = "" if stop_token else self.detok.add(u.token)
            if u.finished:
                piece += self.detok.flush()
            start = len(self.text)
            self.text += piece
            hit = self.stops.find(self.text, start) if self.stops and piece else None
            if hit is not None:
                self.text = self.text[:hit[0]]
                self.finish_reason, self.stop_reason = "stop", hit[1]
                self.needs_abort = not u.finished
                return True
        if u.finished:
            self.finish_reason = "stop" if stop_token else "length"
            self.stop_reason = u.token if stop_token and u.token not in self.eos else None
        return True

    def take_text(self) -> str:
        """The text not sent yet, less the tail that could still become a stop string."""
        end = len(self.text)
        if not self.done and self.stops is not None:
            end = max(self.sent_text, end - self.stops.holdback)
        out = self.text[self.sent_text:end]
        self.sent_text = end
        return out

    def take_ids(self) -> list[int]:
        out = self.ids[self.sent_ids:]
        self.sent_ids = len(self.ids)
        return out


class _Generation:
    """A request's sequences: admitted together, their updates applied as they arrive."""

    def __init__(self, server: "_Server", prompts: list[list[int]], n: int, max_tokens: list[int],
                 stop_ids: frozenset[int], stops: StopStrings | None, sampling: list[Sampling], arrival: float):
        self.server = server
        self.prompts = prompts
        tok = server.tokenizer
        self.choices = [_Choice(i * n + j, p, tok.detokenizer(p) if tok else None, stops, server.eos)
                        for i, p in enumerate(prompts) for j in range(n)]
        self.specs = [_SeqSpec(c.prompt, max_tokens[k], stop_ids, sampling[k]) for k, c in enumerate(self.choices)]
        self.arrival = arrival
        self.inbox: _Inbox | None = None

    async def admit(self, prompt_param: str) -> None:
        self.inbox = _Inbox()
        fut = self.server.loop.submit(self.specs, self.inbox, self.arrival)
        try:
            rids = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # The client left while the request waited; if it was admitted meanwhile, end it.
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                  or self.server.loop.abort(f.result(), "abort"))
            raise
        except RequestRefused as e:
            raise _refusal(e, prompt_param, max(len(p) for p in self.prompts), self.server.engine.max_context) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="service_unavailable_error") from None
        for c, rid in zip(self.choices, rids):
            c.rid = rid

    async def updates(self) -> AsyncIterator[list[_Choice]]:
        """Yields the choices each engine step changed, until every choice is done."""
        while not all(c.done for c in self.choices):
            changed = {}
            for u in await self.inbox.queue.get():
                c = self.choices[u.seq]
                if c.apply(u):
                    changed[c.index] = c
                if c.needs_abort:
                    c.needs_abort = False
                    self.server.loop.abort([c.rid], "stop")
            if changed:
                yield list(changed.values())

    def abort_unfinished(self) -> None:
        self.server.loop.abort([c.rid for c in self.choices if c.rid and not c.done], "abort")

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def error(self) -> APIError | None:
        failed = [c for c in self.choices if c.finish_reason == "error"]
        if failed:
            return APIError(500, f"generation failed: {failed[0].error}", type="internal_server_error")
        return None


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# -- the server --------------------------------------------------------------------------------------

class _Server:
    def __init__(self, engine: Engine, tokenizer: TextTokenizer | None, model_name: str, api_key: str | None,
                 max_batch: int, max_body_bytes: int):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.metrics = _Metrics()
        self.loop = EngineLoop(engine, max_batch, self.metrics)
        eos = set(engine.manifest.model.eos_token_ids)
        if tokenizer is not None:
            eos |= tokenizer.eos_token_ids
        self.eos = frozenset(eos)
        self.defaults = _generation_defaults(engine)

    # request plumbing

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer KEY'.", code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"Request body of {int(declared)} bytes is over the limit of {limit} bytes.",
                           code="request_too_large", headers={"Connection": "close"})
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"Request body is over the limit of {limit} bytes.", code="request_too_large",
                               headers={"Connection": "close"})

        def no_constants(name):
            raise ValueError(f"{name} is not valid JSON")

        try:
            data = json.loads(bytes(body), parse_constant=no_constants)
        except ValueError as e:      # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise APIError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
        return data

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")

    def plan(self, req: dict, prompts: list[list[int]], default_max_tokens: int | None,
             arrival: float) -> _Generation:
        """Sampling, stops and lengths of a validated request -> its _Generation (not yet admitted).

        default_max_tokens None: what the context leaves after the prompt (vLLM's default for chat).
        """
        n = req["n"] or 1
        if len(prompts) * n > MAX_SEQS_PER_REQUEST:
            raise _bad_value("n", f"prompts x n is {len(prompts) * n}, over the limit of {MAX_SEQS_PER_REQUEST}.")
        stop = req["stop"] or []
        stop_strings = tuple(s for s in stop if isinstance(s, str))
        stop_ids = {s for s in stop if not isinstance(s, str)} | set(req["stop_token_ids"] or ())
        if not req["ignore_eos"]:
            stop_ids |= self.eos
        if stop_strings and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer and this artifact has none; stop on token ids "
                                "(integers in 'stop', or 'stop_token_ids') instead", param="stop",
                           code="invalid_value")
        d = self.defaults
        temperature = req["temperature"] if req["temperature"] is not None else d["temperature"]
        top_p = req["top_p"] if req["top_p"] is not None else d["top_p"]
        top_k = req["top_k"] if req["top_k"] is not None else d["top_k"]
        seed = req["seed"]
        # Choice j of a seeded request draws from seed + j: the n choices differ, and each is reproducible.
        sampling = [Sampling(temperature=temperature, top_p=top_p, top_k=max(0, top_k),
                             seed=None if seed is None else seed + j)
                    for _ in prompts for j in range(n)]
        if req["max_tokens"] is not None:
            lengths = [req["max_tokens"]] * len(prompts)
        elif default_max_tokens is not None:
            lengths = [default_max_tokens] * len(prompts)
        else:
            lengths = [max(1, self.engine.max_context - len(p)) for p in prompts]
        lengths = [m for m in lengths for _ in range(n)]
        return _Generation(self, prompts, n, lengths, frozenset(stop_ids),
                           StopStrings(stop_strings) if stop_strings else None, sampling, arrival)

    # endpoints

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self.check_key(request)
        req = _validate(await self.read_json(request), _COMPLETION_FIELDS, "prompt")
        self.check_model(req["model"])
        kind, prompts = req["prompt"]
        if kind == "text":
            if self.tokenizer is None:
                raise APIError(400, "this artifact has no tokenizer: send the prompt as token ids", param="prompt",
                               code="invalid_type")
            prompts = [self.tokenizer.encode(p) for p in prompts]
        gen = self.plan(req, prompts, 16, arrival)   # OpenAI's default for completions
        return await self.run(request, req, gen, chat=False)

    async def chat(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self.check_key(request)
        req = _validate(await self.read_json(request), _CHAT_FIELDS, "messages")
        self.check_model(req["model"])
        if self.tokenizer is None:
            raise APIError(400, "this artifact has no tokenizer, so no chat template: use /v1/completions with "
                                "token ids", param="messages", code="invalid_value")
        add_gen = True if req["add_generation_prompt"] is None else req["add_generation_prompt"]
        try:
            text = self.tokenizer.render_chat(req["messages"], add_generation_prompt=add_gen)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        if req["max_completion_tokens"] is not None:
            req["max_tokens"] = req["max_completion_tokens"]
        gen = self.plan(req, [prompt], None, arrival)
        return await self.run(request, req, gen, chat=True)

    async def run(self, request: Request, req: dict, gen: _Generation, chat: bool) -> Response:
        await gen.admit("messages" if chat else "prompt")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req["stream"]:
            return StreamingResponse(self.stream(gen, req, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        # Not streaming: a client that leaves before the answer aborts its sequences all the same.
        watcher = asyncio.ensure_future(_until_disconnect(request))
        collect = asyncio.ensure_future(self._collect(gen))
        try:
            await asyncio.wait({watcher, collect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collect.done():
                collect.cancel()
                gen.abort_unfinished()
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)
        collect.result()
        if (err := gen.error()) is not None:
            raise err
        return JSONResponse(self.body(gen, req, rid, chat))

    @staticmethod
    async def _collect(gen: _Generation) -> None:
        async for _ in gen.updates():
            pass

    def body(self, gen: _Generation, req: dict, rid: str, chat: bool) -> dict:
        ids = bool(req["return_token_ids"]) or self.tokenizer is None
        choices = []
        for c in gen.choices:
            if chat:
                ch = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            else:
                ch = {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
                if ids:
                    ch["prompt_token_ids"] = c.prompt
            if ids:
                ch["token_ids"] = c.ids
            choices.append(ch)
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
               "model": self.model_name, "choices": choices, "usage": gen.usage()}
        if chat and ids:
            out["prompt_token_ids"] = gen.prompts[0]
        return out

    async def stream(self, gen: _Generation, req: dict, rid: str, chat: bool) -> AsyncIterator[str]:
        ids = bool(req["return_token_ids"]) or self.tokenizer is None
        opts = req["stream_options"] or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": self.model_name}
        first = {c.index: True for c in gen.choices}
        try:
            if chat:        # OpenAI's first chunk of each choice names the role
                for c in gen.choices:
                    ch = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}
                    chunk = {**head, "choices": [ch]}
                    if ids and c.index == 0:
                        chunk["prompt_token_ids"] = gen.prompts[0]
                    yield _sse(chunk)
            async for changed in gen.updates():
                for c in changed:
                    if c.finish_reason == "error":
                        yield _sse(gen.error().body())
                        yield "data: [DONE]\n\n"
                        return
                    text, new_ids = c.take_text(), c.take_ids()
                    finish = c.finish_reason if c.done and not c.reported else None
                    if not text and not (ids and new_ids) and finish is None:
                        continue
                    c.reported = c.reported or finish is not None
                    if chat:
                        ch = {"index": c.index, "delta": {"content": text} if text or finish is None else {},
                              "logprobs": None, "finish_reason": finish}
                    else:
                        ch = {"index": c.index, "text": text, "logprobs": None, "finish_reason": finish}
                        if ids and first[c.index]:
                            ch["prompt_token_ids"] = c.prompt
                    if finish is not None:
                        ch["stop_reason"] = c.stop_reason
                    if ids:
                        ch["token_ids"] = new_ids
                    first[c.index] = False
                    chunk = {**head, "choices": [ch]}
                    if include_usage:
                        chunk["usage"] = gen.usage() if continuous else None
                    yield _sse(chunk)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        finally:
            gen.abort_unfinished()      # the client disconnected (this generator was cancelled) or a bug

    def models(self, request: Request) -> dict:
        self.check_key(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "tlaloc-jax", "root": str(self.engine.artifact_dir),
                                            "max_model_len": self.engine.max_context}]}

    async def metrics_text(self) -> Response:
        if self.loop.alive:
            self.metrics.engine.snapshot = await asyncio.wrap_future(self.loop.call(EngineLoop.snapshot))
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _generation_defaults(engine: Engine) -> dict:
    """Sampling defaults: the checkpoint's generation_config.json where it sets them, else OpenAI's
    (temperature 1, top_p 1; top_k off)."""
    out = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    path = engine.artifact_dir / "generation_config.json"
    if "generation_config.json" in engine.manifest.tokenizer_files and path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except ValueError:
            cfg = {}
        for k in out:
            v = cfg.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = type(out[k])(v)
    return out


def create_app(engine: Engine, *, tokenizer: TextTokenizer | None | str = "auto", model_name: str | None = None,
               api_key: str | None = None, max_batch: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving `engine`. The engine loop thread starts and stops with the app's lifespan.

    tokenizer: "auto" loads the artifact's (None when it has no tokenizer.json); max_batch: the most
    sequences running at once (default: the largest decode entry's batch), later ones wait their turn;
    api_key: required as 'Authorization: Bearer KEY' on /v1/* when set.
    """
    if tokenizer == "auto":
        tokenizer = load_tokenizer(engine.artifact_dir, engine.manifest)
    if max_batch is None:
        max_batch = max(e.batch for e in engine.manifest.entries if e.kind == "decode")
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    server = _Server(engine, tokenizer, model_name or engine.manifest.model.name, api_key, int(max_batch),
                     int(max_body_bytes))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()

    app = FastAPI(title="tlaloc-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind).response()

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {exc}", type="internal_server_error").response()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat(request)

    @app.get("/v1/models")
    async def models(request: Request):
        return server.models(request)

    @app.get("/health")
    async def health():
        if server.loop.alive:
            return {"status": "ok"}
        why = f"engine loop stopped: {server.loop.failure}" if server.loop.failure else "engine loop not running"
        return APIError(503, why, type="service_unavailable_error").response()

    @app.get("/metrics")
    async def metrics():
        return await server.metrics_text()

    app.add_middleware(_CountRequests, metrics=server.metrics)
    return app
