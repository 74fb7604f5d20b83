"""An OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn; JAX-free): the app, its routes, middleware
and lifespan (the routes' work is server.py's).

    app = create_app(Engine.load("artifact/"))          # or: python -m tlaloc_jax.serve artifact/
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions and POST /v1/chat/completions (`stream: true` answers with server-sent
events in OpenAI's chunk format; logprobs, structured output and tool calls in OpenAI's shapes), GET /v1/models
and /v1/models/{id}, POST /tokenize and /detokenize, GET /version, GET /health, GET /metrics (Prometheus text
format, under tlaloc_* and vLLM's vllm:* names), and, when an embedding program is served beside the decoder,
POST /v1/embeddings (embeddings.py).

Errors are OpenAI-style JSON, {"error": {"message", "type", "param", "code"}}:
  400  malformed JSON, JSON nested deeper than 64, a lone surrogate anywhere, an unknown field (only with
       strict_fields; otherwise it is logged as ignored), a field of the wrong type or value or a list past its
       bound, a grammar or schema that does not compile, passes a limit, admits no text or cannot meet min_tokens,
       a placeholder or out-of-vocabulary token id, a prompt longer than the largest context, max_tokens past it,
       a sequence that needs more pages (or state slots) than the whole pool, more sequences in one request (n, or
       prompts x n) than --max-waiting lets wait, a non-zero priority under --scheduling-policy fcfs
  401  a missing or wrong API key (when the server has one) on /v1/*, /tokenize, /detokenize and /metrics
       (/metrics without one when metrics_without_key: a scraper's; /health and /version never need it)
  404  an unknown model or route
  413  a body over the size limit (the rest of it read and dropped first, up to serving.DRAIN_BYTES, so that
       the connection closes without a reset and the client reads the answer)
  421  a Host header outside the allow-list (when the app has one: DNS rebinding)
  500  a bug: the answer holds an error id, the server log the cause. A choice that fails through its own
       request (its grammar fails deep into the text, min_tokens leaves no token) is not one: it ends with
       finish_reason "error" and an "error" object in a 200 answer, the other choices as they were
  503  the waiting queue is full (code "queue_full", Retry-After: 1), or the request waited past the
       server's --max-wait-seconds before any of its sequences started (code "queue_timeout"; once one has, the
       others wait behind their own request, not the queue), or the server still compiles its entries (code
       "not_ready", Retry-After: when they should be ready; /health answers 503 with how far it got). Requests that could run later
       otherwise wait their turn. (503 rather than 429: the server is momentarily out of capacity, the
       client is not over a rate limit; the openai client retries both, honouring Retry-After.)
Answers never name paths on disk: /v1/models' `root` is the model's name, and a 500 carries an id only.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..engine import Engine
from ..metrics import CountRequests
from ..tokenizer import TextTokenizer, load_tokenizer
from .checks import SCHEDULING_POLICIES
from .embeddings import Embeddings
from .errors import APIError
from .guards import HostAllowList, InternalErrors, allowed_host_names, api_key_problem
from .lora_routes import add_lora_routes, runtime_updating_allowed
from .server import OpenAIServer
from .structured import GrammarBudget

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_WAITING = 1024    # sequences waiting to run before a new request gets 503


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tlaloc-jax")
    except PackageNotFoundError:
        return "unknown"


def _forwarding(answer):
    """A route that hands its request to `answer` (one of the server's coroutines)."""
    async def route(request: Request):
        return await answer(request)
    return route


def create_app(engine: Engine, *, tokenizer: TextTokenizer | None | str = "auto", model_name: str | None = None,
               api_key: str | None = None, max_batch: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_hosts: Iterable[str] | None = None,
               allowed_origins: Iterable[str] = (), embeddings: Embeddings | None = None,
               strict_fields: bool = False, max_waiting: int = DEFAULT_MAX_WAITING,
               max_wait_seconds: float | None = None, grammar_budget: GrammarBudget = GrammarBudget(),
               metrics_without_key: bool = False, scheduling_policy: str = "fcfs",
               return_tokens_as_token_ids: bool = False, compile_all: bool = False,
               progress: str | None = "log") -> FastAPI:
    """The FastAPI app serving `engine`. The engine loop thread starts and stops with the app's lifespan.

    tokenizer: "auto" loads the artifact's (None when it has no tokenizer.json); max_batch: the most
    sequences running at once (default: the largest decode entry's batch), later ones wait their turn;
    api_key: required as 'Authorization: Bearer KEY' on /v1/* when set (an empty key is refused: it would
    refuse every request); allowed_hosts: the Host header names answered (any port; "*": any host), others
    get 421 (default None: every Host; `python -m tlaloc_jax.serve` passes LOOPBACK_HOSTS when bound to
    loopback); allowed_origins: browser origins CORS lets read the answers ("*": any; default none); embeddings:
    an embedding program to serve on /v1/embeddings beside the decoder (embeddings.py); strict_fields:
    refuse (400) request fields the server does not know, instead of logging them as ignored (vLLM's way);
    max_waiting: the most sequences waiting to run before new requests get 503; max_wait_seconds: a sequence
    that waited this long before any sequence of its request started fails with 503 (None: no limit);
    grammar_budget: what one request's structured output may cost (structured.py); metrics_without_key: answer
    /metrics without the api_key (a scraper that cannot send one; its counters show when prompts hit the prefix
    cache); scheduling_policy: vLLM's, "fcfs" (a request's non-zero `priority` is refused) or "priority" (lower
    `priority` runs first); return_tokens_as_token_ids: logprob tokens as "token_id:N" unless a request says
    otherwise (vLLM's flag); compile_all: the engine loop compiles and warms every entry not run yet before it serves
    (`python -m tlaloc_jax.serve` does, unless --lazy-compile): until then /health answers 503 with how far it got
    and generation requests 503 with Retry-After (False: entries compile on first use); progress: how that shows,
    "bar" (a terminal), "log" (periodic lines) or None.
    """
    if api_key is not None and (problem := api_key_problem(api_key)) is not None:
        raise ValueError(f"api_key {problem}")
    hosts = None if allowed_hosts is None else allowed_host_names(allowed_hosts)
    if tokenizer == "auto":
        tokenizer = load_tokenizer(engine.artifact_dir, engine.manifest)
    if max_batch is None:
        max_batch = engine.manifest.max_batch
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    if max_waiting < 0:
        raise ValueError(f"max_waiting must not be negative, got {max_waiting}")
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                         f"{scheduling_policy!r}")
    server = OpenAIServer(engine, tokenizer, model_name or engine.manifest.model.name, api_key, int(max_batch),
                          int(max_body_bytes), embeddings, strict_fields, int(max_waiting), max_wait_seconds,
                          grammar_budget, scheduling_policy, bool(return_tokens_as_token_ids),
                          compile_all=compile_all, progress=progress)

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

    # The POST endpoints: each hands the request to the server's coroutine that answers it.
    for path, answer in (("/v1/completions", server.completions), ("/v1/chat/completions", server.chat),
                         ("/v1/embeddings", server.embed), ("/tokenize", server.tokenize),
                         ("/detokenize", server.detokenize)):
        app.add_api_route(path, _forwarding(answer), methods=["POST"], name=answer.__name__)

    @app.get("/v1/models")
    async def models(request: Request):
        return server.models(request)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        return server.model(request, model_id)

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
    async def metrics(request: Request):
        if not metrics_without_key:
            server.check_key(request)
        return await server.metrics_text()

    # Added innermost first: requests pass CountRequests, then the Host check, then CORS, then InternalErrors.
    if runtime_updating_allowed():
        add_lora_routes(app, server)

    app.add_middleware(InternalErrors)
    origins = list(allowed_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    if hosts is not None and "*" not in hosts:
        app.add_middleware(HostAllowList, hosts=hosts)
    app.add_middleware(CountRequests, metrics=server.metrics)
    return app
