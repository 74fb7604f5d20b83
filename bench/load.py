"""Load test of the HTTP server: requests/s, tokens/s, time to first token and inter-token latency at 1, 4 and 16
clients, for greedy and for sampled decoding.

    PYTHONPATH=tests/support python -m bench.load    # exports the tests' tiny model (sampler staged) into a temp dir
    python -m bench.load ARTIFACT_DIR [--requests-per-client 8] [--max-tokens 32] [--clients 1,4,16]
                                      [--modes greedy,sampled]

Starts `python -m tlaloc_jax.serve` on a free loopback port (nothing leaves 127.0.0.1), then for each mode and
level runs that many clients, each sending its requests one after another: streaming completions of
token-id prompts with ignore_eos, so every request generates exactly --max-tokens tokens; greedy at
temperature 0, sampled at temperature 0.8, top_p 0.95, top_k 50 (a seed per request). With an artifact whose
entries carry the sampler the draw is made in the body; without one the host samples from pulled logits. Times are measured by the clients (TTFT: request sent to the first token's chunk; ITL: between
a request's consecutive token chunks). Bounded: clients x requests-per-client requests per level, each
with a timeout. Prints a Markdown table and the server's batch statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _tiny_artifact(out: Path) -> Path:
    try:        # the tests' helpers: their folder is on the path when run as PYTHONPATH=tests/support python -m bench.load
        from hf_models import build_checkpoint
        from tokenizers_util import EOS, VOCAB, write_tokenizer
    except ImportError as e:
        raise SystemExit(f"bench.load builds the tests' tiny model with tests/support/hf_models.py ({e}): run it as "
                         "`PYTHONPATH=tests/support python -m bench.load`, or pass an ARTIFACT_DIR") from None

    from tlaloc_jax.export import Sampler, export_checkpoint

    ck = build_checkpoint(out / "ck", "llama", seed=31, vocab_size=VOCAB, eos_token_id=EOS)
    write_tokenizer(ck)
    export_checkpoint(ck, out / "artifact", batch_ladder=(1, 4, 8), context_ladder=(32, 64), block_size=8,
                      prefill_chunk=16, prefill_max_batch=4, num_blocks=128, progress=False, sampler=Sampler())
    return out / "artifact"


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}


@contextlib.contextmanager
def serving(artifact: Path, tmp: Path, extra: list[str] = ()):
    """`python -m tlaloc_jax.serve ARTIFACT` on a free loopback port, once /health answers: its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tlaloc_jax.serve", str(artifact), "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", "--cache-dir", str(tmp / "cache"), *extra]
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError((tmp / "server.log").read_text()[-3000:])
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


async def stream_times(http: httpx.AsyncClient, path: str, body: dict) -> tuple[float, list[float], int, dict]:
    """-> (ttft, inter-token gaps, tokens, the last chunk's choice) of one streaming request (return_token_ids)."""
    t0 = time.perf_counter()
    times, tokens, last = [], 0, {}
    async with http.stream("POST", path, json=dict(body, stream=True, return_token_ids=True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                n = len(choices[0].get("token_ids") or []) if choices else 0
                last = choices[0] if choices else last
                if n:
                    times.append(time.perf_counter())
                    tokens += n
    return (times[0] - t0 if times else float("nan")), list(np.diff(times)), tokens, last


async def _one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int, mode: str,
               seed: int) -> tuple[float, list[float], int]:
    """-> (ttft, inter-token gaps, tokens) of one streaming request."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if mode == "sampled":
        body.update(SAMPLED, seed=seed)
    return (await stream_times(http, "/v1/completions", body))[:3]


async def _level(url: str, clients: int, per_client: int, max_tokens: int, seed: int, mode: str = "greedy") -> dict:
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(1, 250, size=int(rng.integers(4, 17)))]
               for _ in range(clients * per_client)]
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def client(i):
            return [await _one(http, prompts[i * per_client + k], max_tokens, mode, seed * 1000 + i * per_client + k)
                    for k in range(per_client)]
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(i) for i in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    ttft = np.array([r[0] for r in results]) * 1e3
    itl = np.array([g for r in results for g in r[1]]) * 1e3
    tokens = sum(r[2] for r in results)
    return dict(clients=clients, requests=len(results), wall=wall, rps=len(results) / wall, tps=tokens / wall,
                ttft=np.percentile(ttft, [50, 90, 99]), itl=np.percentile(itl, [50, 90, 99]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", nargs="?", help="artifact directory (default: export the tests' tiny model)")
    ap.add_argument("--clients", default="1,4,16", help="concurrency levels (default 1,4,16)")
    ap.add_argument("--requests-per-client", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="greedy,sampled", help="greedy, sampled or both (default both)")
    ap.add_argument("--max-batch", type=int, default=None, help="passed to the server")
    ap.add_argument("--plugin", default=None, help="passed to the server")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.clients.split(",")]
    modes = [m for m in args.modes.split(",") if m]

    with tempfile.TemporaryDirectory() as tmp:
        artifact = Path(args.artifact) if args.artifact else _tiny_artifact(Path(tmp))
        extra = ["--max-batch", str(args.max_batch)] if args.max_batch else []
        extra += ["--plugin", args.plugin] if args.plugin else []
        with serving(artifact, Path(tmp), extra) as url:
            asyncio.run(_level(url, 2, 2, args.max_tokens, seed=99))      # warm-up: first calls, allocations
            print(f"artifact {artifact}; streaming completions of {args.max_tokens} tokens, "
                  f"{args.requests_per_client} requests per client, loopback\n")
            print("| mode | clients | requests | req/s | tokens/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) "
                  "| mean batch | tokens/s vs greedy |")
            print("|---|---|---|---|---|---|---|---|---|")
            greedy_tps = {}
            for mode in modes:
                for c in levels:
                    before = _metrics(url)
                    r = asyncio.run(_level(url, c, args.requests_per_client, args.max_tokens, seed=c, mode=mode))
                    after = _metrics(url)
                    calls = after["tlaloc_batch_size_count"] - before["tlaloc_batch_size_count"]
                    rows = after["tlaloc_batch_size_sum"] - before["tlaloc_batch_size_sum"]
                    if mode == "greedy":
                        greedy_tps[c] = r["tps"]
                    ratio = f"{r['tps'] / greedy_tps[c]:.2f}" if c in greedy_tps else "-"
                    print(f"| {mode} | {c} | {r['requests']} | {r['rps']:.1f} | {r['tps']:.0f} | "
                          f"{' / '.join(f'{x:.1f}' for x in r['ttft'])} | {' / '.join(f'{x:.2f}' for x in r['itl'])} | "
                          f"{rows / calls:.2f} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
