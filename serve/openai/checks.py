"""The checks of a request's fields, one function per kind of field: `check(name, value)` -> the value as the
server uses it, or an APIError 400 that names the field (its message, param and code are the API's). The request
models (protocol.py) attach one to each field. Every list a request can carry is bounded (MAX_*), the same on every
route that reads it."""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import APIError

MAX_SEQS_PER_REQUEST = 64          # prompts x n
MAX_EMBEDDING_INPUTS = 2048        # OpenAI's limit on the inputs of one /v1/embeddings request
MAX_TOP_LOGPROBS = 20              # vLLM's default max_logprobs; OpenAI's top_logprobs allows 20 too
MAX_SEED = 2**63 - 1               # OpenAI's int64; seed + j (choice j < 64) stays inside Sampling's [0, 2**64)
INT64 = (-2**63, 2**63 - 1)        # vLLM's priority is an int64
SCHEDULING_POLICIES = ("fcfs", "priority")      # vLLM's --scheduling-policy
MAX_STOPS = 64                     # stop strings and ids in `stop`
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300               # OpenAI's limit on logit_bias entries
MAX_TOOLS = 128                    # OpenAI's limit on tools
MAX_MESSAGES = 4096
MAX_PARTS = 256                    # text parts of one message's content
MAX_TOOL_CALLS = 128               # tool calls of one assistant message
MAX_CHOICES = 16384                # guided_choice's strings


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


def check_queue_room(prompts: int, n: int, max_waiting: int) -> None:
    """prompts x n against the server's --max-waiting: a request's sequences wait together, so one holding more than
    may wait could never be admitted (a 400, not the 503 of a queue that is full now, which a client retries)."""
    if prompts * n > max_waiting:
        what = f"n is {n}" if prompts == 1 else f"prompts x n is {prompts} x {n}"
        raise APIError(400, f"Invalid value for '{'n' if n > 1 else 'prompt'}': {what}, {prompts * n} sequences that "
                            f"wait together, and the server's --max-waiting is {max_waiting}: it could never be "
                            f"admitted; send at most {max_waiting} sequences, or start the server with a larger "
                            "--max-waiting.", param="n" if n > 1 else "prompt", code="invalid_value")


def check_priority(priority: int | None, policy: str) -> int:
    """The request's priority (0 when not given); a non-zero one needs --scheduling-policy priority, as vLLM's."""
    if priority and policy != "priority":
        raise bad_value("priority", f"{priority} needs priority scheduling, and this server schedules first come, "
                                    f"first served (--scheduling-policy {policy}); start it with --scheduling-policy "
                                    "priority, or leave priority out.")
    return priority or 0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int | None = None, hi: int | None = None):
    def check(name, v):
        if not _is_int(v):
            raise bad_type(name, "an integer", v)
        if lo is not None and v < lo:
            raise bad_value(name, f"must be >= {lo}, got {v}.")
        if hi is not None and v > hi:
            raise bad_value(name, f"must be <= {hi}, got {v}.")
        return v
    return check


def number(lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False):
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


def boolean(name, v):
    if not isinstance(v, bool):
        raise bad_type(name, "a boolean", v)
    return v


def string(name, v):
    if not isinstance(v, str):
        raise bad_type(name, "a string", v)
    return v


def cache_salt(name, v):
    """vLLM's cache_salt: a non-empty string (an empty one would read as no salt, sharing what the client meant to
    keep apart)."""
    string(name, v)
    if not v:
        raise bad_value(name, "must be a non-empty string; leave it out to share cached prefixes with requests "
                              "that send none.")
    return v


def unsupported(*allowed):
    """A field OpenAI defines that this server serves only at its neutral value."""
    def check(name, v):
        if v in allowed and type(v) in {type(a) for a in allowed}:
            return v
        raise APIError(400, f"'{name}' = {json.dumps(v)} is not supported by this server (only "
                            f"{' or '.join(json.dumps(a) for a in allowed)}).", param=name, code="unsupported_parameter")
    return check


