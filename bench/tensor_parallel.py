"""Tensor parallelism on CPU devices: one random Llama exported for 1, 2 and 4 devices, each served by the JAX-free
runtime (one PJRT client of N CPU devices), the decode steps of the three interleaved.

    .venv/bin/python -m bench.tensor_parallel                 # hidden 512, 6 layers, 8/4 heads: about 4 minutes
    .venv/bin/python -m bench.tensor_parallel --devices 1,2 --layers 12 --hidden 768 --heads 12 --kv-heads 4

Prints, per device count: the bytes each device holds (weights, pools), the load time with a warm compile cache
(reading each device's weight shards and uploading them), the decode step's median time at batches 1 and 4 and
its ratio to one device's, and whether the greedy ids equal one device's. The CPU plugin's devices share the
host's cores and memory bandwidth: on a machine of 2 cores, N devices split the same work N ways over the same 2
cores and add an all-reduce per attention and MLP, so no speed-up is expected here; what the bench shows on CPU is
the cost of that split and the bytes each device holds. bench/gpu.py --tensor-parallel N times the same on GPUs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench import common  # noqa: E402  (the model's arguments, interleaved timing)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap)
    ap.set_defaults(hidden=512, layers=6, heads=8, kv_heads=4, intermediate=1536, vocab=8192)
    ap.add_argument("--devices", default="1,2,4", help="device counts to compare (the first is the baseline)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per engine and batch")
    args = ap.parse_args(argv)
    counts = [int(n) for n in args.devices.split(",")]

    from tlaloc_jax import artifact as af
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs
    from tlaloc_jax.serve import Engine

    hf = common.llama_config(args)
    block, batches = 16, (1, 4)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        params = common.save_random_checkpoint(hf, tmp / "ck")
        engines, loads = {}, {}
        for n in counts:
            t0 = time.perf_counter()
            export_checkpoint(tmp / "ck", tmp / f"tp{n}", batch_ladder=batches, context_ladder=(args.context,),
                              prefill_max_batch=1, prefill_chunk=64, block_size=block, progress=False,
                              tensor_parallel=n)
            export_s = time.perf_counter() - t0
            Engine.load(tmp / f"tp{n}", cache_dir=tmp / "cache", progress=False).close()    # compiles, fills the cache
            engines[n] = Engine.load(tmp / f"tp{n}", cache_dir=tmp / "cache", progress=False)
            loads[n] = engines[n].load_seconds
            print(f"exported for {n} device(s) in {export_s:.1f} s; loaded (warm cache) in {loads[n]:.2f} s",
                  flush=True)
        print(f"model: llama, {params / 1e6:.1f}M parameters (f32), {args.layers} layers, hidden {args.hidden}, heads "
              f"{args.heads}/{args.kv_heads}, vocab {args.vocab}; context {args.context}; {os.cpu_count()} CPU cores")

        width = args.context // block
        pos = args.context // 2

        def step(eng, b):
            rows = [RowCall([7] * 1, pos, list(range(i * width, (i + 1) * width))) for i in range(b)]
            inputs = build_step_inputs(rows, batch=b, tokens=1, width=width, block_size=block)
            entry = eng.manifest.entry(f"decode_b{b}_c{args.context}")
            return lambda: eng.runner.run(entry, inputs, {af.Role.NEXT_TOKEN})

        ms = {}
        for b in batches:
            times = common.median_times([step(engines[n], b) for n in counts], args.steps)
            ms.update({(n, b): t * 1e3 for n, t in zip(counts, times)})
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        ids = {n: engines[n].generate([prompt], 16)[0] for n in counts}
        base = counts[0]
        print(f"{'devices':>7} {'weights/dev':>12} {'pools/dev':>10} {'load s':>7} "
              + " ".join(f"{f'b{b} ms':>8} {f'x{base}dev':>7}" for b in batches) + "  ids as 1 dev")
        for n in counts:
            st = engines[n].stats()
            wdev, pdev = _per_device(engines[n].manifest)
            assert st["bytes_per_device"] == wdev + pdev
            print(f"{n:>7} {wdev / 2**20:>9.1f} MiB {pdev / 2**20:>6.1f} MiB {loads[n]:>7.2f} "
                  + " ".join(f"{ms[(n, b)]:>8.2f} {ms[(n, b)] / ms[(base, b)]:>7.2f}" for b in batches)
                  + f"  {'yes' if ids[n] == ids[base] else 'NO'}")
        for eng in engines.values():
            eng.close()


def _per_device(m) -> tuple[int, int]:
    from tlaloc_jax.serve.runtime.sharded import bytes_per_device
    return bytes_per_device(m)


if __name__ == "__main__":
    main()
