"""The OpenAI-compatible server as a Ray Serve application: N replicas, each holding one Engine (one device),
behind Ray's HTTP proxy.

    serve run tlaloc_jax.serve.ray:app artifact=ARTIFACT_DIR num_replicas=2
    serve run tlaloc_jax.serve.ray:app artifact=ARTIFACT_DIR min_replicas=1 max_replicas=4 target_ongoing_requests=8

or from Python: `serve.run(tlaloc_jax.serve.ray.app({"artifact": "artifact/", "num_replicas": 2}))`.

Each replica is the app of `python -m tlaloc_jax.serve` (serve/openai/app.py `create_app`: the same routes, checks,
streaming and engine loop), mounted with `@serve.ingress` on Ray's proxy; it is built on the replica, after the
replica has loaded its Engine. Streams go out through Ray's streaming responses. Ray asks each replica's
`check_health` (the engine loop is running: what /health answers) and replaces a replica that fails it or dies;
the requests a dead replica was serving fail, the others' do not notice. Every answer names its replica in the
`x-tlaloc-replica` header.

Arguments (`serve run ... key=value`, or a dict): `artifact` (required); `num_replicas` (default 1), or autoscaling
with `min_replicas` / `max_replicas` / `target_ongoing_requests` (or a whole Ray `autoscaling_config`);
`max_ongoing_requests` per replica (default: twice the artifact's largest decode batch, so a replica holds a full
batch and the next one waiting; Ray routes the rest to other replicas or queues them); `num_cpus` / `num_gpus`
per replica (`num_gpus` defaults to the GPUs a cuda artifact's mesh runs on: a replica of a tensor-parallel
artifact owns all of them; fewer is refused by name); `health_check_period_s`, `health_check_timeout_s`; and the server's own options: `plugin`,
`max_batch`, `max_model_len`, `served_model_name`, `api_key` (default $TLALOC_API_KEY), `allowed_origins`,
`strict_fields`, `cache_dir`, `trust_weights`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.serve import Application

log = logging.getLogger("tlaloc_jax.serve.ray")

REPLICA_HEADER = b"x-tlaloc-replica"


class RayServeArgs(BaseModel):
    """The arguments of `serve run tlaloc_jax.serve.ray:app key=value ...` (checked by pydantic; Ray hands the
    command line's values over as strings)."""

    model_config = ConfigDict(extra="forbid")

    artifact: str
    num_replicas: int | None = Field(default=None, ge=1)
    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=1)
    target_ongoing_requests: float | None = Field(default=None, gt=0)
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int | None = Field(default=None, ge=1)
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float | None = Field(default=None, ge=0)
    health_check_period_s: float | None = Field(default=None, gt=0)
    health_check_timeout_s: float | None = Field(default=None, gt=0)
    plugin: str | None = None
    max_batch: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    served_model_name: str | None = None
    api_key: str | None = None
    metrics_without_key: bool = False
    allowed_origins: list[str] = []
    strict_fields: bool = False
    cache_dir: str | None = None
    trust_weights: bool = False

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _comma_separated(cls, v):
        """`allowed_origins=https://a.example,https://b.example` on the command line."""
        return [o.strip() for o in v.split(",") if o.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> RayServeArgs:
        flat = {k: v for k, v in (("min_replicas", self.min_replicas), ("max_replicas", self.max_replicas),
                                  ("target_ongoing_requests", self.target_ongoing_requests)) if v is not None}
        if flat and self.autoscaling_config is not None:
            raise ValueError(f"give autoscaling either as autoscaling_config or as {', '.join(flat)}, not both")
        if (flat or self.autoscaling_config is not None) and self.num_replicas is not None:
            raise ValueError("num_replicas is a fixed count; leave it out when autoscaling (min_replicas, "
                             "max_replicas, target_ongoing_requests, autoscaling_config)")
        return self

    def autoscaling(self) -> dict[str, Any] | None:
        if self.autoscaling_config is not None:
            return dict(self.autoscaling_config)
        flat = {k: v for k, v in (("min_replicas", self.min_replicas), ("max_replicas", self.max_replicas),
                                  ("target_ongoing_requests", self.target_ongoing_requests)) if v is not None}
        return flat or None


class _NameReplica:
    """ASGI wrapper: every HTTP answer carries the replica's id (which replica served a request, for logs and
    for telling which requests a lost replica took with it)."""

    def __init__(self, app, replica: str):
        self.app = app
        self.header = (REPLICA_HEADER, replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), self.header])
            await send(message)
        return await self.app(scope, receive, named)