def token_ids(name, v):
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


def at_most(limit: int, check):
    """A list field of at most `limit` items, then `check`ed."""
    def bounded(name, v):
        if isinstance(v, (list, dict)) and len(v) > limit:
            raise bad_value(name, f"at most {limit} entries, got {len(v)}.")
        return check(name, v)
    return bounded


def stop(name, v):
    """`stop`: a string or an array of strings and (an extension) integer token ids."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) or _is_int(s) for s in items):
        raise bad_type(name, "a string or an array of strings and token ids", v)
    if any(s == "" for s in items):
        raise bad_value(name, "stop strings must not be empty.")
    if len(items) > MAX_STOPS:
        raise bad_value(name, f"at most {MAX_STOPS} stop sequences, got {len(items)}.")
    return items


def stream_options(name, v):
    if not isinstance(v, dict):
        raise bad_type(name, "an object", v)
    for k, x in v.items():
        if k not in ("include_usage", "continuous_usage_stats"):
            raise APIError(400, f"Unrecognized request argument supplied: {name}.{k}", param=f"{name}.{k}",
                           code="unknown_parameter")
        boolean(f"{name}.{k}", x)
    return v


def prompt(name, v):
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


def embedding_input(name, v):
    """/v1/embeddings' input, as `prompt` reads it, with at least one input, none of them empty."""
    kind, inputs = prompt(name, v)
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise bad_value(name, f"at most {MAX_EMBEDDING_INPUTS} inputs, got {len(inputs)}.")
    for i, x in enumerate(inputs):
        if not x:
            where = "the input" if len(inputs) == 1 else f"input {i}"
            raise APIError(400, f"Invalid value for '{name}': {where} is empty; send text or at least one token id.",
                           param=name, code="empty_prompt")
    return kind, inputs


def one_of(*allowed):
    def check(name, v):
        if v not in allowed or not isinstance(v, str):
            raise bad_value(name, f"must be {' or '.join(json.dumps(a) for a in allowed)}, got {json.dumps(v)}.")
        return v
    return check


def messages(name, v):
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


def optional(check):
    return lambda name, v: None if v is None else check(name, v)


def logit_bias(name, v):
    """{"token id": bias in [-100, 100]} -> ((id, bias), ...)."""
    if not isinstance(v, dict):
        raise bad_type(name, "an object mapping token ids to numbers", v)
    out = []
    for k, x in v.items():
        try:
            t = int(k)
        except ValueError:
            raise bad_value(name, f"key {json.dumps(k)} is not a token id.") from None
        out.append((t, number(-100.0, 100.0)(f"{name}.{k}", x)))
    return tuple(out)


def json_schema(name, v):
    """A JSON schema: an object, or a JSON text of one."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise bad_value(name, f"not valid JSON ({e}).") from None
    if not isinstance(v, dict):
        raise bad_type(name, "a JSON schema (an object)", v)
    return v


def choices(name, v):
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise bad_type(name, "a non-empty array of non-empty strings", v)
    if len(v) > MAX_CHOICES:
        raise bad_value(name, f"at most {MAX_CHOICES} choices, got {len(v)}.")
    return list(v)


def response_format(name, v):
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
        return "json", json_schema(f"{name}.json_schema.schema", spec["schema"])
    raise bad_value(f"{name}.type", f"must be \"text\", \"json_object\" or \"json_schema\", got {json.dumps(kind)}.")


_STRUCTURED_KINDS = {"json": json_schema, "regex": string, "choice": choices, "grammar": string,
                     "json_object": boolean}


def structured_outputs(name, v):
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


def tools(name, v):
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


def tool_choice(name, v):
    """-> "none", "auto", "required" or a function's name."""
    if v in ("none", "auto", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
            and isinstance(v["function"].get("name"), str):
        return {"name": v["function"]["name"]}
    raise bad_value(name, "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}.")


def ignored(name, v):
    """A field accepted for compatibility whose value changes nothing here."""
    return v
