"""An artifact served by NVIDIA Triton Inference Server, through PyTriton: one decoupled Triton model that streams
the ids it generates for each request, with the engine's continuous batching behind it.

    python -m tlaloc_jax.serve.triton ARTIFACT_DIR [--model-name NAME] [--host 127.0.0.1] [--http-port 8000]
        [--grpc-port 8001] [--metrics-port 8002] [--max-batch N] [--max-model-len N] [--plugin PATH] [--cache-dir DIR]

PyTriton starts the Triton server binary its wheel ships and hands each request to `TritonModel.infer` here, an
async generator on PyTriton's event loop: every request is a sequence given to the same engine loop the HTTP
server uses (serve/loop.py), so concurrent requests share decode calls, and each engine step that produced tokens
for a request is one streamed Triton response.

The model (decoupled: any number of responses per request; not batched by Triton: the engine batches):
  inputs   prompt_ids INT64 [-1] (required); max_tokens INT32 [1] (default 16); temperature, top_p, min_p,
           presence_penalty, frequency_penalty, repetition_penalty FP32 [1]; top_k, min_tokens INT32 [1];
           seed INT64 [1]; stop_token_ids INT64 [-1]; ignore_eos BOOL [1]. Optional inputs left out take
           `Sampling`'s defaults: greedy.
  outputs  token_ids INT64 [-1] (the ids of one engine step, usually one); finish_reason BYTES [1] ("" until the
           last response, then "stop" or "length").
A request the engine refuses (a bad id, too long, bad sampling values, a full pool) ends with Triton's error
carrying the engine's message; other requests go on.

Triton streams a decoupled model's responses over gRPC (the client library's `start_stream` /
`async_stream_infer`) and over HTTP's generate extension (POST /v2/models/NAME/generate_stream, server-sent
events); its HTTP `infer` answers a decoupled model with an error, as Triton does for every decoupled model.

PyTriton 0.7.0 requires numpy < 2 while JAX 0.10.2 requires numpy >= 2, so this runs in an environment without
JAX (the runtime never imports it): `make test-engines` builds one (.venv-triton).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from ..__main__ import _positive
from ..engine import Engine
from ..host_sampling import Sampling
from ..loop import EngineLoop, Inbox, SeqSpec
from ..metrics import Metrics

log = logging.getLogger("tlaloc_jax.serve.triton")

# (input name, numpy dtype, shape, Sampling field or None)
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_PARAMS = ("top_k", "min_tokens")
DEFAULT_MAX_TOKENS = 16


def model_inputs():
    from pytriton.model_config import Tensor
    return [Tensor(name="prompt_ids", dtype=np.int64, shape=(-1,)),
            Tensor(name="max_tokens", dtype=np.int32, shape=(1,), optional=True),
            *(Tensor(name=n, dtype=np.float32, shape=(1,), optional=True) for n in FLOAT_PARAMS),
            *(Tensor(name=n, dtype=np.int32, shape=(1,), optional=True) for n in INT_PARAMS),
            Tensor(name="seed", dtype=np.int64, shape=(1,), optional=True),
            Tensor(name="stop_token_ids", dtype=np.int64, shape=(-1,), optional=True),
            Tensor(name="ignore_eos", dtype=np.bool_, shape=(1,), optional=True)]


def model_outputs():
    from pytriton.model_config import Tensor
    return [Tensor(name="token_ids", dtype=np.int64, shape=(-1,)),
            Tensor(name="finish_reason", dtype=bytes, shape=(1,))]


def model_config():
    from pytriton.model_config import ModelConfig
    return ModelConfig(batching=False, decoupled=True)


class BadRequest(ValueError):
    """A request's inputs are not a sequence the engine can run (the message names the input)."""


def _scalar(data: dict, name: str):
    v = data.get(name)
    if v is None:
        return None
    v = np.asarray(v).reshape(-1)
    if v.size != 1:
        raise BadRequest(f"input '{name}' must hold one value, got {v.size}")
    return v[0].item()


