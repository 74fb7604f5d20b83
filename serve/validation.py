"""Request schema checks: the JSON body (UTF-8, nesting depth, no lone surrogates) and the fields of
/v1/completions, /v1/chat/completions and /v1/embeddings. Every refusal is an APIError 400 that names the field.
Every list a request can carry is bounded (MAX_*), the same on every route that reads it.

`parse_body(bytes) -> dict` then `validate(body, COMPLETION_FIELDS, CHAT_FIELDS or EMBEDDING_FIELDS, required)`
-> one value per known field (None where absent). A field the endpoint does not know is ignored (its name is
returned under IGNORED, and the server logs it), as vLLM does: clients written for vLLM or OpenAI send fields
such as `metadata`, `store` or `service_tier`. With strict=True (`--strict-fields`) it is refused (400).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from .errors import APIError

MAX_SEQS_PER_REQUEST = 64          # prompts x n
MAX_EMBEDDING_INPUTS = 2048        # OpenAI's limit on the inputs of one /v1/embeddings request
MAX_JSON_DEPTH = 64
MAX_TOP_LOGPROBS = 20              # vLLM's default max_logprobs; OpenAI's top_logprobs allows 20 too
IGNORED = "_ignored"               # validate(): the unknown fields it ignored
MAX_SEED = 2**63 - 1               # OpenAI's int64; seed + j (choice j < 64) stays inside Sampling's [0, 2**64)
MAX_STOPS = 64                     # stop strings and ids in `stop`
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300               # OpenAI's limit on logit_bias entries
MAX_TOOLS = 128                    # OpenAI's limit on tools
MAX_MESSAGES = 4096
MAX_PARTS = 256                    # text parts of one message's content
MAX_TOOL_CALLS = 128               # tool calls of one assistant message
MAX_CHOICES = 16384                # guided_choice's strings

# A JSON string, escapes included (the unrolled form: no backtracking on long strings).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# The \u escape of a surrogate: the only way a lone one can enter a body that decoded as strict UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


# -- the body --------------------------------------------------------------------------------------------

def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text (`[[1]]`: 2), counted over its brackets outside strings,
    without parsing and without recursion."""
    skeleton = np.frombuffer(_JSON_STRING.sub(b"", body), np.uint8)
    opens = (skeleton == ord("[")) | (skeleton == ord("{"))
    closes = (skeleton == ord("]")) | (skeleton == ord("}"))
    return int(np.cumsum(opens.astype(np.int64) - closes, dtype=np.int64).max(initial=0))


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(data: Any) -> tuple[str | None, str] | None:
    """(param, description) of a string or field name in `data` that holds a lone surrogate, or None."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return path, f"'{path}'"
        elif isinstance(value, dict):
            for k, v in value.items():
                if not _is_unicode(k):
                    return path or None, f"a field name in {repr(path) if path else 'the request body'}"
                stack.append((f"{path}.{k}" if path else k, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def parse_body(body: bytes) -> dict:
    """A request body -> its JSON object, or APIError 400 naming what is wrong with it."""
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"The request body is nested deeper than {MAX_JSON_DEPTH} levels (arrays and objects "
                            f"inside each other: {depth}).", code="invalid_json")

    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        text = body.decode("utf-8-sig")   # JSON between systems is UTF-8 (RFC 8259); a BOM is tolerated
        data = json.loads(text, parse_constant=no_constants)
    except ValueError as e:      # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    if _SURROGATE_ESCAPE.search(text) and (found := _lone_surrogate(data)) is not None:
        param, where = found
        raise APIError(400, f"{where} holds a lone surrogate (a \\ud800-\\udfff escape without its pair), which is "
                            "not a Unicode character; send text as UTF-8 or as escaped surrogate pairs.",
                       param=param, code="invalid_unicode")
    return data


# -- the fields ------------------------------------------------------------------------------------------

_JSON_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
               dict: "an object", type(None): "null"}


def bad_type(name: str, want: str, value: Any) -> APIError:
    got = _JSON_NAMES.get(type(value), type(value).__name__)
    return APIError(400, f"Invalid type for '{name}': expected {want}, but got {got} instead.", param=name,
                    code="invalid_type")


def bad_value(name: str, why: str) -> APIError:
    return APIError(400, f"Invalid value for '{name}': {why}", param=name, code="invalid_value")


def check_sequence_count(prompts: int, n: int) -> None:
    """prompts x n, checked before any prompt is tokenized."""
    if prompts * n > MAX_SEQS_PER_REQUEST:
        raise bad_value("n", f"prompts x n is {prompts * n}, over the limit of {MAX_SEQS_PER_REQUEST}.")


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
        try:
            x = float(v)
        except OverflowError:       # an integer past float's range
            x = math.inf
        if not math.isfinite(x) or x < lo or x > hi or (lo_open and x == lo):
            raise bad_value(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}.")
        return x
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


def _list(name, v, limit: int, what: str) -> list:
    """`v`, an array of at most `limit` items (`what`: their name in an error)."""
    if not isinstance(v, list):
        raise bad_type(name, f"an array of {what}", v)
    if len(v) > limit:
        raise bad_value(name, f"at most {limit} {what}, got {len(v)}.")
    return v


def _at_most(limit: int, check):
    """A list field of at most `limit` items, then `check`ed."""
    def bounded(name, v):
        if isinstance(v, (list, dict)) and len(v) > limit:
            raise bad_value(name, f"at most {limit} entries, got {len(v)}.")
        return check(name, v)
    return bounded


def _stop(name, v):
    """`stop`: a string or an array of strings and (an extension) integer token ids."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) or _is_int(s) for s in items):
        raise bad_type(name, "a string or an array of strings and token ids", v)
    if any(s == "" for s in items):
        raise bad_value(name, "stop strings must not be empty.")
    if len(items) > MAX_STOPS:
        raise bad_value(name, f"at most {MAX_STOPS} stop sequences, got {len(items)}.")
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


