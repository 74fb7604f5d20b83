"""The JSON body of a request: UTF-8, nested at most MAX_JSON_DEPTH deep, no lone surrogates, an object.
`parse_body(bytes) -> dict`, or an APIError 400 naming what is wrong with it."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from .errors import APIError

MAX_JSON_DEPTH = 64

# A JSON string, escapes included (the unrolled form: no backtracking on long strings).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# The \u escape of a surrogate: the only way a lone one can enter a body that decoded as strict UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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
