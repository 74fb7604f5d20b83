"""The OpenAI-compatible routes' work over one Engine (JAX-free): a request is checked (body, fields: protocol.py;
then prompts x n and the prompt's length), tokenized on a worker thread (prompts.py), checked against the
context and the pool's size (requests that could never fit are refused here), its grammar compiled and checked on
the grammar thread (structured.py), then handed to the engine loop thread (serve/loop.py), which admits all of
a request's sequences or none between steps (generation.py). Each step's tokens come back to the request's asyncio
queue. A client that disconnects, or a choice that meets a stop string, aborts its sequences and frees their pages
at the next step boundary."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from ..engine import Engine
from ..host_sampling import Sampling
from ..loop import Arrival, EngineLoop, StepWork
from ..metrics import Metrics
from ..tokenizer import ChatTemplateError, StopStrings, TextTokenizer, read_listed, read_listed_json
from .body import parse_body
from .checks import bad_value, check_priority, check_queue_room, check_sequence_count
from .embeddings import Embeddings
from .errors import APIError
from .generation import Generation
from .lora_routes import adapter_cards, adapter_of
from .prompts import PromptTokenizer
from .protocol import (ChatRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, GenerationRequest,
                       Request as BodyModel, TokenizeRequest)
from .responses import Responses
from .structured import GrammarBudget, GrammarError, Grammars
from .tool_calls import TOOL_OPEN, template_defines_tools, tool_call_grammar

log = logging.getLogger("tlaloc_jax.serve.http")

R = TypeVar("R", bound=BodyModel)


# A refused over-size body is read and dropped, up to this many bytes past the limit and for this long, before its
# 413 is sent: closing the connection with the body partly unread resets it, and the client may never see the 413.
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 10.0


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _drain(chunks, most: int) -> None:
    """Read and drop what is left of a request body (`chunks`, its request.stream()), at most `most` bytes in
    DRAIN_SECONDS; a client that hangs up or sends more is left to the connection's close."""
    async def read():
        n = 0
        async for chunk in chunks:
            n += len(chunk)
            if n > most:
                return
    try:
        await asyncio.wait_for(read(), DRAIN_SECONDS)
    except (asyncio.TimeoutError, ClientDisconnect):
        pass


