"""A manifest's JSON and its frozen dataclasses: written deterministically, read with every missing or mistyped
field named by its path. Both schemas (decoder_manifest.py, bounded_manifest.py) read and write through these
functions."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from typing import Any

from .errors import ManifestError

MAX_JSON_DEPTH = 32


# Fields an artifact without the feature leaves unset and out of its JSON, so that it reads as it did before: meshes,
# native kernels; the body files a runtime does not open, written only when the export asks for them.
UNSET_FIELDS = ("lora", "model_layers", "mesh", "partition", "shards", "custom_calls", "body", "body_sha256",
                "exported", "exported_sha256",
                "program", "program_sha256")


def to_json(record: Any) -> str:
    """A dataclass tree as sorted, indented JSON (the same record gives the same bytes)."""
    return dumps(dataclasses.asdict(record))


def record_json(record: Any) -> Any:
    """A record (a dataclass) as JSON-ready values, without the optional fields it leaves unset."""
    return _drop_unset(dataclasses.asdict(record))


def dumps(raw: Any) -> str:
    return json.dumps(_drop_unset(raw), indent=1, sort_keys=True) + "\n"


def _drop_unset(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _drop_unset(v) for k, v in node.items() if not (k in UNSET_FIELDS and not v)}
    if isinstance(node, (list, tuple)):
        return [_drop_unset(v) for v in node]
    return node


def parse(text: str | bytes, file_name: str) -> dict:
    """The JSON object of a manifest file: UTF-8, valid JSON, an object, nested at most MAX_JSON_DEPTH levels."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ManifestError(f"{file_name} is not UTF-8 text: {e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{file_name} is not valid JSON: {e}") from None
    except RecursionError:
        raise ManifestError(f"{file_name} nests deeper than any manifest") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{file_name} must hold a JSON object")
    _check_depth(raw, MAX_JSON_DEPTH, file_name)
    return raw


def _check_depth(node: Any, limit: int, file_name: str) -> None:
    stack = [(node, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            raise ManifestError(f"{file_name} nests deeper than any manifest ({limit} levels)")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def build(cls, raw: Any, where: str):
    """Dataclass (or field type) `cls` from parsed JSON, naming any missing or mistyped field by its path."""
    if dataclasses.is_dataclass(cls):
        if not isinstance(raw, dict):
            raise ManifestError(f"{where} must be an object")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in raw:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise ManifestError(f"missing field {where}.{f.name}")
            kwargs[f.name] = build(_field_types(cls)[f.name], raw[f.name], f"{where}.{f.name}")
        return cls(**kwargs)
    if type(cls) is types.UnionType:       # X | None
        if raw is None:
            return None
        return build(next(a for a in cls.__args__ if a is not type(None)), raw, where)
    if getattr(cls, "__origin__", None) is tuple:
        if not isinstance(raw, list):
            raise ManifestError(f"{where} must be a list")
        args = cls.__args__
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(build(args[0], x, f"{where}[{i}]") for i, x in enumerate(raw))
        if len(raw) != len(args):
            raise ManifestError(f"{where} must have {len(args)} items")
        return tuple(build(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, raw)))
    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        try:
            return cls(raw)
        except ValueError:
            raise ManifestError(f"{where} is {raw!r}, not a known {cls.__name__} "
                                f"({', '.join(m.value for m in cls)})") from None
    if cls is int and not (isinstance(raw, int) and not isinstance(raw, bool)):
        raise ManifestError(f"{where} must be an integer, got {raw!r}")
    if cls is str and not isinstance(raw, str):
        raise ManifestError(f"{where} must be a string, got {raw!r}")
    return raw


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    """A manifest dataclass's field types, resolved once."""
    return typing.get_type_hints(cls)
