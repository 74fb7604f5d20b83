"""A request's answer in OpenAI's shapes: the whole body of a completion or chat completion, or its stream of
server-sent events (chunks), with logprobs, echo, prompt logprobs, tool calls and usage."""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from ..tokenizer import TextTokenizer
from .generation import Choice, Generation
from .prompts import PromptTokenizer
from .protocol import GenerationRequest
from .tool_calls import parse_tool_calls

# Characters JSON leaves raw that line-splitting clients (Python's str.splitlines, httpx's aiter_lines) read as line
# breaks, cutting an event in two: written as escapes.
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKS)}\n\n"


class Responses:
    """The answers of one server: its model's name, and its tokenizer for the tokens' texts (`tokens_as_ids`: logprob
    tokens as "token_id:N" unless a request's return_tokens_as_token_ids says otherwise, vLLM's server flag)."""

    def __init__(self, tokenizer: TextTokenizer | None, prompt_tokenizer: PromptTokenizer | None, model_name: str,
                 tokens_as_ids: bool = False):
        self.tokenizer = tokenizer
        self.prompt_tokenizer = prompt_tokenizer
        self.model_name = model_name
        self.tokens_as_ids = tokens_as_ids
        self._token_texts: dict[int, str] = {}

    def as_ids(self, req: GenerationRequest) -> bool:
        """Whether the request's logprob tokens are "token_id:N" strings (its field, else the server's flag)."""
        asked = req.return_tokens_as_token_ids
        return self.tokens_as_ids if asked is None else asked

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """A token's text in logprobs (vLLM's "token_id:N" without a tokenizer, or when asked)."""
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.token_text(token_id) if self.tokenizer else f"token_id:{token_id}"
            if len(self._token_texts) < 1 << 20:
                self._token_texts[token_id] = text
        return text

    # logprobs in OpenAI's shapes

    def chat_logprobs(self, entries: list, as_ids: bool = False) -> dict:
        """[(id, logprob, top pairs, offset)] -> chat's {"content": [{token, logprob, bytes, top_logprobs}]}."""
        def one(t, lp):
            text = self.token_text(t, as_ids)
            return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}
        return {"content": [dict(one(t, lp), top_logprobs=[one(a, b) for a, b in top]) for t, lp, top, _ in entries],
                "refusal": None}

    def completion_logprobs(self, entries: list, c: Choice, base: int, prompt: list | None = None,
                            as_ids: bool = False) -> dict:
        """[(id, logprob, top pairs, offset in c.text)] -> completions' {tokens, token_logprobs, top_logprobs,
        text_offset}, each offset an index into the answer's text: `base` (the echoed prompt's length) plus the
        token's place in the choice's text (a stop string may have cut it); `prompt`: the echoed prompt's entries
        (their offsets in the echo) first."""
        tokens, lps, tops, offsets = [], [], [], []
        generated = [(t, lp, top, base + min(o, len(c.text))) for t, lp, top, o in entries]
        for t, lp, top, offset in (prompt or []) + generated:
            tokens.append(self.token_text(t, as_ids))
            lps.append(None if lp is None else _finite(lp))
            tops.append(None if top is None else {self.token_text(a, as_ids): _finite(b) for a, b in top})
            offsets.append(offset)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    async def prompt_entries(self, gen: Generation, c: Choice, n: int) -> list:
        """The echoed prompt's logprob entries: (id, logprob, top pairs, where its text starts in the echo); the
        first token has none. Worked out on a worker thread (a decode a token)."""
        offsets = await self.prompt_tokenizer.run(_text_offsets, self.tokenizer, c.prompt, self.echo_text(gen, c)) \
            if self.prompt_tokenizer is not None else [0] * len(c.prompt)
        out = []
        for k, t in enumerate(c.prompt):
            p = c.prompt_logprobs[k] if c.prompt_logprobs and k < len(c.prompt_logprobs) else None
            out.append((t, None, None, offsets[k]) if p is None else (t, p[0], tuple(p[2][:n]), offsets[k]))
        return out

    def vllm_prompt_logprobs(self, c: Choice) -> list | None:
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

    def echo_text(self, gen: Generation, c: Choice) -> str:
        if gen.prompt_texts is not None:
            return gen.prompt_texts[c.index // gen.n]
        return self.tokenizer.decode(c.prompt) if self.tokenizer else ""

    def message(self, gen: Generation, c: Choice) -> tuple[dict, str | None]:
        """A chat choice's message (tool calls parsed when the request has tools) and its finish reason."""
        if gen.tools:
            content, calls = parse_tool_calls(c.text)
            if calls:
                return ({"role": "assistant", "content": content,
                         "tool_calls": [call.to_openai() for call in calls]},
                        "tool_calls" if c.finish_reason == "stop" else c.finish_reason)
        return {"role": "assistant", "content": c.text}, c.finish_reason

    async def body(self, gen: Generation, req: GenerationRequest, rid: str, chat: bool) -> dict:
        ids = bool(req.return_token_ids) or self.tokenizer is None
        echo = not chat and bool(req.echo)
        choices = []
        for c in gen.choices:
            if chat:
                message, finish = self.message(gen, c)
                ch = {"index": c.index, "message": message,
                      "logprobs": self.chat_logprobs(c.logprobs, self.as_ids(req)) if req.logprobs else None,
                      "finish_reason": finish, "stop_reason": c.stop_reason}
            else:
                prefix = self.echo_text(gen, c) if echo else ""
                logprobs = None
                if req.logprobs is not None:
                    prompt = await self.prompt_entries(gen, c, req.logprobs) if echo else None
                    logprobs = self.completion_logprobs(c.logprobs, c, len(prefix), prompt, self.as_ids(req))
                ch = {"index": c.index, "text": prefix + c.text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if ids:
                    ch["prompt_token_ids"] = c.prompt
            if req.prompt_logprobs is not None:
                ch["prompt_logprobs"] = self.vllm_prompt_logprobs(c)
            if ids:
                ch["token_ids"] = c.ids
            if c.request_error:
                ch["error"] = c.error_body()
            choices.append(ch)
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
               "model": gen.model or self.model_name, "choices": choices, "usage": gen.usage()}
        if chat and ids:
            out["prompt_token_ids"] = gen.prompts[0]
        return out

    async def stream(self, gen: Generation, req: GenerationRequest, rid: str, chat: bool) -> AsyncIterator[str]:
        ids = bool(req.return_token_ids) or self.tokenizer is None
        opts = req.stream_options or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        as_ids = self.as_ids(req)
        echo = not chat and bool(req.echo)
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": gen.model or self.model_name}
        first = {c.index: True for c in gen.choices}
        echoed = {c.index: 0 for c in gen.choices}     # the echoed prompt's length: generated offsets start there
        try:
            if chat:        # OpenAI's first chunk of each choice names the role
                for c in gen.choices:
                    ch = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}
                    chunk = {**head, "choices": [ch]}
                    if ids and c.index == 0:
                        chunk["prompt_token_ids"] = gen.prompts[0]
                    yield sse(chunk)
            async for changed in gen.updates():
                for c in changed:
                    if c.finish_reason == "timeout" or (c.finish_reason == "error" and not c.request_error):
                        yield sse(gen.error().body())
                        yield "data: [DONE]\n\n"
                        return
                    text, new_ids, new_lps = c.take_text(), c.take_ids(), c.take_logprobs()
                    finish = c.finish_reason if c.done and not c.reported else None
                    if not text and not (ids and new_ids) and not (want_logprobs and new_lps) and finish is None \
                            and not (first[c.index] and (echo or req.prompt_logprobs is not None)):
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
                              "logprobs": self.chat_logprobs(new_lps, as_ids) if want_logprobs else None,
                              "finish_reason": finish}
                    else:
                        logprobs = None
                        prefix = ""
                        prompt = None
                        if echo and first[c.index]:
                            prefix = self.echo_text(gen, c)
                            echoed[c.index] = len(prefix)
                            prompt = await self.prompt_entries(gen, c, req.logprobs or 0) if want_logprobs else None
                        if want_logprobs:
                            logprobs = self.completion_logprobs(new_lps, c, echoed[c.index], prompt, as_ids)
                        ch = {"index": c.index, "text": prefix + text, "logprobs": logprobs, "finish_reason": finish}
                        if ids and first[c.index]:
                            ch["prompt_token_ids"] = c.prompt
                    if req.prompt_logprobs is not None and first[c.index]:
                        ch["prompt_logprobs"] = self.vllm_prompt_logprobs(c)
                    if finish is not None:
                        ch["stop_reason"] = c.stop_reason
                    if finish == "error":
                        ch["error"] = c.error_body()
                    if ids:
                        ch["token_ids"] = new_ids
                    first[c.index] = False
                    chunk = {**head, "choices": [ch]}
                    if include_usage:
                        chunk["usage"] = gen.usage() if continuous else None
                    yield sse(chunk)
            if include_usage:
                yield sse({**head, "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        finally:
            gen.abort_unfinished()      # the client disconnected (this generator was cancelled) or a bug


def _text_offsets(tokenizer: TextTokenizer, ids: list[int], text: str) -> list[int]:
    """Where each token's text starts in `text`, the decode of `ids` (a special token, which has no text, and a
    token ending inside a character start where the next character does)."""
    detok, at, out = tokenizer.detokenizer([]), 0, []
    for t in ids:
        out.append(min(at, len(text)))
        at += len(detok.add(t))
    return out


def _finite(x: float) -> float:
    """A logprob as JSON can carry it (-inf, which JSON lacks, as -9999.0, vLLM's convention)."""
    return float(x) if x > -9999.0 else -9999.0