def _embedding_input(name, v):
    """/v1/embeddings' input, as `_prompt` reads it, with at least one input, none of them empty."""
    kind, inputs = _prompt(name, v)
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise bad_value(name, f"at most {MAX_EMBEDDING_INPUTS} inputs, got {len(inputs)}.")
    for i, x in enumerate(inputs):
        if not x:
            where = "the input" if len(inputs) == 1 else f"input {i}"
            raise APIError(400, f"Invalid value for '{name}': {where} is empty; send text or at least one token id.",
                           param=name, code="empty_prompt")
    return kind, inputs


def _one_of(*allowed):
    def check(name, v):
        if v not in allowed or not isinstance(v, str):
            raise bad_value(name, f"must be {' or '.join(json.dumps(a) for a in allowed)}, got {json.dumps(v)}.")
        return v
    return check


def _messages(name, v):
    if not _list(name, v, MAX_MESSAGES, "messages"):
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
            if len(content) > MAX_PARTS:
                raise bad_value(f"{where}.content", f"at most {MAX_PARTS} parts, got {len(content)}.")
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
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(f"{where}.tool_calls", m["tool_calls"])
        if isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _tool_calls(name, v):
    """An assistant message's tool calls (OpenAI's shape: {"id", "type": "function", "function": {"name",
    "arguments"}}), each checked, the arguments handed to templates as an object where their JSON text is one
    (transformers' convention; OpenAI sends JSON text)."""
    out = []
    _list(name, v, MAX_TOOL_CALLS, "tool calls")
    for j, c in enumerate(v):
        where = f"{name}[{j}]"
        if not isinstance(c, dict):
            raise bad_type(where, "an object", c)
        if c.get("type", "function") != "function":
            raise bad_value(f"{where}.type", f"must be \"function\", got {json.dumps(c.get('type'))}.")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise bad_type(f"{where}.id", "a string", c["id"])
        f = c.get("function")
        if not isinstance(f, dict):
            raise bad_type(f"{where}.function", "an object", f)
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_type(f"{where}.function.name", "a non-empty string", f.get("name"))
        args = f.get("arguments")
        if not isinstance(args, (str, dict)):
            raise bad_type(f"{where}.function.arguments", "a JSON text of an object", args)
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        out.append(dict(c, function=dict(f, arguments=args)))
    return out


