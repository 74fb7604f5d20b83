"""python -m tlaloc_jax.serve ARTIFACT_DIR [--host 127.0.0.1] [--port 8000] [--plugin PATH] [--max-num-seqs N]
[--max-model-len N] [--api-key KEY] [--metrics-without-key] [--allowed-hosts HOST,...] [--allowed-origins ORIGIN,...]
[--strict-fields] [--embedding-artifact DIR] [--lazy-compile]"""

from __future__ import annotations

import argparse
import contextlib
import gc
import ipaddress
import errno
import logging
import os
import socket
import sys
import time


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _names(values: list[str]) -> list[str]:
    """Repeated, comma-separated flag values -> one list."""
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _allowed_hosts(bind: str, extra: list[str], loopback_names: tuple[str, ...]) -> list[str] | None:
    """The Host header names to answer: on a loopback address, the loopback names, the address itself and
    `extra`; elsewhere `extra` alone, or None (every Host) when there is none."""
    if not _is_loopback(bind):
        return extra or None
    own = f"[{bind}]" if ":" in bind else bind
    return [*loopback_names, own, *extra]


def port_problem(host: str, port: int) -> str | None:
    """Why uvicorn could not listen on host:port, or None: each address the host resolves to is bound as asyncio's
    create_server binds it (SO_REUSEADDR; v6 only on IPv6), then let go. Checked before the model loads, which can
    take minutes."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"--host {host} does not resolve ({e.strerror}); give an address or a name this machine knows"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return (f"port {port} on {host} is in use (another server?); stop what holds it, or pick a free "
                            "one with --port")
                return f"cannot listen on {host} port {port} ({e.strerror}); pick another --host or --port"
    return None


def describe_pools(engine) -> str:
    """The engine's pools for the start-up log, each by its kind: "KV pool 64 pages of 16 positions", "state
    pool 4 slots"."""
    parts = []
    for alloc in engine.scheduler.kv.pools.values():
        size = f" of {engine.block_size} positions" if alloc.unit == "pages" else ""
        parts.append(f"{alloc.name} pool {alloc.num_units} {alloc.unit}{size}")
    return ", ".join(parts)


