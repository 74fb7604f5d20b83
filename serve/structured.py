"""Structured output and tool calls for the HTTP server: grammars (llguidance) that mask each step's tokens before
sampling, and the Hermes-style tool-call format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) that
Qwen-style chat templates define.

Why llguidance (compared, all three on PyPI): xgrammar installs torch, transformers and triton (its pip
requirements), which the JAX- and torch-free serving process may not import; outlines-core needs a vocabulary of
decoded token strings (byte-level BPE tokens mapped back to bytes by the caller) and compiles a regex to a
DFA over the vocabulary up front, with no context-free grammars for a tool call's wrapper; llguidance reads the
artifact's tokenizer.json as it is, has no dependencies, takes JSON schemas, regexes, choices and Lark grammars
(with JSON schemas inside them), parses lazily (an Earley parser, no DFA blow-up on nested schemas) and fills a
packed bitmask in microseconds: the same 32-bit words the body's TOKEN_MASK takes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

import numpy as np

from tlaloc_jax.artifact import mask_words

from .engine import Constraint


class GrammarError(ValueError):
    """A grammar, schema or regex the request sent that cannot be compiled; the message names it."""


class Grammars:
    """Compiles a request's structured-output spec into matchers over one tokenizer."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_token_ids):
        import llguidance
        self._llg = llguidance
        self.eos = tuple(sorted(int(t) for t in eos_token_ids if 0 <= int(t) < vocab))
        self.vocab = vocab
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=list(self.eos) or None)
        except ValueError:
            # llguidance checks an eos id against the tokenizer's count of tokens, not its largest id (a vocabulary
            # with gaps fails): its own eos stands for ours, translated in GrammarConstraint.
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab)

    def grammar(self, kind: str, spec) -> str:
        """An llguidance grammar for kind "json" (a JSON schema: dict, or True for any JSON object), "regex",
        "choice" (a list of strings) or "lark"; GrammarError if it does not compile."""
        M = self._llg.LLMatcher
        try:
            if kind == "json":
                schema = {"type": "object"} if spec is True else spec
                g = M.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
            elif kind == "regex":
                g = M.grammar_from_regex(spec)
            elif kind == "choice":
                g = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
            elif kind == "lark":
                g = M.grammar_from_lark(spec)
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None
        is_error, messages = M.validate_grammar_with_warnings(g, self.tokenizer)
        if is_error:
            raise GrammarError(messages[0] if messages else "the grammar does not compile")
        return g

    def constraint(self, grammar: str) -> "GrammarConstraint":
        return GrammarConstraint(self._llg.LLMatcher(self.tokenizer, grammar, log_level=0), self.vocab, self.eos,
                                 self.tokenizer.eos_token)


class GrammarConstraint(Constraint):
    """One sequence's matcher: the allowed tokens of each step as the body's packed mask words. Where the grammar
    may end, the model's end-of-sequence ids are allowed (llguidance's own eos id translated to them)."""

    def __init__(self, matcher, vocab: int, eos: tuple[int, ...], grammar_eos: int):
        self.matcher = matcher
        self.eos, self.grammar_eos = eos, grammar_eos
        self._buf = np.zeros((1, mask_words(vocab)), np.int32)

    def fill(self, words: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self.matcher, self._buf)
        bits = self._buf[0].view(np.uint32)
        ends = bool((bits[self.grammar_eos // 32] >> np.uint32(self.grammar_eos % 32)) & 1)
        if self.grammar_eos not in self.eos:
            bits[self.grammar_eos // 32] &= ~np.uint32(1 << (self.grammar_eos % 32))
        for t in self.eos:
            if ends:
                bits[t // 32] |= np.uint32(1 << (t % 32))
            else:
                bits[t // 32] &= ~np.uint32(1 << (t % 32))
        words &= self._buf[0]

    def accept(self, token: int) -> bool:
        if token in self.eos:
            return self.matcher.is_accepting() or self.matcher.is_stopped()
        ok = self.matcher.consume_token(int(token))
        return ok and not self.matcher.is_error()


# -- tool calls (the Hermes format) -------------------------------------------------------------------------

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CLOSE), re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI's function.arguments

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def template_defines_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` in the Hermes format (Qwen 2.5 / 3 and this project's demo)."""
    return bool(template) and "tools" in template and TOOL_OPEN in template


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A completion's text -> (content before the first tool call, or None when empty; the calls). A block
    whose body is not a JSON object with a string "name" stays in the content."""
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[:text.index(TOOL_OPEN)].strip()
    return content or None, calls


def tool_call_grammar(tools: list[dict], name: str | None, parallel: bool = True) -> str:
    """Lark: Hermes tool calls whose JSON is a call of one of `tools` (of `name` alone when given), its arguments
    valid against the function's parameters schema: one call for a named function or without `parallel`, else
    one or more."""
    schemas = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        schemas.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                          "arguments": f.get("parameters") or {"type": "object"}},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    # Compact JSON with the separators the templates write (a model is not free to pad it with whitespace).
    schema["x-guidance"] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    repeat = "" if name is not None or not parallel else ' ("\\n" call)*'
    return (f"start: call{repeat}\n"
            f"call: {json.dumps(TOOL_OPEN + chr(10))} body {json.dumps(chr(10) + TOOL_CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")
