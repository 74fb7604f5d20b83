"""LoRA adapters over HTTP, as vLLM serves them: each adapter a model of /v1/models (its `parent` the base model), a
request's `model` naming one runs with it, and POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them
while the server runs, only where VLLM_ALLOW_RUNTIME_LORA_UPDATING is set (else those routes are 404, as vLLM's
are) and behind --api-key. `lora_modules` reads --lora-modules' `name=path` and JSON forms."""

from __future__ import annotations

import asyncio
import json
import os

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from ..lora_slots import LoraError
from .errors import APIError

# vLLM's switch for the load and unload routes.
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(environ=os.environ) -> bool:
    return environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


def lora_modules(values: list[str]) -> dict[str, dict]:
    """--lora-modules values, each `name=path` or vLLM's JSON {"name", "path", "base_model_name"} -> {name: spec}."""
    out: dict[str, dict] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--lora-modules {value!r} is not JSON: {e}") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                    not isinstance(spec.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: the JSON form needs string 'name' and 'path'")
            name = spec["name"]
            spec = {"path": spec["path"], "base_model_name": spec.get("base_model_name")}
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r} is neither name=path nor JSON")
            spec = {"path": path}
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = spec
    return out


def adapter_cards(engine, created: int, base: dict) -> list[dict]:
    """A /v1/models card per served adapter (no paths: `root` is its name, as the base model's)."""
    if engine.lora is None:
        return []
    return [dict(base, id=name, root=name, parent=m.base_model_name or base["id"])
            for name, m in sorted(engine.lora.modules.items())]


def adapter_of(engine, model: str | None, base_name: str) -> str | None:
    """The adapter a request's `model` names (None: the base model); 404 for a name the server does not serve."""
    if model is None or model == base_name:
        return None
    if engine.lora is not None and model in engine.lora.modules:
        return model
    raise APIError(404, f"The model '{model}' does not exist; this server serves '{base_name}'"
                   + (f" and the LoRA adapters {sorted(engine.lora.modules)}." if engine.lora else "."),
                   param="model", code="model_not_found")


async def _body(server, request: Request, *fields: str) -> list[str]:
    body = await server.read_json(request)
    values = [body.get(f) for f in fields]
    for f, v in zip(fields, values):
        if not isinstance(v, str) or not v:
            raise APIError(400, f"'{f}' must be a non-empty string", param=f, code="invalid_value")
    return values


def add_lora_routes(app: FastAPI, server) -> None:
    """POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name}, answered in
    vLLM's words (plain text on success; 400 for a name loaded already or an adapter refused, 404 for an unknown
    name on unload)."""
    engine = server.engine

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        server.check_key(request)
        name, path = await _body(server, request, "lora_name", "lora_path")
        if name == server.model_name:
            raise APIError(400, f"'{name}' is the base model's name", param="lora_name", code="invalid_value")
        try:
            await asyncio.to_thread(engine.load_lora_adapter, name, path)
        except LoraError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_value") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        server.check_key(request)
        (name,) = await _body(server, request, "lora_name")
        try:
            engine.unload_lora_adapter(name)
        except LoraError:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", type="not_found_error",
                           param="lora_name", code="lora_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