def _opt(check):
    return lambda name, v: None if v is None else check(name, v)


def _logit_bias(name, v):
    """{"token id": bias in [-100, 100]} -> ((id, bias), ...)."""
    if not isinstance(v, dict):
        raise bad_type(name, "an object mapping token ids to numbers", v)
    out = []
    for k, x in v.items():
        try:
            t = int(k)
        except ValueError:
            raise bad_value(name, f"key {json.dumps(k)} is not a token id.") from None
        out.append((t, _number(-100.0, 100.0)(f"{name}.{k}", x)))
    return tuple(out)


def _json_schema_arg(name, v):
    """A JSON schema: an object, or a JSON text of one."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise bad_value(name, f"not valid JSON ({e}).") from None
    if not isinstance(v, dict):
        raise bad_type(name, "a JSON schema (an object)", v)
    return v


def _choices(name, v):
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise bad_type(name, "a non-empty array of non-empty strings", v)
    if len(v) > MAX_CHOICES:
        raise bad_value(name, f"at most {MAX_CHOICES} choices, got {len(v)}.")
    return list(v)


def _response_format(name, v):
    """OpenAI's response_format -> None (text), ("json", True) (any JSON object) or ("json", schema)."""
    if not isinstance(v, dict):
        raise bad_type(name, "an object", v)
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", True
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_value(f"{name}.json_schema", "must be an object with a 'schema'.")
        return "json", _json_schema_arg(f"{name}.json_schema.schema", spec["schema"])
    raise bad_value(f"{name}.type", f"must be \"text\", \"json_object\" or \"json_schema\", got {json.dumps(kind)}.")


_STRUCTURED_KINDS = {"json": _json_schema_arg, "regex": _str, "choice": _choices, "grammar": _str,
                     "json_object": _bool}


def _structured_outputs(name, v):
    """vLLM's structured_outputs (and guided_decoding): one of json, regex, choice, grammar (Lark), json_object."""
    if not isinstance(v, dict):
        raise bad_type(name, "an object", v)
    given = {k: x for k, x in v.items() if x is not None and k in _STRUCTURED_KINDS}
    if len(given) != 1:
        raise bad_value(name, f"must set exactly one of {', '.join(_STRUCTURED_KINDS)}.")
    (kind, x), = given.items()
    x = _STRUCTURED_KINDS[kind](f"{name}.{kind}", x)
    if kind == "json_object":
        return ("json", True) if x else None
    return {"grammar": "lark"}.get(kind, kind), x


def _tools(name, v):
    out = []
    _list(name, v, MAX_TOOLS, "tools")
    for i, t in enumerate(v):
        where = f"{name}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_value(where, "must be {\"type\": \"function\", \"function\": {...}}.")
        f = t["function"]
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_type(f"{where}.function.name", "a non-empty string", f.get("name"))
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_type(f"{where}.function.parameters", "a JSON schema (an object)", params)
        if params and params.get("type", "object") != "object":
            # A function's arguments are a JSON object (OpenAI's function.arguments is the JSON text of one).
            got = json.dumps(params["type"])
            raise bad_value(f"{where}.function.parameters",
                            f"must be the schema of an object ({{\"type\": \"object\", ...}}), got type {got}.")
        out.append({"type": "function", "function": {k: f[k] for k in ("name", "description", "parameters", "strict")
                                                       if k in f}})
    return out