@serve.deployment(name="tlaloc")
@serve.ingress()
class OpenAIReplica:
    """One replica: an Engine on its device, and `create_app`'s FastAPI app over it (built here, on the replica,
    so the engine is never pickled)."""

    def __init__(self, args: dict):
        from tlaloc_jax.artifact import load_manifest, load_remembering

        from .. import http
        from ..engine import DEFAULT_CACHE_DIR, Engine

        a = RayServeArgs(**args)
        cache_dir = DEFAULT_CACHE_DIR if a.cache_dir is None else None if a.cache_dir == "none" else a.cache_dir
        manifest = load_remembering(load_manifest, a.artifact, cache_dir, verify_weights=not a.trust_weights)
        self.engine = Engine.load(a.artifact, a.plugin, cache_dir=cache_dir, progress=False,
                                  trust_weights=a.trust_weights, manifest=manifest, max_model_len=a.max_model_len)
        try:
            self.openai_app = http.create_app(self.engine, model_name=a.served_model_name, api_key=_api_key(a),
                                       max_batch=a.max_batch, allowed_origins=a.allowed_origins,
                                       strict_fields=a.strict_fields, metrics_without_key=a.metrics_without_key)
        except BaseException:
            self.engine.close()
            raise
        self.server = self.openai_app.state.server
        self.replica = serve.get_replica_context().replica_id.unique_id
        log.info("replica %s serving %r from %s (max batch %d)", self.replica, self.server.model_name, a.artifact,
                 self.server.loop.max_running)

    def __serve_build_asgi_app__(self):
        return _NameReplica(self.openai_app, self.replica)

    async def check_health(self) -> None:
        """Ray's replica health check: the engine loop runs (what /health answers 200 for)."""
        problem = self.server.health_problem()
        if problem is not None:
            raise RuntimeError(problem)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def _api_key(a: RayServeArgs) -> str | None:
    return a.api_key if a.api_key is not None else os.environ.get("TLALOC_API_KEY")


def replica_gpus(manifest, asked: float | None) -> float:
    """The GPUs one replica asks Ray for: a cuda artifact's devices (its mesh's, or 1), none for a cpu one; a
    replica given fewer than its artifact runs on is refused by name."""
    need = manifest.devices if manifest.versions.platform == "cuda" else 0
    if asked is None:
        return float(need)
    if asked < need:
        raise ValueError(f"the artifact runs on {need} GPUs (tensor parallel): a replica needs num_gpus={need}, "
                         f"not {asked}")
    return float(asked)


def app(args: dict | RayServeArgs) -> Application:
    """The application builder: `serve run tlaloc_jax.serve.ray:app artifact=DIR num_replicas=2`.

    The artifact's manifest is read here (no weights hashed, nothing compiled), so a bad artifact is refused before
    any replica starts; each replica then loads and checks it in full."""
    from tlaloc_jax.artifact import load_manifest

    a = args if isinstance(args, RayServeArgs) else RayServeArgs(**args)
    manifest = load_manifest(a.artifact, verify_weights=False)
    largest_batch = manifest.max_batch
    options: dict[str, Any] = {
        "max_ongoing_requests": a.max_ongoing_requests or 2 * (a.max_batch or largest_batch),
        "ray_actor_options": {"num_cpus": a.num_cpus, "num_gpus": replica_gpus(manifest, a.num_gpus)},
    }
    autoscaling = a.autoscaling()
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = a.num_replicas or 1
    for name in ("health_check_period_s", "health_check_timeout_s"):
        if getattr(a, name) is not None:
            options[name] = getattr(a, name)
    return OpenAIReplica.options(**options).bind(a.model_dump(mode="json"))