class TritonModel:
    """The inference callable bound to Triton: requests -> SeqSpecs for the engine loop; steps -> responses."""

    def __init__(self, engine: Engine, loop: EngineLoop):
        self.engine = engine
        self.loop = loop
        self.eos = frozenset(engine.manifest.model.eos_token_ids)

    def spec(self, data: dict) -> SeqSpec:
        prompt = np.asarray(data["prompt_ids"]).reshape(-1)
        if prompt.size == 0:
            raise BadRequest("input 'prompt_ids' is empty: give at least one token id")
        max_tokens = _scalar(data, "max_tokens")
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens)
        params = {n: _scalar(data, n) for n in (*FLOAT_PARAMS, *INT_PARAMS, "seed")}
        try:
            sampling = Sampling(**{k: v for k, v in params.items() if v is not None})
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e)) from None
        stop = {int(t) for t in np.asarray(data.get("stop_token_ids", np.zeros(0, np.int64))).reshape(-1)}
        if not _scalar(data, "ignore_eos"):
            stop |= self.eos
        return SeqSpec([int(t) for t in prompt], max_tokens, frozenset(stop), sampling)

    async def infer(self, requests):
        if len(requests) != 1:      # batching is off: Triton hands the requests over one at a time
            raise BadRequest(f"expected one request per call, got {len(requests)}")
        from pytriton.exceptions import PyTritonBadParameterError
        if not self.loop.alive:     # the loop thread failed (its log has the cause): no request could be served
            raise RuntimeError("the engine loop is not running; the server log has the cause")
        try:
            spec = self.spec(requests[0].data)
            self.engine.check_could_fit([(len(spec.prompt), spec.max_new_tokens)])
            inbox = Inbox()
            rids = await asyncio.wrap_future(self.loop.submit([spec], inbox, time.perf_counter()))
        except ValueError as e:     # BadRequest, or the engine's RequestRefused
            raise PyTritonBadParameterError(str(e)) from None
        done = False
        try:
            while not done:
                ids, reason = [], ""
                for u in await inbox.queue.get():
                    if u.token is None:
                        done = True
                        raise RuntimeError(u.error or "the sequence failed")
                    ids.append(u.token)
                    if u.finished:
                        done, reason = True, u.reason or "stop"
                yield [{"token_ids": np.asarray(ids, np.int64), "finish_reason": np.asarray([reason.encode()])}]
        finally:
            if not done:            # the stream was closed early
                self.loop.abort(rids, "abort")


def _stub_finds_this_python() -> None:
    """Triton's Python backend stub links libpython by its soname; where this interpreter is not the system's
    (pyenv, conda), the dynamic loader would pick the system's libpython, whose C modules do not match this
    interpreter's standard library. Put this interpreter's library directory first on LD_LIBRARY_PATH, which PyTriton
    passes on to the server."""
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
    if not libdir or not ldlib.startswith("libpython") or not (Path(libdir) / ldlib).exists():
        return
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if libdir not in paths:
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *paths])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlaloc_jax.serve.triton",
                                 description="Serve an artifact as a decoupled NVIDIA Triton model through PyTriton.")
    ap.add_argument("artifact")
    ap.add_argument("--model-name", default=None, help="the Triton model's name (default: the manifest's model name)")
    ap.add_argument("--host", default="127.0.0.1", help="address of the HTTP, gRPC and metrics endpoints")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=_positive, default=None,
                    help="most sequences running at once (default: the artifact's largest decode batch)")
    ap.add_argument("--max-model-len", type=_positive, default=None)
    ap.add_argument("--plugin", default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--trust-weights", action="store_true")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    from pytriton.triton import Triton, TritonConfig

    from tlaloc_jax.artifact import ManifestError, load_manifest, load_remembering

    from ..engine import DEFAULT_CACHE_DIR
    from ..runtime import CompileError, PluginNotFoundError

    cache_dir = DEFAULT_CACHE_DIR if args.cache_dir is None else None if args.cache_dir == "none" else args.cache_dir
    try:
        manifest = load_remembering(load_manifest, args.artifact, cache_dir, verify_weights=not args.trust_weights)
        engine = Engine.load(args.artifact, args.plugin, cache_dir=cache_dir, progress=False,
                             trust_weights=args.trust_weights, manifest=manifest, max_model_len=args.max_model_len)
    except (ManifestError, OSError, CompileError, PluginNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.model_name or manifest.model.name
    max_batch = args.max_batch or manifest.max_batch
    loop = EngineLoop(engine, max_batch, Metrics(name))
    model = TritonModel(engine, loop)
    _stub_finds_this_python()
    config = TritonConfig(http_address=args.host, http_port=args.http_port, grpc_address=args.host,
                          grpc_port=args.grpc_port, metrics_address=args.host, metrics_port=args.metrics_port,
                          exit_timeout_secs=5)
    # SIGTERM stops the server as Ctrl-C does (PyTriton's serve() returns on KeyboardInterrupt and then stops the
    # Triton server process it started); without this a terminated process would leave tritonserver running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    loop.start()
    try:
        with Triton(config=config) as triton:
            triton.bind(model_name=name, infer_func=model.infer, inputs=model_inputs(), outputs=model_outputs(),
                        config=model_config(), strict=True)
            log.info("serving %r from %s as a decoupled Triton model: HTTP %s:%d, gRPC %s:%d (max batch %d)", name,
                     args.artifact, args.host, args.http_port, args.host, args.grpc_port, max_batch)
            triton.serve()
    finally:
        loop.stop()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
