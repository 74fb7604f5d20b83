"""Request schema checks: the fields of /v1/completions and /v1/chat/completions. Every refusal is an
APIError 400 that names the field.

`validate(body, COMPLETION_FIELDS or CHAT_FIELDS, required)` -> one value per known field (None where absent).
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import APIError

MAX_SEQS_PER_REQUEST = 64          # prompts x n


_JSON_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
               dict: "an object", type(None): "null"}


def bad_type(name: str, want: str, value: Any) -> APIError:
    got = _JSON_NAMES.get(type(value), type(value).__name__)
    return APIError(400, f"Invalid type for '{name}': expected {want}, but got {got} instead.", param=name,
                    code="invalid_type")


def bad_value(name: str, why: str) -> APIError:
    return APIError(400, f"Invalid value for '{name}': {why}", param=name, code="invalid_value")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(lo: int | None = None, hi: int | None = None):
    def check(name, v):
        if not _is_int(v):
            raise bad_type(name, "an integer", v)
        if lo is not None and v < lo:
            raise bad_value(name, f"must be >= {lo}, got {v}.")
        if hi is not None and v > hi:
            raise bad_value(name, f"must be <= {hi}, got {v}.")
        return v
    return check


def _number(lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False):
    def check(name, v):
        if not (_is_int(v) or isinstance(v, float)):
            raise bad_type(name, "a number", v)
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            raise bad_value(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}.")
        return float(v)
    return check


def _bool(name, v):
    if not isinstance(v, bool):
        raise bad_type(name, "a boolean", v)
    return v


def _str(name, v):
    if not isinstance(v, str):
        raise bad_type(name, "a string", v)
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
        raise bad_type(name, "an array of integer token ids", v)
    return list(v)


def _stop(name, v):
    """`stop`: a string or an array of strings and (an extension) integer token ids."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) or _is_int(s) for s in items):
        raise bad_type(name, "a string or an array of strings and token ids", v)
    if any(s == "" for s in items):
        raise bad_value(name, "stop strings must not be empty.")
    if len(items) > 64:
        raise bad_value(name, f"at most 64 stop sequences, got {len(items)}.")
    return items


def _stream_options(name, v):
    if not isinstance(v, dict):
        raise bad_type(name, "an object", v)
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
        raise bad_type(name, want, v)
    if not v or all(_is_int(t) for t in v):
        return "ids", [list(v)]
    if all(isinstance(p, str) for p in v):
        return "text", list(v)
    if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in v):
        return "ids", [list(p) for p in v]
    raise bad_type(name, want, v)


def _messages(name, v):
    if not isinstance(v, list):
        raise bad_type(name, "an array of messages", v)
    if not v:
        raise bad_value(name, "must hold at least one message.")
    out = []
    for i, m in enumerate(v):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise bad_type(where, "an object", m)
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise bad_type(f"{where}.role", "a string", role)
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
            raise bad_type(f"{where}.content", "a string or an array of text parts", content)
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
COMPLETION_FIELDS = {**_COMMON, "prompt": _prompt, "echo": _opt(_unsupported(False)),
                      "suffix": _opt(_unsupported("")), "logprobs": _opt(_unsupported(0)),
                      "best_of": _opt(_unsupported(1))}
CHAT_FIELDS = {**_COMMON, "messages": _messages, "max_completion_tokens": _opt(_int(lo=1)),
                "logprobs": _opt(_unsupported(False)), "top_logprobs": _opt(_unsupported(0)),
                "add_generation_prompt": _opt(_bool),
                # Tool calling and structured output are not served; clients that send the neutral values pass.
                "tools": _opt(_unsupported([])), "tool_choice": _opt(_unsupported("none")),
                "parallel_tool_calls": _opt(_unsupported(True, False)),
                "response_format": _opt(_unsupported({"type": "text"}))}


def validate(body: dict, fields: dict, required: str) -> dict:
    for k in body:
        if k not in fields:
            raise APIError(400, f"Unrecognized request argument supplied: {k}", param=k, code="unknown_parameter")
    if body.get(required) is None:
        raise APIError(400, f"Missing required parameter: '{required}'.", param=required,
                       code="missing_required_parameter")
    return {k: check(k, body.get(k)) for k, check in fields.items()}
