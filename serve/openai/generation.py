"""A request's generated sequences: each choice's ids, text (stop strings cut) and what was sent of it (Choice),
and the request's choices admitted together to the engine loop and updated as its steps come back (Generation)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..engine import Constraint, Engine, RequestRefused
from ..host_sampling import Sampling
from ..loop import Arrival, EngineLoop, Inbox, SeqSpec, Update
from ..tokenizer import IncrementalDetokenizer, StopStrings, TextTokenizer
from .errors import RETRY_AFTER_S, APIError, refusal
from .guards import new_error_id

log = logging.getLogger("tlaloc_jax.serve.http")


@dataclass
class Choice:
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
    request_error: bool = False     # the failure is the request's own (its grammar, its min_tokens): no 500
    reported: bool = False          # the finish chunk went out
    needs_abort: bool = False       # a stop string ended it while the engine still runs it
    logprobs: list = field(default_factory=list)    # per token: (id, logprob, top pairs, its offset in text)
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
            self.request_error = u.request_error
            return True
        self.ids.append(u.token)
        if u.logprob is not None:
            # The token's text starts where the text ends now (a character it begins may come with a later token).
            self.logprobs.append((u.token, u.logprob, u.top_logprobs or (), len(self.text)))
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

    def error_body(self) -> dict:
        """A choice that ended through its request's fault: why, in the shape of an API error."""
        return {"message": self.error, "type": "invalid_request_error", "param": None, "code": "sequence_failed"}


class Generation:
    """A request's sequences: admitted together, their updates applied as they arrive."""

    def __init__(self, engine: Engine, loop: EngineLoop, tokenizer: TextTokenizer | None, eos: frozenset[int],
                 prompts: list[list[int]], n: int, max_tokens: list[int], stop_ids: frozenset[int],
                 stops: StopStrings | None, sampling: list[Sampling], arrival: float, length_param: str = "max_tokens",
                 priority: int = 0, cache_salt: str | None = None, lora: str | None = None):
        self.engine = engine
        self.loop = loop
        self.prompts = prompts
        self.n = n
        self.stop_ids = stop_ids
        self.length_param = length_param        # the request's name for the new tokens' limit
        self.choices = [Choice(i * n + j, p, tokenizer.detokenizer(p) if tokenizer else None, stops, eos)
                        for i, p in enumerate(prompts) for j in range(n)]
        self.specs = [SeqSpec(c.prompt, max_tokens[k], stop_ids, sampling[k], None, stops is not None,
                              cache_salt=cache_salt, priority=priority, lora=lora) for k, c in enumerate(self.choices)]
        self.model = lora               # the adapter it runs with, which its answers name (None: the base model)
        self.tools = False              # the choices' text is parsed for tool calls
        self.prompt_texts: list[str] | None = None      # a text prompt, as sent (what echo returns)
        self.arrival = arrival
        self.inbox: Inbox | None = None
        self.ticket: Arrival | None = None      # closed when the request is submitted to the loop
        self._error: APIError | None = None

    def constrain(self, constraints: list[Constraint]) -> None:
        self.specs = [dataclasses.replace(s, constraint=c) for s, c in zip(self.specs, constraints)]

    def refused(self, e: RequestRefused, prompt_param: str) -> APIError:
        return refusal(e, prompt_param)

    def check_could_fit(self, prompt_param: str) -> None:
        """Refuse, before anything is reserved, a prompt or length past the context (naming the request's fields),
        and sequences that together could not fit even an empty pool."""
        context = self.engine.max_context
        for s in self.specs:
            if len(s.prompt) > context:
                raise APIError(400, f"prompt of {len(s.prompt)} tokens is longer than the largest context {context}",
                               param=prompt_param, code="context_length_exceeded")
            if len(s.prompt) + s.max_new_tokens - 1 > context:
                raise APIError(400, f"prompt of {len(s.prompt)} tokens plus {self.length_param} {s.max_new_tokens} "
                                    f"exceeds the largest context {context}: at most {context - len(s.prompt) + 1} "
                                    "new tokens fit", param=self.length_param, code="context_length_exceeded")
        try:
            self.engine.check_could_fit([(len(s.prompt), s.max_new_tokens) for s in self.specs])
        except RequestRefused as e:
            raise self.refused(e, prompt_param) from None

    async def admit(self, prompt_param: str) -> None:
        self.inbox = Inbox()
        fut = self.loop.submit(self.specs, self.inbox, self.arrival, self.ticket)
        try:
            rids = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # The client left while the request waited; if it was admitted meanwhile, end it.
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                  or self.loop.abort(f.result(), "abort"))
            raise
        except RequestRefused as e:
            raise self.refused(e, prompt_param) from None
        except RuntimeError as e:     # the loop is shutting down or has failed
            raise APIError(503, str(e), type="service_unavailable_error") from None
        for c, rid in zip(self.choices, rids):
            c.rid = rid

    async def updates(self) -> AsyncIterator[list[Choice]]:
        """Yields the choices each engine step changed, until every choice is done."""
        while not all(c.done for c in self.choices):
            changed = {}
            for u in await self.inbox.queue.get():
                c = self.choices[u.seq]
                if c.apply(u):
                    changed[c.index] = c
                if c.needs_abort:
                    c.needs_abort = False
                    self.loop.abort([c.rid], "stop")
            if changed:
                yield list(changed.values())

    def abort_unfinished(self) -> None:
        self.loop.abort([c.rid for c in self.choices if c.rid and not c.done], "abort")

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
        failed = [c for c in self.choices if c.finish_reason == "error" and not c.request_error]
        if failed and self._error is None:
            error_id = new_error_id()
            log.error("generation failed (id %s), choice %d: %s", error_id, failed[0].index, failed[0].error)
            self._error = APIError(500, f"generation failed (id {error_id}); the server log has the cause",
                                   type="internal_server_error")
        return self._error
