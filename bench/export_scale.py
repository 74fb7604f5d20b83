"""The export at the sizes people run on CPUs: `python -m tlaloc_jax.export` of a random bf16 Llama checkpoint of the
Llama-3.2-1B, Llama-3.2-3B or Llama-3.1-8B shape (bench/shapes.py), in a subprocess of its own.

Printed per weight quantization: the export's peak resident set (the child's ru_maxrss, from wait4), its wall time
and where the time goes (the exporter's own "time:" line: tracing and lowering the entries, reading the
checkpoint's tensors, converting, quantizing, writing and hashing the weight files), the disk the checkpoint and the
artifact take. The issue's bar (issue 57): peak <= 4.5 GiB for the 3B and 8B shapes, int8 and int4.

    python -m bench.export_scale --shape 8b --weight-quant int8,int4
    python -m bench.export_scale --shape 3b --weight-quant int8 --keep     # keep the checkpoint and the artifact

The checkpoint is written into --cache (default ~/.cache/tlaloc-bench; the 8B shape's ~16 GB of shards) and reused
while it is there; without --keep the artifacts are deleted once measured and the checkpoint after the last one
(--keep-checkpoint keeps it alone).
Check `df` first: the 8B shape needs ~16 GB for the shards and ~9 GB more for an int8 artifact.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import disk_bytes
from bench.shapes import SHAPES, hf_config, write_checkpoint

GiB = 2 ** 30
BAR = 4.5 * GiB


def run_export(checkpoint: Path, out: Path, quant: str, args: list[str]) -> tuple[int, float, str]:
    """`python -m tlaloc_jax.export` in a child -> (its peak resident set in bytes, wall seconds, its output)."""
    cmd = [sys.executable, "-m", "tlaloc_jax.export", str(checkpoint), str(out), "--weight-quant", quant, *args]
    t0 = time.perf_counter()
    log = out.with_name(out.name + ".log")
    with open(log, "w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    text = log.read_text()
    log.unlink()
    if child.returncode:
        raise SystemExit(f"the export failed ({child.returncode}):\n{text[-4000:]}")
    return usage.ru_maxrss * 1024, wall, text        # ru_maxrss: KiB on Linux


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--weight-quant", default="int8", help="comma-separated: int8, int4, fp8 or none (default int8)")
    ap.add_argument("--weight-dtype", choices=["bf16", "f32"], default="bf16",
                    help="the dtype of the weights a quantization keeps (embedding, norms, head; default bf16)")
    ap.add_argument("--quant-group", type=int, default=32, help="int4 group size (default 32, as Q4_0's blocks)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tlaloc-bench")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the artifacts")
    ap.add_argument("--keep-checkpoint", action="store_true", help="keep the checkpoint for the next run")
    ap.add_argument("--export-args", default="--batch-ladder 1,4 --context-ladder 2048 --prefill-chunk 256",
                    help="more arguments to the exporter (default: batches 1 and 4, one 2,048-position context)")
    a = ap.parse_args(argv)
    ck = a.cache / f"ck-{a.shape}"
    if not (ck / "config.json").is_file():
        t0 = time.perf_counter()
        n = write_checkpoint(hf_config(a.shape), ck, log=lambda s: print("  " + s, flush=True))
        print(f"checkpoint {a.shape}: {n / 1e9:.2f}B parameters, bf16 shards {disk_bytes(ck) / GiB:.1f} GiB, "
              f"written in {time.perf_counter() - t0:.0f} s", flush=True)
    else:
        print(f"checkpoint {a.shape}: reused {ck} ({disk_bytes(ck) / GiB:.1f} GiB)", flush=True)
    try:
        for quant in a.weight_quant.split(","):
            out = a.cache / f"art-{a.shape}-{quant}"
            shutil.rmtree(out, ignore_errors=True)
            extra = ["--weight-dtype", a.weight_dtype, "--quant-group", str(a.quant_group), "--quiet",
                     *a.export_args.split()]
            peak, wall, text = run_export(ck, out, quant, extra)
            where = next((line[len("time: "):] for line in text.splitlines() if line.startswith("time: ")), "?")
            print(f"{a.shape} {quant}: peak resident set {peak / GiB:.2f} GiB "
                  f"({'within' if peak <= BAR else 'OVER'} the 4.5 GiB bar), {wall:.0f} s ({where}), "
                  f"artifact {disk_bytes(out) / GiB:.2f} GiB on disk, checkpoint {disk_bytes(ck) / GiB:.2f} GiB",
                  flush=True)
            if not a.keep:
                shutil.rmtree(out)
    finally:
        if not (a.keep or a.keep_checkpoint):
            shutil.rmtree(ck, ignore_errors=True)


if __name__ == "__main__":
    main()
