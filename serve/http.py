"""An OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn; JAX-free): the app, its routes and
the OpenAI response shapes.

    app = create_app(Engine.load("artifact/"))          # or: python -m tlaloc_jax.serve artifact/
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions and POST /v1/chat/completions (`stream: true` answers with server-sent
events in OpenAI's chunk format; logprobs, structured output and tool calls in OpenAI's shapes), GET /v1/models
and /v1/models/{id}, POST /tokenize and /detokenize, GET /version, GET /health, GET /metrics (Prometheus text
format, under tlaloc_* and vLLM's vllm:* names), and, when an embedding program is served beside the decoder,
POST /v1/embeddings (serve/embeddings.py).

A request is checked (serve/validation.py: body size, JSON depth, Unicode, fields; then prompts x n and
the prompt's length in characters), tokenized on a worker thread (serve/prompts.py), checked against the
pool's size (requests that could never fit are refused here), then handed to the engine loop thread
(serve/loop.py), which admits all of a request's sequences or none between steps. Each step's tokens come
back to the request's asyncio queue. A client that disconnects, or a choice that meets a stop string,
aborts its sequences and frees their pages at the next step boundary.

Errors are OpenAI-style JSON, {"error": {"message", "type", "param", "code"}}:
  400  malformed JSON, JSON nested deeper than 64, a lone surrogate anywhere, an unknown field (only with
       strict_fields; otherwise it is logged as ignored), a field of the wrong type or value, a grammar or
       schema that does not compile, a placeholder or out-of-vocabulary token id, a prompt longer than the
       largest context, max_tokens past it, a sequence that needs more pages than the whole pool
  401  a missing or wrong API key (when the server has one)
  404  an unknown model or route
  413  a body over the size limit
  421  a Host header outside the allow-list (when the app has one: DNS rebinding)
  500  a bug: the answer holds an error id, the server log the cause
  503  the waiting queue is full (code "queue_full", Retry-After: 1), or the request waited past the
       server's --max-wait-seconds without starting (code "queue_timeout"). Requests that could run later
       otherwise wait their turn. (503 rather than 429: the server is momentarily out of capacity, the
       client is not over a rate limit; the openai client retries both, honouring Retry-After.)
Answers never name paths on disk: /v1/models' `root` is the model's name, and a 500 carries an id only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from .embeddings import Embeddings
from .engine import Constraint, Engine, RequestRefused
from .errors import RETRY_AFTER_S, APIError, refusal
from .guards import (LOOPBACK_HOSTS, HostAllowList, InternalErrors, allowed_host_names,  # noqa: F401
                     api_key_problem, host_name, new_error_id)
from .loop import EngineLoop, Inbox, SeqSpec, Update
from .metrics import CountRequests, Metrics
from .prompts import PromptTokenizer
from .sampling import Sampling
from .structured import (TOOL_OPEN, GrammarError, Grammars, parse_tool_calls, template_defines_tools,
                         tool_call_grammar)
from .tokenizer import (ChatTemplateError, IncrementalDetokenizer, StopStrings, TextTokenizer, load_tokenizer,
                        read_listed, read_listed_json)
from .validation import (CHAT_FIELDS, COMPLETION_FIELDS, DETOKENIZE_FIELDS, EMBEDDING_FIELDS, IGNORED,
                         TOKENIZE_FIELDS, bad_value, check_sequence_count, parse_body, validate)

log = logging.getLogger("tlaloc_jax.serve.http")

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_WAITING = 1024    # sequences waiting to run before a new request gets 503
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
    logprobs: list = field(default_factory=list)    # per token: (id, logprob, ((id, logprob), ...)), when asked
    prompt_logprobs: tuple | None = None
    sent_logprobs: int = 0
    hold: str | None = None         # text from which nothing streams (a tool call's start)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def apply(self, u: Update) -> bool:
        if self.done:
            return False                # tokens already in flight after a stop string
        if u.token is None:
            self.finish_reason = "timeout" if u.reason == "timeout" else "error"
            self.error = u.error or "the sequence failed"
            return True
        self.ids.append(u.token)
        if u.logprob is not None:
            self.logprobs.append((u.token, u.logprob, u.top_logprobs or ()))
        if u.prompt_logprobs is not None:
            self.prompt_logprobs = u.prompt_logprobs
        stop_token = u.finished and u.reason == "stop"
        if self.detok is not None:
            # A stop token's text is output as vLLM does (stop_token_ids); a special token (eos) decodes to nothing.
            piece = self.detok.add(u.token)
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
        """The text not sent yet, less the tail that could still become a stop string (or, with `hold`, the text
        from where `hold` starts or may start)."""
        end = len(self.text)
        if not self.done and self.stops is not None:
            end = max(self.sent_text, end - self.stops.holdback)
        if self.hold is not None:
            i = self.text.find(self.hold)
            if i < 0:
                i = len(self.text)
                for k in range(min(len(self.hold) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(self.hold[:k]):
                        i = len(self.text) - k
                        break
                if self.done:
                    i = len(self.text)
            end = max(self.sent_text, min(end, i))
        out = self.text[self.sent_text:end]
        self.sent_text = end
        return out

    def take_ids(self) -> list[int]:
        out = self.ids[self.sent_ids:]
        self.sent_ids = len(self.ids)
        return out

    def take_logprobs(self) -> list:
        out = self.logprobs[self.sent_logprobs:]
        self.sent_logprobs = len(self.logprobs)
        return out


class _Generation:
    """A request's sequences: admitted together, their updates applied as they arrive."""

    def __init__(self, server: "_Server", prompts: list[list[int]], n: int, max_tokens: list[int],
                 stop_ids: frozenset[int], stops: StopStrings | None, sampling: list[Sampling], arrival: float,
                 constraints: list[Constraint | None] | None = None):
        self.server = server
        self.prompts = prompts
        self.n = n
        tok = server.tokenizer
        self.choices = [_Choice(i * n + j, p, tok.detokenizer(p) if tok else None, stops, server.eos)
                        for i, p in enumerate(prompts) for j in range(n)]
        constraints = constraints or [None] * len(self.choices)
        self.specs = [SeqSpec(c.prompt, max_tokens[k], stop_ids, sampling[k], constraints[k], stops is not None)
                      for k, c in enumerate(self.choices)]
        self.tools = False              # the choices' text is parsed for tool calls
        self.arrival = arrival
        self.inbox: Inbox | None = None
        self._error: APIError | None = None

    def refused(self, e: RequestRefused, prompt_param: str) -> APIError:
        return refusal(e, prompt_param, max(len(p) for p in self.prompts), self.server.engine.max_context, self.n)

    def check_could_fit(self, prompt_param: str) -> None:
        """Refuse, before anything is reserved, sequences that together could not fit even an empty pool."""
        try:
            self.server.engine.check_could_fit([(len(s.prompt), s.max_new_tokens) for s in self.specs])
        except RequestRefused as e:
            raise self.refused(e, prompt_param) from None

    async def admit(self, prompt_param: str) -> None:
        self.inbox = Inbox()
        fut = self.server.loop.submit(self.specs, self.inbox, self.arrival)
        try:
            rids = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # The client left while the request waited; if it was admitted meanwhile, end it.
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                  or self.server.loop.abort(f.result(), "abort"))
            raise
        except RequestRefused as e:
            raise self.refused(e, prompt_param) from None
        except RuntimeError as e:     # the loop is shutting down or has failed
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
        """The answer to a request a choice of which failed (its cause goes to the log, once), or None."""
        late = [c for c in self.choices if c.finish_reason == "timeout"]
        if late and self._error is None:
            self._error = APIError(503, late[0].error, type="service_unavailable_error", code="queue_timeout",
                                   headers={"Retry-After": str(RETRY_AFTER_S)})
        failed = [c for c in self.choices if c.finish_reason == "error"]
        if failed and self._error is None:
            error_id = new_error_id()
            log.error("generation failed (id %s), choice %d: %s", error_id, failed[0].index, failed[0].error)
            self._error = APIError(500, f"generation failed (id {error_id}); the server log has the cause",
                                   type="internal_server_error")
        return self._error


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# Characters JSON leaves raw that line-splitting clients (Python's str.splitlines, httpx's aiter_lines) read as line
# breaks, cutting an event in two: written as escapes.
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKS)}\n\n"


