"""Tool calls in the Hermes format that Qwen-style chat templates define: `<tool_call>\n{"name": ..., "arguments":
...}\n</tool_call>` blocks after the text of the answer. The grammar that forces them (tool_choice "required" or a
named function) and the parser that reads them back.

A block is read by its structure: the opening tag, one JSON value (json's raw_decode, so a closing tag inside a
string of the arguments is text of the string), the closing tag. The same parse serves forced calls and calls a
model writes on its own (tool_choice "auto").
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_SPACE = " \t\n\r"


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


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _block(text: str, start: int) -> tuple[ToolCall, int] | None:
    """The call whose opening tag starts at `start` and the index past its closing tag, or None when the text
    there is not a whole block holding a JSON object with a string "name"."""
    i = _skip_space(text, start + len(TOOL_OPEN))
    try:
        obj, i = _DECODER.raw_decode(text, i)
    except ValueError:
        return None
    i = _skip_space(text, i)
    if not text.startswith(TOOL_CLOSE, i) or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)), \
        i + len(TOOL_CLOSE)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A completion's text -> (content before the first tool call, or None when empty; the calls). Text that holds
    a block which does not read as a call is content, all of it, with no calls."""
    first = text.find(TOOL_OPEN)
    if first < 0:
        return text, []
    calls, i = [], first
    while i >= 0:
        read = _block(text, i)
        if read is None:
            return text, []
        call, end = read
        calls.append(call)
        i = text.find(TOOL_OPEN, end)
    content = text[:first].strip()
    return content or None, calls


def arguments_schema(parameters: dict | None) -> dict:
    """A function's `parameters` as the schema of its arguments: always an object (validation refuses a schema of
    another type; one that names no type is held to an object)."""
    return dict(parameters or {}, type="object")


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
                                                          "arguments": arguments_schema(f.get("parameters"))},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    # Compact JSON with the separators the templates write (a model is not free to pad it with whitespace).
    schema["x-guidance"] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    repeat = "" if name is not None or not parallel else ' ("\\n" call)*'
    return (f"start: call{repeat}\n"
            f"call: {json.dumps(TOOL_OPEN + chr(10))} body {json.dumps(chr(10) + TOOL_CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")