def _tool_choice(name, v):
    """-> "none", "auto", "required" or a function's name."""
    if v in ("none", "auto", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
            and isinstance(v["function"].get("name"), str):
        return {"name": v["function"]["name"]}
    raise bad_value(name, "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}.")


def _ignored(name, v):
    """A field accepted for compatibility whose value changes nothing here."""
    return v


_COMMON = {
    "model": _opt(_str),
    "max_tokens": _opt(_int(lo=1)),
    "temperature": _opt(_number(lo=0.0)),
    "top_p": _opt(_number(lo=0.0, hi=1.0, lo_open=True)),
    "top_k": _opt(_int(lo=-1)),
    "seed": _opt(_int(lo=0, hi=MAX_SEED)),
    "stop": _opt(_stop),
    "stop_token_ids": _opt(_at_most(MAX_STOP_TOKEN_IDS, _token_ids)),
    "n": _opt(_int(lo=1, hi=MAX_SEQS_PER_REQUEST)),
    "stream": _opt(_bool),
    "stream_options": _opt(_stream_options),
    "return_token_ids": _opt(_bool),
    "ignore_eos": _opt(_bool),
    "user": _opt(_str),
    "presence_penalty": _opt(_number(-2.0, 2.0)),
    "frequency_penalty": _opt(_number(-2.0, 2.0)),
    "repetition_penalty": _opt(_number(0.0, 100.0, lo_open=True)),
    "min_p": _opt(_number(0.0, 1.0)),
    "min_tokens": _opt(_int(lo=0)),
    "logit_bias": _opt(_at_most(MAX_LOGIT_BIAS, _logit_bias)),
    "add_special_tokens": _opt(_bool),
    "prompt_logprobs": _opt(_int(lo=0, hi=MAX_TOP_LOGPROBS)),
    "response_format": _opt(_response_format),
    "structured_outputs": _opt(_structured_outputs),
    "guided_decoding": _opt(_structured_outputs),
    "guided_json": _opt(_json_schema_arg),
    "guided_regex": _opt(_str),
    "guided_choice": _opt(_choices),
    "guided_grammar": _opt(_str),
    "guided_decoding_backend": _opt(_ignored),
    "guided_whitespace_pattern": _opt(_ignored),
    "skip_special_tokens": _opt(_bool),
}
COMPLETION_FIELDS = {**_COMMON, "prompt": _prompt, "echo": _opt(_bool),
                     "suffix": _opt(_unsupported("")), "logprobs": _opt(_int(lo=0, hi=MAX_TOP_LOGPROBS)),
                     "best_of": _opt(_unsupported(1))}
CHAT_FIELDS = {**_COMMON, "messages": _messages, "max_completion_tokens": _opt(_int(lo=1)),
               "logprobs": _opt(_bool), "top_logprobs": _opt(_int(lo=0, hi=MAX_TOP_LOGPROBS)),
               "add_generation_prompt": _opt(_bool),
               "tools": _opt(_tools), "tool_choice": _opt(_tool_choice), "parallel_tool_calls": _opt(_bool),
               "chat_template_kwargs": _opt(_ignored)}


EMBEDDING_FIELDS = {"input": _embedding_input, "model": _opt(_str), "encoding_format": _opt(_one_of("float", "base64")),
                    "dimensions": _opt(_int(lo=1)), "user": _opt(_str)}
TOKENIZE_FIELDS = {"model": _opt(_str), "prompt": _opt(_str), "messages": _opt(_messages), "tools": _opt(_tools),
                   "add_special_tokens": _opt(_bool), "add_generation_prompt": _opt(_bool),
                   "return_token_strs": _opt(_bool)}
DETOKENIZE_FIELDS = {"model": _opt(_str), "tokens": _token_ids}


def validate(body: dict, fields: dict, required: str | None, strict: bool = False) -> dict:
    """body -> {field: checked value or None} for every field of the endpoint, and IGNORED: the names of the
    fields it does not know (strict: refused instead); APIError 400 on the first bad one."""
    unknown = [k for k in body if k not in fields]
    if unknown and strict:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                       code="unknown_parameter")
    if required is not None and body.get(required) is None:
        raise APIError(400, f"Missing required parameter: '{required}'.", param=required,
                       code="missing_required_parameter")
    out = {k: check(k, body.get(k)) for k, check in fields.items()}
    out[IGNORED] = unknown
    return out