# -- the server --------------------------------------------------------------------------------------

class _Server:
    def __init__(self, engine: Engine, tokenizer: TextTokenizer | None, model_name: str, api_key: str | None,
                 max_batch: int, max_body_bytes: int, embeddings: Embeddings | None, strict_fields: bool = False,
                 max_waiting: int = 1024, max_wait_seconds: float | None = None):
        self.engine = engine
        self.embeddings = embeddings
        self.tokenizer = tokenizer
        self.prompt_tokenizer = PromptTokenizer(tokenizer, engine.max_context) if tokenizer is not None else None
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.strict_fields = strict_fields
        self.created = int(time.time())
        self.metrics = Metrics(model_name)
        self.loop = EngineLoop(engine, max_batch, self.metrics, max_waiting, max_wait_seconds)
        eos = set(engine.manifest.model.eos_token_ids)
        if tokenizer is not None:
            eos |= tokenizer.eos_token_ids
        self.eos = frozenset(eos)
        self.defaults = _generation_defaults(engine)
        self.tools = tokenizer is not None and template_defines_tools(tokenizer.chat_template)
        self._grammars: Grammars | None = None
        self._token_texts: dict[int, str] = {}

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
        return parse_body(bytes(body))

    async def read_request(self, request: Request, fields: dict, required: str | None) -> dict:
        """The body's fields, checked; unknown ones are logged as ignored (refused with --strict-fields)."""
        req = validate(await self.read_json(request), fields, required, self.strict_fields)
        if req[IGNORED]:
            log.warning("%s: ignored fields %s (not served by this server)", request.url.path,
                        ", ".join(sorted(req[IGNORED])))
        return req

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")

    def token_text(self, token_id: int) -> str:
        """A token's text in logprobs (vLLM's "token_id:N" without a tokenizer)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.token_text(token_id) if self.tokenizer else f"token_id:{token_id}"
            if len(self._token_texts) < 1 << 20:
                self._token_texts[token_id] = text
        return text

    def grammars(self) -> Grammars:
        if self._grammars is None:
            if self.tokenizer is None:
                raise APIError(400, "structured output needs the artifact's tokenizer, and it has none",
                               code="invalid_value")
            text = read_listed(self.engine.artifact_dir, self.engine.manifest, "tokenizer.json")
            self._grammars = Grammars(text, self.engine.vocab, self.eos)
        return self._grammars

    def structured_spec(self, req: dict, chat: bool) -> tuple[str, Any, str] | None:
        """(grammar kind, spec, the field that asked) of a request's structured output, or None."""
        asked = []
        for name in ("response_format", "structured_outputs", "guided_decoding"):
            if req.get(name) is not None:
                asked.append((*req[name], name))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "lark")):
            if req.get(name) is not None:
                asked.append((kind, req[name], name))
        if chat and req["tools"] and req["tool_choice"] not in (None, "none", "auto"):
            name = req["tool_choice"]["name"] if isinstance(req["tool_choice"], dict) else None
            if name is not None and name not in {t["function"]["name"] for t in req["tools"]}:
                raise bad_value("tool_choice", f"names the function {json.dumps(name)}, which 'tools' does not "
                                               "declare.")
            parallel = req["parallel_tool_calls"] is not False
            asked.append(("lark", tool_call_grammar(req["tools"], name, parallel), "tool_choice"))
        if len(asked) > 1:
            raise APIError(400, f"{', '.join(a[2] for a in asked)}: ask for one structured output at a time",
                           param=asked[1][2], code="invalid_value")
        return asked[0] if asked else None

    async def constraints(self, req: dict, chat: bool, count: int) -> list[Constraint | None] | None:
        spec = self.structured_spec(req, chat)
        if spec is None:
            return None
        kind, value, param = spec
        grammars = self.grammars()
        try:
            grammar = await self.prompt_tokenizer.run(grammars.grammar, kind, value)
        except GrammarError as e:
            raise APIError(400, f"{param}: the grammar does not compile: {e}", param=param,
                           code="invalid_value") from None
        return [grammars.constraint(grammar) for _ in range(count)]

    def plan(self, req: dict, prompts: list[list[int]], default_max_tokens: int | None,
             arrival: float, *, chat: bool, constraints: list | None = None) -> _Generation:
        """Sampling, stops and lengths of a validated request -> its _Generation (not yet admitted).

        default_max_tokens None: what the context leaves after the prompt (vLLM's default for chat).
        """
        n = req["n"] or 1
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
        if chat:
            if req["top_logprobs"] is not None and not req["logprobs"]:
                raise bad_value("top_logprobs", "needs 'logprobs': true.")
            logprobs = (req["top_logprobs"] or 0) if req["logprobs"] else None
            prompt_logprobs = req["prompt_logprobs"]
        else:
            logprobs = req["logprobs"]
            prompt_logprobs = req["prompt_logprobs"]
            if req["echo"] and logprobs is not None:
                # The echoed prompt's tokens carry their logprobs too.
                prompt_logprobs = max(prompt_logprobs or 0, logprobs)
        seed = req["seed"]
        common = dict(temperature=temperature, top_p=top_p, top_k=max(0, top_k),
                      min_p=req["min_p"] if req["min_p"] is not None else 0.0,
                      presence_penalty=req["presence_penalty"] or 0.0,
                      frequency_penalty=req["frequency_penalty"] or 0.0,
                      repetition_penalty=req["repetition_penalty"] if req["repetition_penalty"] is not None else 1.0,
                      logit_bias=req["logit_bias"] or (), min_tokens=req["min_tokens"] or 0,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        # Choice j of a seeded request draws from seed + j: the n choices differ, and each is reproducible.
        try:
            sampling = [Sampling(seed=None if seed is None else seed + j, **common)
                        for _ in prompts for j in range(n)]
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        if req["max_tokens"] is not None:
            lengths = [req["max_tokens"]] * len(prompts)
        elif default_max_tokens is not None:
            lengths = [default_max_tokens] * len(prompts)
        else:
            lengths = [max(1, self.engine.max_context - len(p)) for p in prompts]
        lengths = [m for m in lengths for _ in range(n)]
        return _Generation(self, prompts, n, lengths, frozenset(stop_ids),
                           StopStrings(stop_strings) if stop_strings else None, sampling, arrival, constraints)

    # endpoints

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self.check_key(request)
        req = await self.read_request(request, COMPLETION_FIELDS, "prompt")
        self.check_model(req["model"])
        kind, prompts = req["prompt"]
        n = req["n"] or 1
        check_sequence_count(len(prompts), n)
        texts = prompts if kind == "text" else None
        if kind == "text":
            if self.prompt_tokenizer is None:
                raise APIError(400, "this artifact has no tokenizer: send the prompt as token ids", param="prompt",
                               code="invalid_type")
            prompts = await self.prompt_tokenizer.encode(prompts)
        constraints = await self.constraints(req, False, len(prompts) * n)
        gen = self.plan(req, prompts, 16, arrival, chat=False, constraints=constraints)   # OpenAI's default: 16
        gen.prompt_texts = texts
        return await self.run(request, req, gen, chat=False)

    async def chat(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self.check_key(request)
        req = await self.read_request(request, CHAT_FIELDS, "messages")
        self.check_model(req["model"])
        if self.prompt_tokenizer is None:
            raise APIError(400, "this artifact has no tokenizer, so no chat template: use /v1/completions with "
                                "token ids", param="messages", code="invalid_value")
        tools = req["tools"] if req["tools"] and req["tool_choice"] != "none" else None
        if tools and not self.tools:
            raise APIError(400, "this model's chat template does not define tools (it renders no `tools` in the "
                                f"{TOOL_OPEN} format), so tool calls cannot be served", param="tools",
                           code="invalid_value")
        add_gen = True if req["add_generation_prompt"] is None else req["add_generation_prompt"]
        try:
            prompt = await self.prompt_tokenizer.encode_chat(req["messages"], add_gen, tools)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        if req["max_completion_tokens"] is not None:
            req["max_tokens"] = req["max_completion_tokens"]
        constraints = await self.constraints(req, True, req["n"] or 1)
        gen = self.plan(req, [prompt], None, arrival, chat=True, constraints=constraints)
        gen.tools = tools is not None
        if gen.tools:
            for c in gen.choices:
                c.hold = TOOL_OPEN      # a tool call's text is not streamed as content
        return await self.run(request, req, gen, chat=True)

    async def embed(self, request: Request) -> dict:
        self.check_key(request)
        if self.embeddings is None:
            raise APIError(404, "this server serves no embedding program (python -m tlaloc_jax.serve "
                                "--embedding-artifact DIR adds one)", code="model_not_found")
        return await self.embeddings.answer(await self.read_request(request, EMBEDDING_FIELDS, "input"))

    async def tokenize(self, request: Request) -> dict:
        self.check_key(request)
        req = await self.read_request(request, TOKENIZE_FIELDS, None)
        self.check_model(req["model"])
        if self.prompt_tokenizer is None:
            raise APIError(400, "this artifact has no tokenizer", code="invalid_value")
        if (req["prompt"] is None) == (req["messages"] is None):
            raise APIError(400, "send either 'prompt' or 'messages'", param="prompt", code="invalid_value")
        if req["prompt"] is not None:
            add = True if req["add_special_tokens"] is None else req["add_special_tokens"]
            ids = (await self.prompt_tokenizer.encode([req["prompt"]]))[0] if add else \
                await self.prompt_tokenizer.run(self.tokenizer.encode, req["prompt"], False)
        else:
            add_gen = True if req["add_generation_prompt"] is None else req["add_generation_prompt"]
            try:
                ids = await self.prompt_tokenizer.encode_chat(req["messages"], add_gen)
            except ChatTemplateError as e:
                raise APIError(400, str(e), param="messages", code="invalid_value") from None
        out = {"count": len(ids), "max_model_len": self.engine.max_context, "tokens": ids}
        if req["return_token_strs"]:
            out["token_strs"] = [self.token_text(t) for t in ids]
        return out

    async def detokenize(self, request: Request) -> dict:
        self.check_key(request)
        req = await self.read_request(request, DETOKENIZE_FIELDS, "tokens")
        self.check_model(req["model"])
        if self.tokenizer is None:
            raise APIError(400, "this artifact has no tokenizer", code="invalid_value")
        bad = [t for t in req["tokens"] if not 0 <= t < self.engine.vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {self.engine.vocab})",
                           param="tokens", code="out_of_vocabulary")
        return {"prompt": await self.prompt_tokenizer.run(self.tokenizer.decode, req["tokens"])}

    async def run(self, request: Request, req: dict, gen: _Generation, chat: bool) -> Response:
        prompt_param = "messages" if chat else "prompt"
        gen.check_could_fit(prompt_param)
        await gen.admit(prompt_param)
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

    # logprobs in OpenAI's shapes

    def chat_logprobs(self, entries: list) -> dict:
        """[(id, logprob, top pairs)] -> chat's {"content": [{token, logprob, bytes, top_logprobs}]}."""
        def one(t, lp):
            text = self.token_text(t)
            return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}
        return {"content": [dict(one(t, lp), top_logprobs=[one(a, b) for a, b in top]) for t, lp, top in entries],
                "refusal": None}

    def completion_logprobs(self, entries: list, offset: int, prompt: list | None = None) -> dict:
        """[(id, logprob, top pairs)] -> completions' {tokens, token_logprobs, top_logprobs, text_offset};
        `prompt`: the echoed prompt's (id, logprob or None, top pairs) entries first."""
        tokens, lps, tops, offsets = [], [], [], []
        for t, lp, top in (prompt or []) + entries:
            text = self.token_text(t)
            tokens.append(text)
            lps.append(None if lp is None else _finite(lp))
            tops.append(None if top is None else {self.token_text(a): _finite(b) for a, b in top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt_entries(self, c: _Choice, n: int) -> list:
        """The echoed prompt's logprob entries: (id, logprob, top pairs); the first token has none."""
        out = []
        for k, t in enumerate(c.prompt):
            p = c.prompt_logprobs[k] if c.prompt_logprobs and k < len(c.prompt_logprobs) else None
            out.append((t, None, None) if p is None else (t, p[0], tuple(p[2][:n])))
        return out

    def vllm_prompt_logprobs(self, c: _Choice) -> list | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, rank, decoded_token}}."""
        if c.prompt_logprobs is None:
            return None
        out = []
        for k, p in enumerate(c.prompt_logprobs):
            if p is None:
                out.append(None)
                continue
            lp, rank, top = p
            d = {str(c.prompt[k]): {"logprob": _finite(lp), "rank": rank, "decoded_token": self.token_text(c.prompt[k])}}
            for r, (t, v) in enumerate(top, 1):
                d.setdefault(str(t), {"logprob": _finite(v), "rank": r, "decoded_token": self.token_text(t)})
            out.append(d)
        return out

    def echo_text(self, gen: _Generation, c: _Choice) -> str:
        texts = getattr(gen, "prompt_texts", None)
        if texts is not None:
            return texts[c.index // gen.n]
        return self.tokenizer.decode(c.prompt) if self.tokenizer else ""

    def message(self, gen: _Generation, c: _Choice) -> tuple[dict, str | None]:
        """A chat choice's message (tool calls parsed when the request has tools) and its finish reason."""
        if gen.tools:
            content, calls = parse_tool_calls(c.text)
            if calls:
                return ({"role": "assistant", "content": content,
                         "tool_calls": [call.to_openai() for call in calls]},
                        "tool_calls" if c.finish_reason == "stop" else c.finish_reason)
        return {"role": "assistant", "content": c.text}, c.finish_reason

    def body(self, gen: _Generation, req: dict, rid: str, chat: bool) -> dict:
        ids = bool(req["return_token_ids"]) or self.tokenizer is None
        echo = not chat and bool(req["echo"])
        choices = []
        for c in gen.choices:
            if chat:
                message, finish = self.message(gen, c)
                ch = {"index": c.index, "message": message,
                      "logprobs": self.chat_logprobs(c.logprobs) if req["logprobs"] else None,
                      "finish_reason": finish, "stop_reason": c.stop_reason}
            else:
                prefix = self.echo_text(gen, c) if echo else ""
                logprobs = None
                if req["logprobs"] is not None:
                    prompt = self.prompt_entries(c, req["logprobs"]) if echo else None
                    logprobs = self.completion_logprobs(c.logprobs, 0, prompt)
                ch = {"index": c.index, "text": prefix + c.text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if ids:
                    ch["prompt_token_ids"] = c.prompt
            if req["prompt_logprobs"] is not None:
                ch["prompt_logprobs"] = self.vllm_prompt_logprobs(c)
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
        want_logprobs = bool(req["logprobs"]) if chat else req["logprobs"] is not None
        echo = not chat and bool(req["echo"])
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": self.model_name}
        first = {c.index: True for c in gen.choices}
        offsets = {c.index: 0 for c in gen.choices}
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
                    if c.finish_reason in ("error", "timeout"):
                        yield _sse(gen.error().body())
                        yield "data: [DONE]\n\n"
                        return
                    text, new_ids, new_lps = c.take_text(), c.take_ids(), c.take_logprobs()
                    finish = c.finish_reason if c.done and not c.reported else None
                    if not text and not (ids and new_ids) and not (want_logprobs and new_lps) and finish is None \
                            and not (first[c.index] and (echo or req["prompt_logprobs"] is not None)):
                        continue
                    c.reported = c.reported or finish is not None
                    if chat:
                        delta = {"content": text} if text or finish is None else {}
                        if finish is not None and gen.tools:
                            _, calls = parse_tool_calls(c.text)
                            if calls:
                                delta["tool_calls"] = [call.to_openai(i) for i, call in enumerate(calls)]
                                finish = "tool_calls" if finish == "stop" else finish
                            elif c.sent_text < len(c.text):      # held back, and no tool call after all
                                delta = {"content": text + c.text[c.sent_text:]}
                                c.sent_text = len(c.text)
                        ch = {"index": c.index, "delta": delta,
                              "logprobs": self.chat_logprobs(new_lps) if want_logprobs else None,
                              "finish_reason": finish}
                    else:
                        logprobs = None
                        prefix = ""
                        prompt = None
                        if echo and first[c.index]:
                            prefix = self.echo_text(gen, c)
                            prompt = self.prompt_entries(c, req["logprobs"] or 0) if want_logprobs else None
                        if want_logprobs:
                            logprobs = self.completion_logprobs(new_lps, offsets[c.index], prompt)
                        offsets[c.index] += len(prefix) + len(text)
                        ch = {"index": c.index, "text": prefix + text, "logprobs": logprobs, "finish_reason": finish}
                        if ids and first[c.index]:
                            ch["prompt_token_ids"] = c.prompt
                    if req["prompt_logprobs"] is not None and first[c.index]:
                        ch["prompt_logprobs"] = self.vllm_prompt_logprobs(c)
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

    def health_problem(self) -> str | None:
        """Why this server cannot serve (its engine loop is not running), or None: /health's answer, and the
        replica health check of the Ray Serve deployment (serve/ray.py)."""
        if self.loop.alive:
            return None
        failure = self.loop.failure
        return (f"engine loop stopped ({type(failure).__name__}); the server log has the cause" if failure
                else "engine loop not running")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tlaloc-jax",
                "root": self.model_name, "parent": None, "max_model_len": self.engine.max_context}

    def models(self, request: Request) -> dict:
        self.check_key(request)
        models = [self.model_card()]
        if self.embeddings is not None:
            models.append(self.embeddings.model_card(self.created))
        return {"object": "list", "data": models}

    def model(self, request: Request, model_id: str) -> dict:
        self.check_key(request)
        for card in self.models(request)["data"]:
            if card["id"] == model_id:
                return card
        raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{self.model_name}'.",
                       param="model", code="model_not_found")

    async def metrics_text(self) -> Response:
        if self.loop.alive:
            self.metrics.engine.snapshot = await asyncio.wrap_future(self.loop.call(EngineLoop.snapshot))
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def close(self) -> None:
        if self.prompt_tokenizer is not None:
            self.prompt_tokenizer.close()
        if self.embeddings is not None:
            self.embeddings.close()