def freeze_heap() -> int:
    """Collect, then put every object alive into the collector's permanent generation (gc.freeze), as vLLM does once
    started: the loaded server's objects (75k) live as long as it does, and a full collection that scans them stops
    the engine loop for about a decode step. Objects made later are still collected. -> how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _uvicorn_server(uvicorn, config):
    """A uvicorn.Server that ends with status 0 after a clean shutdown on SIGTERM or SIGINT: uvicorn raises the
    signal it caught again once it has shut down, which would end the process with -15."""

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()      # shut down cleanly: nothing left for the signal to do

    return Server(config)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tlaloc_jax.serve",
        description="Serve an artifact over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /tokenize, /health, /metrics), without JAX. The artifact is one written by "
                    "`python -m tlaloc_jax.export` from a checkpoint or by `tlaloc_jax.stage` from a model you "
                    "wrote. Its tokenizer is optional: with tokenizer.json the server takes and returns text (and "
                    "serves chat through the checkpoint's chat template); without, prompts and answers are token "
                    "ids.")
    ap.add_argument("artifact", help="artifact directory (tlaloc-serving.json, bodies, weights; tokenizer files "
                                     "when the model has them)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1, loopback only; 0.0.0.0 listens on every interface)")
    ap.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    ap.add_argument("--plugin", default=None,
                    help="PJRT plugin library (default: the CPU plugin of lammps-jax-pjrt-cpu)")
    ap.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=_positive, default=None,
                    help="most sequences running at once; later requests wait for a slot (default: the largest "
                         "decode batch of the artifact); --max-num-seqs is vLLM's name")
    ap.add_argument("--max-num-batched-tokens", type=_positive, default=None,
                    help="tokens one step computes at most: every running sequence's next token, then prompt chunks "
                         "(default: the artifact's longest prefill chunk times its largest prefill batch, plus "
                         "--max-num-seqs)")
    ap.add_argument("--max-waiting", type=_positive, default=None,
                    help="sequences that may wait to run; past it new requests get 503 (default 1024)")
    ap.add_argument("--max-wait-seconds", type=float, default=None,
                    help="a request that waited this long before any of its sequences started fails with 503 "
                         "(default: no limit)")
    ap.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                    help="fcfs: first come, first served (a request's non-zero 'priority' is refused); priority: "
                         "requests with a lower 'priority' run first, ties in arrival order (default fcfs, as vLLM)")
    ap.add_argument("--return-tokens-as-token-ids", action="store_true",
                    help="logprob tokens as 'token_id:N' strings unless a request's return_tokens_as_token_ids says "
                         "otherwise (vLLM's flag)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="reuse the KV pages of prompt prefixes computed before (default: on, unless a pool cannot "
                         "be reused exactly, such as a sliding window's ring)")
    ap.add_argument("--speculative-config", default=None, metavar="JSON",
                    help="speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                         "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' drafts up to 3 tokens a step by prompt "
                         "lookup and checks them in one call of the artifact's verify entries (export "
                         "--speculative-tokens); sampled requests draft where the verify entries take the sampler; "
                         "'{\"method\": \"draft_model\", \"model\": \"DRAFT_ARTIFACT\", \"num_speculative_tokens\": 3}' "
                         "drafts with a second artifact of the same tokenizer; \"disable_by_batch_size\": N turns "
                         "drafting off while N or more sequences run (default: off)")
    ap.add_argument("--max-model-len", type=_positive, default=None,
                    help="longest sequence served, prompt plus new tokens (default and at most: the artifact's "
                         "largest context)")
    ap.add_argument("--strict-fields", action="store_true",
                    help="refuse (400) request fields this server does not know; by default they are logged as "
                         "ignored, as vLLM does")
    ap.add_argument("--no-progress", action="store_true",
                    help="no compile progress bar on a terminal (elsewhere, as in a log, progress is a plain line "
                         "every 10 s)")
    ap.add_argument("--lazy-compile", action="store_true",
                    help="serve as soon as the artifact is loaded, compiling each entry on its first use (the first "
                         "requests that need one wait for it): for development. By default every entry is compiled "
                         "(or loaded from the compile cache, in threads while the weights are read) first, /health "
                         "answering 503 with how far it got and requests 503 with Retry-After until then")
    ap.add_argument("--compile-processes", type=int, default=None, metavar="N",
                    help="without --lazy-compile, the entries in neither compile cache compile in up to N worker "
                         "processes into --cache-dir (default and most: one a core; under 2, in this process)")
    ap.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $TLALOC_API_KEY, else "
                         "no key)")
    ap.add_argument("--metrics-without-key", action="store_true",
                    help="answer /metrics without --api-key, for a scraper that cannot send one (its counters show "
                         "when prompts hit the prefix cache: keep it on loopback); by default /metrics needs the "
                         "key when one is set, and /health never does")
    ap.add_argument("--allowed-hosts", action="append", default=[], metavar="HOST[,HOST...]",
                    help="Host header names to answer besides localhost, 127.0.0.1 and [::1] when bound to loopback "
                         "(any other Host gets 421: DNS rebinding); on other addresses, the only names answered "
                         "(default there: any); '*' answers any")
    ap.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN...]",
                    help="browser origins (e.g. https://app.example) allowed to call the API: CORS (default none; "
                         "'*' for any)")
    ap.add_argument("--served-model-name", default=None,
                    help="the model id of /v1/models and the 'model' field (default: the manifest's model name)")
    ap.add_argument("--max-body-bytes", type=_positive, default=None,
                    help="largest request body in bytes (default 1 MiB); larger ones are answered 413")
    ap.add_argument("--cache-dir", default=None,
                    help="compiled-executable cache (default ~/.cache/tlaloc-jax/executables; 'none' to disable)")
    ap.add_argument("--trust-weights", action="store_true",
                    help="skip hashing the weight files at load (their sizes are still checked): for very large "
                         "artifacts whose weights are known good; the log says so")
    ap.add_argument("--map-weights", action="store_true",
                    help="serve the weights from their files' mappings, not read into huge-page memory: a warm start "
                         "without allocating the weights' size (a host short of free memory reclaims it first), "
                         "4 KiB pages in every step (a few percent of a small batch's decode, docs/cpu.md)")
    ap.add_argument("--embedding-artifact", default=None, metavar="DIR",
                    help="also serve this embedding program (a bounded-program artifact written by "
                         "tlaloc_jax.stage_bounded with an embedding task) on /v1/embeddings, on the same device")
    ap.add_argument("--embedding-model-name", default=None,
                    help="the embedding program's model id (default: its manifest's name)")
    ap.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help="PEFT LoRA adapters to serve, each name=path or vLLM's JSON form {\"name\": ..., \"path\": "
                         "..., \"base_model_name\": ...}; a request's model picks one by name (the artifact must be "
                         "exported with adapter slots). POST /v1/load_lora_adapter and /v1/unload_lora_adapter change "
                         "them while serving where VLLM_ALLOW_RUNTIME_LORA_UPDATING=true")
    ap.add_argument("--max-cpu-loras", type=_positive, default=None,
                    help="adapters kept read in host memory beyond the artifact's slots (default: as many as its slots)")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = ap.parse_args(argv)

    from . import http
    api_key, key_source = ((args.api_key, "--api-key") if args.api_key is not None
                           else (os.environ.get("TLALOC_API_KEY"), "$TLALOC_API_KEY"))
    if api_key is not None and (problem := http.api_key_problem(api_key)) is not None:
        print(f"error: {key_source} {problem}: every request would be refused; give a key, or leave it out to "
              "serve without one", file=sys.stderr)
        return 2
    try:
        allowed_hosts = _allowed_hosts(args.host, sorted(http.allowed_host_names(_names(args.allowed_hosts))),
                                       http.LOOPBACK_HOSTS)
    except ValueError as e:
        print(f"error: --allowed-hosts: {e}", file=sys.stderr)
        return 2

    if (problem := port_problem(args.host, args.port)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("tlaloc_jax.serve")

    import prometheus_client
    import uvicorn

    from tlaloc_jax.artifact.bounded_manifest import load_bounded
    from tlaloc_jax.artifact import ManifestError, load_manifest, load_remembering
    from tlaloc_jax.native import NativeKernelError

    from .bounded_program import BoundedProgram
    from .openai.lora_routes import lora_modules
    from .openai.embeddings import Embeddings, embedding_task, load_embedding_tokenizer
    from .engine import DEFAULT_CACHE_DIR, Engine
    from .runtime import CompileError, PluginNotFoundError
    from .readiness import process_seconds
    from .tokenizer import load_tokenizer

    # (phase, when it ended) on perf_counter's clock, from the process's start: the start-up line's phases
    age = process_seconds()
    marks = [("", time.perf_counter())] if age is None else [("", time.perf_counter() - age),
                                                              ("Python and imports", time.perf_counter())]
    cache_dir = DEFAULT_CACHE_DIR if args.cache_dir is None else None if args.cache_dir == "none" else args.cache_dir
    bar = not args.no_progress and sys.stderr.isatty()
    prometheus_client.disable_created_metrics()     # no *_created series: they are noise to a scraper
    try:
        # Everything that can be checked without the device first: the manifest, every file and body
        # signature, and the tokenizer, so a bad artifact is refused before anything compiles.
        # A file unchanged since a load with this cache directory is not hashed again (FileDigests).
        manifest = load_remembering(load_manifest, args.artifact, cache_dir, verify_weights=not args.trust_weights)
        tokenizer = load_tokenizer(args.artifact, manifest)
        if args.embedding_artifact is not None:
            try:
                embedding_manifest = load_remembering(load_bounded, args.embedding_artifact, cache_dir,
                                                      verify_weights=not args.trust_weights)
                embedding_task(embedding_manifest)
                embedding_tokenizer = load_embedding_tokenizer(args.embedding_artifact, embedding_manifest)
            except ManifestError as e:
                raise ManifestError(f"--embedding-artifact: {e}") from None
        marks.append(("artifact checked", time.perf_counter()))
        largest = max(manifest.buckets.context_ladder)
        if args.max_model_len is not None and args.max_model_len > largest:
            raise ValueError(f"--max-model-len {args.max_model_len} is past the artifact's largest context "
                             f"({largest}); export a longer context ladder to serve longer sequences")
        # The bar shows the compile of each entry (a cold cache on a large artifact takes minutes); in a log, where
        # its redraws would make one long line, the loaded line says what compiled.
        engine = Engine.load(args.artifact, args.plugin, cache_dir=cache_dir, progress=bar,
                             trust_weights=args.trust_weights, manifest=manifest, max_model_len=args.max_model_len,
                             max_num_seqs=args.max_batch, max_num_batched_tokens=args.max_num_batched_tokens,
                             enable_prefix_caching=args.enable_prefix_caching,
                             lora_modules=lora_modules(args.lora_modules), max_cpu_loras=args.max_cpu_loras,
                             speculative_config=args.speculative_config, map_weights=args.map_weights,
                             preload=not args.lazy_compile, compile_processes=args.compile_processes)
        marks.append(("engine loaded", time.perf_counter()))
    except (ManifestError, OSError, CompileError, PluginNotFoundError, NativeKernelError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    embeddings = None
    if args.embedding_artifact is not None:
        try:
            program = BoundedProgram.load(args.embedding_artifact, device=engine.device, cache_dir=cache_dir,
                                          trust_weights=args.trust_weights, manifest=embedding_manifest)
        except (ManifestError, OSError, CompileError) as e:
            engine.close()
            print(f"error: --embedding-artifact: {e}", file=sys.stderr)
            return 2
        embeddings = Embeddings(program, embedding_tokenizer, args.embedding_model_name)
    try:
        app = http.create_app(engine, tokenizer=tokenizer, model_name=args.served_model_name, api_key=api_key,
                              max_batch=args.max_batch,
                              max_body_bytes=args.max_body_bytes or http.DEFAULT_MAX_BODY_BYTES,
                              allowed_hosts=allowed_hosts, allowed_origins=_names(args.allowed_origins),
                              embeddings=embeddings, strict_fields=args.strict_fields,
                              max_waiting=args.max_waiting or http.DEFAULT_MAX_WAITING,
                              max_wait_seconds=args.max_wait_seconds, metrics_without_key=args.metrics_without_key,
                              scheduling_policy=args.scheduling_policy,
                              return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                              compile_all=not args.lazy_compile, progress="bar" if bar else "log")
        server = app.state.server
        if server.loop.readiness is not None:
            marks.append(("server set up", time.perf_counter()))
            server.loop.readiness.phases = {k: b - a for (_, a), (k, b) in zip(marks, marks[1:])}
        if not _is_loopback(args.host) and not api_key:
            log.warning("listening on %s without --api-key: anyone who can reach this port can use the model",
                        args.host)
        elif api_key and args.metrics_without_key and not _is_loopback(args.host):
            log.warning("listening on %s with --metrics-without-key: anyone who can reach this port can read /metrics, "
                        "whose counters show when prompts hit the prefix cache", args.host)
        log.info("serving %r from %s on http://%s:%d (max batch %d, %s, context %d, %s, %s)",
                 server.model_name, args.artifact, args.host, args.port, server.loop.max_running,
                 describe_pools(engine), engine.max_context,
                 "tokenizer" if server.tokenizer else "no tokenizer: token ids only",
                 "sampling in the body" if engine.sampler else "sampling on the host (the artifact has no sampler)")
        if embeddings is not None:
            log.info("serving embedding model %r from %s on /v1/embeddings (%d dimensions, at most %d tokens, %s)",
                     embeddings.model_name, args.embedding_artifact, embeddings.dimensions, embeddings.max_tokens,
                     "tokenizer" if embeddings.prompt_tokenizer else "no tokenizer: token ids only")
        log.info("froze %d objects of the loaded server out of the collector's scans", freeze_heap())
        srv = _uvicorn_server(uvicorn, uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                                      timeout_graceful_shutdown=5))
        try:
            srv.run()
        except KeyboardInterrupt:   # uvicorn re-raises Ctrl-C after its graceful shutdown
            pass
    finally:
        if embeddings is not None:
            embeddings.program.close()
        engine.close()
    return 0 if srv.started else 1      # not started: the port could not be bound


if __name__ == "__main__":
    sys.exit(main())
