"""`make demo`: the whole path on the embedded model, in about a minute.

The embedded model (tlaloc_jax/demo_model) is a small Llama-architecture decoder that this project
trained itself on the Python standard library's sources (`python -m tlaloc_jax.tools.train`). The demo

  1. exports it to a serving artifact (jax.export, one StableHLO body per entry, pools donated),
  2. starts `python -m tlaloc_jax.serve` on a free loopback port (a process with no JAX in it),
  3. sends a streaming completion over HTTP and prints the text as it arrives,
  4. prints the time to first token and the tokens/s, and stops the server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..checkpoint import DEMO_MODEL

DEFAULT_PROMPT = "def read_config(path):\n    "
MODEL_NAME = "tlaloc-demo"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_demo(out_dir: Path, quiet: bool = True):
    """Export the embedded model with a small ladder (what the demo and its test serve)."""
    from ..export import Sampler, export_checkpoint
    return export_checkpoint(DEMO_MODEL, out_dir, batch_ladder=(1, 4), context_ladder=(256,), prefill_chunk=128,
                             block_size=16, progress=not quiet, sampler=Sampler())


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server on port {port} did not become healthy in {timeout:.0f} s")


def stream_completion(port: int, prompt: str, max_tokens: int, temperature: float, out=sys.stdout) -> dict:
    """POST /v1/completions with stream=true; print each text delta as it arrives. -> timings."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                       "seed": 0, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"the server answered {resp.status}: {resp.read().decode(errors='replace')}")
    first = last = None
    usage = {}
    chunks = 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        event = json.loads(data)
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            text = choice.get("text", "")
            if text:
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
                out.write(text)
                out.flush()
    out.write("\n")
    tokens = usage.get("completion_tokens", chunks)
    return dict(ttft=(first or t0) - t0, tokens=tokens, seconds=(last or t0) - t0,
                decode_rate=(tokens - 1) / (last - first) if first and last and last > first else float("nan"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlaloc_jax.tools.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    if not (DEMO_MODEL / "config.json").is_file():
        print(f"error: the embedded model is missing ({DEMO_MODEL}); train it with python -m tlaloc_jax.tools.train",
              file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="tlaloc-demo-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        m = export_demo(tmp / "artifact")
        cfg = m.model
        print(f"exported the embedded model ({cfg.model_type}, {cfg.layers} layers, hidden {cfg.hidden}, vocab "
              f"{cfg.vocab}; {sum(w.nbytes for w in m.weights) / 2**20:.1f} MiB of weights) to "
              f"{len(m.entries)} StableHLO entries in {time.perf_counter() - t0:.1f} s")
        port = free_port()
        env = dict(os.environ)
        env.pop("JAX_PLATFORMS", None)
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "tlaloc_jax.serve", str(tmp / "artifact"), "--port", str(port),
                                 "--cache-dir", str(tmp / "executables"), "--log-level", "warning",
                                 "--served-model-name", MODEL_NAME], env=env)
        try:
            wait_healthy(port, proc)
            print(f"python -m tlaloc_jax.serve (no JAX in it) is up on 127.0.0.1:{port} after "
                  f"{time.perf_counter() - t0:.1f} s")
            print(f"--- completion of {args.prompt!r} ---")
            sys.stdout.write(args.prompt)
            r = stream_completion(port, args.prompt, args.max_tokens, args.temperature)
            print("---")
            print(f"{r['tokens']} tokens; time to first token {r['ttft'] * 1e3:.0f} ms; "
                  f"{r['decode_rate']:.0f} tokens/s after it")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