class OpenAIServer:
    """The routes' work over one Engine: auth, the request's checks, its prompt, sampling and grammar, admission to
    the engine loop, and the answer (responses.py)."""

    def __init__(self, engine: Engine, tokenizer: TextTokenizer | None, model_name: str, api_key: str | None,
                 max_batch: int, max_body_bytes: int, embeddings: Embeddings | None, strict_fields: bool = False,
                 max_waiting: int = 1024, max_wait_seconds: float | None = None,
                 grammar_budget: GrammarBudget = GrammarBudget(), scheduling_policy: str = "fcfs",
                 return_tokens_as_token_ids: bool = False, compile_all: bool = False, progress: str | None = "log"):
        self.engine = engine
        self.embeddings = embeddings
        self.tokenizer = tokenizer
        self.prompt_tokenizer = PromptTokenizer(tokenizer, engine.max_context) if tokenizer is not None else None
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.strict_fields = strict_fields
        self.scheduling_policy = scheduling_policy
        self.created = int(time.time())
        self.metrics = Metrics(model_name)
        self.step_work = StepWork()
        self.loop = EngineLoop(engine, max_batch, self.metrics, max_waiting, max_wait_seconds, self.step_work,
                               compile_all=compile_all, progress=progress)
        eos = set(engine.manifest.model.eos_token_ids)
        if tokenizer is not None:
            eos |= tokenizer.eos_token_ids
        self.eos = frozenset(eos)
        self.defaults = _generation_defaults(engine)
        self.tools = tokenizer is not None and template_defines_tools(tokenizer.chat_template)
        self.grammar_budget = grammar_budget
        self._grammars: asyncio.Future | None = None    # the Grammars, made on first use off the event loop
        self.responses = Responses(tokenizer, self.prompt_tokenizer, model_name, return_tokens_as_token_ids)

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
        """The body, at most max_body_bytes, parsed (body.py). An over-size one is drained (_drain) and answered 413;
        one declared past the drain's bound, or sent only after `Expect: 100-continue`, is answered at once."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            if int(declared) - limit <= DRAIN_BYTES and request.headers.get("expect", "").lower() != "100-continue":
                await _drain(request.stream(), int(declared))
            raise APIError(413, f"Request body of {int(declared)} bytes is over the limit of {limit} bytes.",
                           code="request_too_large", headers={"Connection": "close"})
        body = bytearray()
        chunks = request.stream()
        async for chunk in chunks:
            body += chunk
            if len(body) > limit:
                await _drain(chunks, DRAIN_BYTES)
                raise APIError(413, f"Request body is over the limit of {limit} bytes.", code="request_too_large",
                               headers={"Connection": "close"})
        return parse_body(bytes(body))

    async def read_request(self, request: Request, model: type[R]) -> R:
        """The body as `model`, checked; unknown fields are logged as ignored (refused with --strict-fields)."""
        req, ignored = model.parse(await self.read_json(request), self.strict_fields)
        if ignored:
            log.warning("%s: ignored fields %s (not served by this server)", request.url.path,
                        ", ".join(sorted(ignored)))
        return req

    def check_ready(self) -> None:
        """Refuse (503, Retry-After: when the entries left should be ready) a request that comes while the engine loop
        still compiles its entries: as a vLLM server takes no traffic before it is up, and so that no answer's latency
        holds a compile."""
        readiness = self.loop.readiness
        if readiness is not None and (reason := readiness.reason()) is not None:
            raise APIError(503, f"the server is not ready yet ({reason}); retry later, or watch /health",
                           type="service_unavailable_error", code="not_ready",
                           headers={"Retry-After": str(readiness.retry_after())})

    async def read_model_request(self, request: Request, model: type[R]) -> R:
        """The key checked, then readiness (check_ready), then the body read as `model` (read_request), then the model
        it names (check_model)."""
        self.check_key(request)
        self.check_ready()
        req = await self.read_request(request, model)
        self.check_model(req.model)
        return req

    def check_model(self, model: str | None) -> str | None:
        """-> the LoRA adapter `model` names (None: the base model); 404 for a model the server does not serve."""
        return adapter_of(self.engine, model, self.model_name)

    async def grammars(self) -> Grammars:
        """The Grammars over the artifact's tokenizer, made once, on a worker thread (reading a large vocabulary
        takes a while)."""
        if self.tokenizer is None:
            raise APIError(400, "structured output needs the artifact's tokenizer, and it has none",
                           code="invalid_value")
        if self._grammars is None:
            text = read_listed(self.engine.artifact_dir, self.engine.manifest, "tokenizer.json")
            self._grammars = asyncio.ensure_future(self.prompt_tokenizer.run(
                Grammars, text, self.engine.vocab, self.eos, self.step_work, self.grammar_budget))
        return await asyncio.shield(self._grammars)

    def structured_spec(self, req: GenerationRequest, chat: bool) -> tuple[str, Any, str] | None:
        """(grammar kind, spec, the field that asked) of a request's structured output, or None."""
        asked = []
        for name in ("response_format", "structured_outputs", "guided_decoding"):
            if getattr(req, name) is not None:
                asked.append((*getattr(req, name), name))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "lark")):
            if getattr(req, name) is not None:
                asked.append((kind, getattr(req, name), name))
        if chat and req.tools and req.tool_choice not in (None, "none", "auto"):
            name = req.tool_choice["name"] if isinstance(req.tool_choice, dict) else None
            if name is not None and name not in {t["function"]["name"] for t in req.tools}:
                raise bad_value("tool_choice", f"names the function {json.dumps(name)}, which 'tools' does not "
                                               "declare.")
            parallel = req.parallel_tool_calls is not False
            asked.append(("lark", tool_call_grammar(req.tools, name, parallel), "tool_choice"))
        if len(asked) > 1:
            raise APIError(400, f"{', '.join(a[2] for a in asked)}: ask for one structured output at a time",
                           param=asked[1][2], code="invalid_value")
        return asked[0] if asked else None

    async def constrain(self, req: GenerationRequest, gen: Generation, chat: bool) -> None:
        """Compile and check the request's grammar (off the event loop; a 400 naming the cause if refused) and give
        each of its sequences a matcher."""
        spec = self.structured_spec(req, chat)
        if spec is None:
            return
        kind, value, param = spec
        grammars = await self.grammars()
        try:
            constraints = await grammars.constraints(kind, value, len(gen.specs), gen.stop_ids,
                                                     req.min_tokens or 0)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=e.param or param, code=e.code) from None
        gen.constrain(constraints)

    def plan(self, req: GenerationRequest, prompts: list[list[int]], default_max_tokens: int | None,
             arrival: float, *, chat: bool) -> Generation:
        """Sampling, stops and lengths of a validated request -> its Generation (not yet admitted).

        default_max_tokens None: what the context leaves after the prompt (vLLM's default for chat).
        """
        n = req.n or 1
        stop = req.stop or []
        stop_strings = tuple(s for s in stop if isinstance(s, str))
        stop_ids = {s for s in stop if not isinstance(s, str)} | set(req.stop_token_ids or ())
        if not req.ignore_eos:
            stop_ids |= self.eos
        if stop_strings and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer and this artifact has none; stop on token ids "
                                "(integers in 'stop', or 'stop_token_ids') instead", param="stop",
                           code="invalid_value")
        d = self.defaults
        temperature = req.temperature if req.temperature is not None else d["temperature"]
        top_p = req.top_p if req.top_p is not None else d["top_p"]
        top_k = req.top_k if req.top_k is not None else d["top_k"]
        if chat:
            if req.top_logprobs is not None and not req.logprobs:
                raise bad_value("top_logprobs", "needs 'logprobs': true.")
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            prompt_logprobs = req.prompt_logprobs
        else:
            logprobs = req.logprobs
            prompt_logprobs = req.prompt_logprobs
            if req.echo and logprobs is not None:
                # The echoed prompt's tokens carry their logprobs too.
                prompt_logprobs = max(prompt_logprobs or 0, logprobs)
        self.check_sampler_fits(req, chat, logprobs, prompt_logprobs)
        vocab = self.engine.vocab
        if req.min_tokens and sum(1 for t in stop_ids if 0 <= t < vocab) == vocab:
            raise bad_value("min_tokens", f"{req.min_tokens} tokens before a stop, and the stop ids (with "
                                          "stop_token_ids) hold every token of the vocabulary.")
        seed = req.seed
        common = dict(temperature=temperature, top_p=top_p, top_k=max(0, top_k),
                      min_p=req.min_p if req.min_p is not None else 0.0,
                      presence_penalty=req.presence_penalty or 0.0,
                      frequency_penalty=req.frequency_penalty or 0.0,
                      repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
                      logit_bias=req.logit_bias or (), min_tokens=req.min_tokens or 0,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        # Choice j of a seeded request draws from seed + j: the n choices differ, and each is reproducible.
        try:
            sampling = [Sampling(seed=None if seed is None else seed + j, **common)
                        for _ in prompts for j in range(n)]
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        if req.max_tokens is not None:
            lengths = [req.max_tokens] * len(prompts)
        elif default_max_tokens is not None:
            lengths = [default_max_tokens] * len(prompts)
        else:
            lengths = [max(1, self.engine.max_context - len(p)) for p in prompts]
        lengths = [m for m in lengths for _ in range(n)]
        length_param = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        return Generation(self.engine, self.loop, self.tokenizer, self.eos, prompts, n, lengths, frozenset(stop_ids),
                           StopStrings(stop_strings) if stop_strings else None, sampling, arrival, length_param,
                           check_priority(req.priority, self.scheduling_policy), req.cache_salt,
                           lora=self.check_model(req.model))

    def check_sampler_fits(self, req: GenerationRequest, chat: bool, logprobs: int | None,
                           prompt_logprobs: int | None) -> None:
        """What the artifact's sampler cannot carry, refused by the request's field names (the host fallback of an
        artifact without a sampler carries any)."""
        bias = req.logit_bias or ()
        for t, _ in bias:
            if not 0 <= t < self.engine.vocab:
                raise APIError(400, f"Invalid value for 'logit_bias': token id {t} is outside the vocabulary (size "
                                    f"{self.engine.vocab}).", param="logit_bias", code="out_of_vocabulary")
        sampler = self.engine.sampler
        if sampler is None:
            return
        if len(bias) > sampler.logit_bias:
            raise bad_value("logit_bias", f"{len(bias)} entries; this artifact's sampler takes at most "
                                          f"{sampler.logit_bias} (export --logit-bias-slots).")
        if logprobs is not None and logprobs > sampler.top_logprobs:
            name = "top_logprobs" if chat else "logprobs"
            raise bad_value(name, f"{logprobs} top logprobs; this artifact's sampler returns at most "
                                  f"{sampler.top_logprobs} (export --top-logprobs).")

    # endpoints

    async def completions(self, request: Request) -> Response:
        ticket = self.loop.arriving()       # closed when submitted to the loop, or here if it ends before
        try:
            return await self._completions(request, ticket)
        finally:
            ticket.close()

    async def chat(self, request: Request) -> Response:
        ticket = self.loop.arriving()
        try:
            return await self._chat(request, ticket)
        finally:
            ticket.close()

    async def _completions(self, request: Request, ticket: Arrival) -> Response:
        arrival = time.perf_counter()
        req = await self.read_model_request(request, CompletionRequest)
        kind, prompts = req.prompt
        n = req.n or 1
        check_sequence_count(len(prompts), n)
        check_queue_room(len(prompts), n, self.loop.max_waiting)
        check_priority(req.priority, self.scheduling_policy)
        texts = prompts if kind == "text" else None
        if kind == "text":
            if self.prompt_tokenizer is None:
                raise APIError(400, "this artifact has no tokenizer: send the prompt as token ids", param="prompt",
                               code="invalid_type")
            add = True if req.add_special_tokens is None else req.add_special_tokens
            prompts = await self.prompt_tokenizer.encode(prompts, add_special_tokens=add)
        gen = self.plan(req, prompts, 16, arrival, chat=False)   # OpenAI's default: 16
        gen.prompt_texts = texts
        gen.ticket = ticket
        return await self.run(request, req, gen, chat=False)

    async def _chat(self, request: Request, ticket: Arrival) -> Response:
        arrival = time.perf_counter()
        req = await self.read_model_request(request, ChatRequest)
        check_queue_room(1, req.n or 1, self.loop.max_waiting)
        check_priority(req.priority, self.scheduling_policy)
        if self.prompt_tokenizer is None:
            raise APIError(400, "this artifact has no tokenizer, so no chat template: use /v1/completions with "
                                "token ids", param="messages", code="invalid_value")
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        if tools and not self.tools:
            raise APIError(400, "this model's chat template does not define tools (it renders no `tools` in the "
                                f"{TOOL_OPEN} format), so tool calls cannot be served", param="tools",
                           code="invalid_value")
        prompt = await self.chat_ids(req, tools)
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        gen = self.plan(req, [prompt], None, arrival, chat=True)
        gen.ticket = ticket
        gen.tools = tools is not None
        if gen.tools:
            for c in gen.choices:
                c.hold = TOOL_OPEN      # a tool call's text is not streamed as content
        return await self.run(request, req, gen, chat=True)

    async def chat_ids(self, req: GenerationRequest, tools: list[dict] | None) -> list[int]:
        """A chat request's messages (and tools) as the template renders them, tokenized (vLLM's add_special_tokens:
        default false, the template writes them)."""
        add_gen = True if req.add_generation_prompt is None else req.add_generation_prompt
        try:
            return await self.prompt_tokenizer.encode_chat(req.messages, add_gen, tools,
                                                           add_special_tokens=bool(req.add_special_tokens))
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None

    async def embed(self, request: Request) -> dict:
        self.check_key(request)
        if self.embeddings is None:
            raise APIError(404, "this server serves no embedding program (python -m tlaloc_jax.serve "
                                "--embedding-artifact DIR adds one)", code="model_not_found")
        return await self.embeddings.answer(await self.read_request(request, EmbeddingRequest))

    async def tokenize(self, request: Request) -> dict:
        req = await self.read_model_request(request, TokenizeRequest)
        if self.prompt_tokenizer is None:
            raise APIError(400, "this artifact has no tokenizer", code="invalid_value")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either 'prompt' or 'messages'", param="prompt", code="invalid_value")
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = (await self.prompt_tokenizer.encode([req.prompt], add_special_tokens=add))[0]
        else:
            ids = await self.chat_ids(req, req.tools)
        out = {"count": len(ids), "max_model_len": self.engine.max_context, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [self.responses.token_text(t) for t in ids]
        return out

    async def detokenize(self, request: Request) -> dict:
        req = await self.read_model_request(request, DetokenizeRequest)
        if self.tokenizer is None:
            raise APIError(400, "this artifact has no tokenizer", code="invalid_value")
        bad = [t for t in req.tokens if not 0 <= t < self.engine.vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {self.engine.vocab})",
                           param="tokens", code="out_of_vocabulary")
        return {"prompt": await self.prompt_tokenizer.run(self.tokenizer.decode, req.tokens)}

    async def run(self, request: Request, req: GenerationRequest, gen: Generation, chat: bool) -> Response:
        prompt_param = "messages" if chat else "prompt"
        gen.check_could_fit(prompt_param)
        await self.constrain(req, gen, chat)
        await gen.admit(prompt_param)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(self.responses.stream(gen, req, rid, chat), media_type="text/event-stream",
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
        return JSONResponse(await self.responses.body(gen, req, rid, chat))

    @staticmethod
    async def _collect(gen: Generation) -> None:
        async for _ in gen.updates():
            pass


    def health_problem(self) -> str | None:
        """Why this server cannot serve (its engine loop is not running, or still compiles its entries), or None:
        /health's answer, and the replica health check of the Ray Serve deployment (serve/integrations/ray.py)."""
        if self.loop.alive:
            return None if self.loop.readiness is None else self.loop.readiness.reason()
        failure = self.loop.failure
        return (f"engine loop stopped ({type(failure).__name__}); the server log has the cause" if failure
                else "engine loop not running")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tlaloc-jax",
                "root": self.model_name, "parent": None, "max_model_len": self.engine.max_context}

    def models(self, request: Request) -> dict:
        self.check_key(request)
        models = [self.model_card()]
        models += adapter_cards(self.engine, self.created, self.model_card())
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
        self.step_work.close()
        if self._grammars is not None and self._grammars.done() and self._grammars.exception() is None:
            self._grammars.result().close()


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
