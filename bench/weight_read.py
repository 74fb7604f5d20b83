"""Weights becoming resident at load: `sharded.upload_weights` on a model's f32 weight files (Qwen3-0.6B's sizes by
default, 2.2 GiB in 197 files), with one reading thread against READ_THREADS, in interleaved rounds, each on a fresh
Device (what a warm start's "engine loaded" phase spends on the weights).

    python -m bench.weight_read                  # 3 rounds; the files are written once under --work
    python -m bench.weight_read --layers 4       # a quick look
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from bench.start import QWEN3_0_6B


def weight_files(a, folder: Path) -> list:
    """The shape's weights as files of random bytes (written once), with their WeightFile records."""
    from tlaloc_jax import artifact as af
    h, i, q, kv = a.hidden, a.intermediate, a.heads * a.head_dim, a.kv_heads * a.head_dim
    sizes = [a.vocab * h] + [n for _ in range(a.layers) for n in (h * q, h * kv, h * kv, q * h, h * i, h * i, i * h)]
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for k, n in enumerate(sizes):
        path = folder / f"w{k}.bin"
        if not path.exists() or path.stat().st_size != 4 * n:
            path.write_bytes(np.random.default_rng(k).integers(0, 255, 4 * n, dtype=np.uint8).tobytes())
        files.append(af.WeightFile(path.stem, "float32", (n,), 4 * n, file=path.name))
    return files


def main(argv=None) -> None:
    from tlaloc_jax.serve.runtime import Device, sharded
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in QWEN3_0_6B.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ap.add_argument("--work", default="/tmp/tlaloc-weight-read")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    folder = Path(a.work) / f"{a.layers}x{a.hidden}x{a.vocab}"
    files = weight_files(a, folder)
    print(f"{sum(f.nbytes for f in files) / 2**30:.2f} GiB in {len(files)} files", flush=True)
    threads = sharded.READ_THREADS
    times: dict[int, list[float]] = {1: [], threads: []}
    for rnd in range(a.rounds):
        for n in times:
            sharded.READ_THREADS = n
            with Device() as dev:
                t0 = time.perf_counter()
                sharded.upload_weights(dev, folder, files, None)
                times[n].append(time.perf_counter() - t0)
            print(f"round {rnd}: {n} thread(s) {times[n][-1]:.2f} s (load average {os.getloadavg()[0]:.1f})",
                  flush=True)
    ratios = ", ".join(f"{x / y:.2f}x" for x, y in zip(times[1], times[threads]))
    print(f"one thread / {threads}: {ratios}")


if __name__ == "__main__":
    main()