def _finite(x: float) -> float:
    """A logprob as JSON can carry it (-inf, which JSON lacks, as -9999.0, vLLM's convention)."""
    return float(x) if x > -9999.0 else -9999.0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tlaloc-jax")
    except PackageNotFoundError:
        return "unknown"


def _generation_defaults(engine: Engine) -> dict:
    """Sampling defaults: the checkpoint's generation_config.json where it sets them, else OpenAI's
    (temperature 1, top_p 1; top_k off)."""
    out = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    cfg = read_listed_json(engine.artifact_dir, engine.manifest, "generation_config.json")
    if cfg:
        for k in out:
            v = cfg.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = type(out[k])(v)
    return out


def create_app(engine: Engine, *, tokenizer: TextTokenizer | None | str = "auto", model_name: str | None = None,
               api_key: str | None = None, max_batch: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_hosts: Iterable[str] | None = None,
               allowed_origins: Iterable[str] = (), embeddings: Embeddings | None = None,
               strict_fields: bool = False, max_waiting: int = DEFAULT_MAX_WAITING,
               max_wait_seconds: float | None = None) -> FastAPI:
    """The FastAPI app serving `engine`. The engine loop thread starts and stops with the app's lifespan.

    tokenizer: "auto" loads the artifact's (None when it has no tokenizer.json); max_batch: the most
    sequences running at once (default: the largest decode entry's batch), later ones wait their turn;
    api_key: required as 'Authorization: Bearer KEY' on /v1/* when set (an empty key is refused: it would
    refuse every request); allowed_hosts: the Host header names answered (any port; "*": any host), others
    get 421 (default None: every Host; `python -m tlaloc_jax.serve` passes LOOPBACK_HOSTS when bound to
    loopback); allowed_origins: browser origins CORS lets read the answers ("*": any; default none); embeddings:
    an embedding program to serve on /v1/embeddings beside the decoder (serve/embeddings.py); strict_fields:
    refuse (400) request fields the server does not know, instead of logging them as ignored (vLLM's way);
    max_waiting: the most sequences waiting to run before new requests get 503; max_wait_seconds: a sequence
    that waited this long without starting fails with 503 (None: no limit).
    """
    if api_key is not None and (problem := api_key_problem(api_key)) is not None:
        raise ValueError(f"api_key {problem}")
    hosts = None if allowed_hosts is None else allowed_host_names(allowed_hosts)
    if tokenizer == "auto":
        tokenizer = load_tokenizer(engine.artifact_dir, engine.manifest)
    if max_batch is None:
        max_batch = max(e.batch for e in engine.manifest.entries if e.kind == "decode")
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    if max_waiting < 0:
        raise ValueError(f"max_waiting must not be negative, got {max_waiting}")
    server = _Server(engine, tokenizer, model_name or engine.manifest.model.name, api_key, int(max_batch),
                     int(max_body_bytes), embeddings, strict_fields, int(max_waiting), max_wait_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()
            server.close()

    app = FastAPI(title="tlaloc-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind).response()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat(request)

    @app.post("/v1/embeddings")
    async def embeddings_(request: Request):
        return await server.embed(request)

    @app.get("/v1/models")
    async def models(request: Request):
        return server.models(request)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        return server.model(request, model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await server.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await server.detokenize(request)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/health")
    async def health():
        problem = server.health_problem()
        if problem is None:
            return {"status": "ok"}
        return APIError(503, problem, type="service_unavailable_error").response()

    @app.get("/metrics")
    async def metrics():
        return await server.metrics_text()

    # Added innermost first: requests pass CountRequests, then the Host check, then CORS, then InternalErrors.
    app.add_middleware(InternalErrors)
    origins = list(allowed_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    if hosts is not None and "*" not in hosts:
        app.add_middleware(HostAllowList, hosts=hosts)
    app.add_middleware(CountRequests, metrics=server.metrics)
    return app
