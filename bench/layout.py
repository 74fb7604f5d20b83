"""Decode step time of the two weight layouts (tlaloc_jax/layout.py) through the JAX-free runtime, in one run.

"stacked": one [L, ...] array per slot, the layers scanned; "per-layer": one array per layer, q|k|v and gate|up
fused, the layers unrolled. Both artifacts are exported from the same random Llama (about 100M parameters by
default, f32) and stepped interleaved, so the ratios hold on a noisy machine. Prints, per layout, the decode
step at batch 1, 2, 4, the batch-1 step as a multiple of the weight-read floor (the bytes a step reads over
the read bandwidth measured here) and the batch-4 step over the batch-1 step; and, from the optimized CPU HLO
of each layout's decode step, how many bytes of weight-sized copies (dynamic-slice fusions) it makes.

    python -m bench.layout                                     # this CPU
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 python -m bench.layout    # as an AVX2-only CPU would run it
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench.common import add_model_args, best_read_rate, llama_config, median_times, weight_memory  # noqa: E402

LAYOUTS = ("stacked", "per-layer")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--steps", type=int, default=15, help="timed decode steps per measurement")
    ap.add_argument("--plugin", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import tlaloc_jax
    from tlaloc_jax.checkpoint import random_weights, save_checkpoint
    from tlaloc_jax.decoder import StepInputs
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.families import config_from_hf
    from tlaloc_jax.layout import weight_slice_copies
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs
    from tlaloc_jax.artifact import Role
    from tlaloc_jax.serve import Engine

    hf = llama_config(args)
    fam, cfg = config_from_hf(hf)
    batches, block = (1, 2, 4), 16
    width = args.context // block
    pages = [list(range(b * width, (b + 1) * width)) for b in range(max(batches))]

    def step_inputs(b):
        rows = [RowCall([7], args.context // 2, pages[i]) for i in range(b)]
        return build_step_inputs(rows, batch=b, tokens=1, width=width, block_size=block)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        weights = random_weights(cfg, fam, seed=0, std=0.02)
        n_params = sum(w.size for w in weights.values())
        smallest = min(w.nbytes for k, w in weights.items() if k.startswith("attn.") and w.ndim == 3) // args.layers
        save_checkpoint(tmp / "ck", hf, weights)
        del weights
        engines, manifests, copies = {}, {}, {}
        for layout in LAYOUTS:
            t0 = time.perf_counter()
            manifests[layout] = export_checkpoint(tmp / "ck", tmp / layout, batch_ladder=batches,
                                                  context_ladder=(args.context,), prefill_max_batch=1,
                                                  block_size=block, progress=False, weight_layout=layout)
            engines[layout] = Engine.load(tmp / layout, args.plugin, cache_dir=None, progress=False)
            print(f"{layout}: export {time.perf_counter() - t0:.1f} s, load {engines[layout].load_seconds:.1f} s",
                  flush=True)
            model = tlaloc_jax.load_hf(tmp / "ck", block_size=block, weight_layout=layout)
            pools = model.new_pools(manifests[layout].pool("kv").capacity)
            inputs = StepInputs(**{k: jnp.asarray(v) for k, v in step_inputs(1).items()})
            hlo = model._step.lower(model.weights, pools, inputs).compile().as_text()
            copies[layout] = sum(weight_slice_copies(hlo, smallest))
            del model, pools
        print(f"model: llama, {n_params / 1e6:.1f}M parameters (f32), {args.layers} layers, hidden {args.hidden}, "
              f"vocab {args.vocab}; context {args.context}; jax {jax.__version__}; "
              f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")

        steps = {}
        for b in batches:
            inputs = step_inputs(b)
            fns = []
            for layout in LAYOUTS:
                entry = manifests[layout].entry(f"decode_b{b}_c{args.context}")
                fns.append(lambda e=engines[layout], entry=entry: e.runner.run(entry, inputs, {Role.NEXT_TOKEN}))
            for layout, t in zip(LAYOUTS, median_times(fns, args.steps)):
                steps[layout, b] = t

        m = manifests["per-layer"]
        embed = next(w for w in m.weights if w.slot == "embed")
        step_bytes = sum(w.nbytes for w in m.weights) - embed.nbytes + embed.nbytes // args.vocab
        cores = os.cpu_count() or 1
        memory = weight_memory(engines["per-layer"], {"embed"})      # the step's own weight pages (docs/cpu.md)
        bw = max(best_read_rate(memory, n) for n in (1, cores))
        floor = step_bytes / bw
        print(f"weight bytes a decode step reads: {step_bytes / 2**20:.1f} MiB; read bandwidth here {bw / 1e9:.2f} GB/s "
              f"-> floor {floor * 1e3:.2f} ms")
        print()
        print(f"{'layout':>10} | {'batch 1 ms':>10} | {'batch 2 ms':>10} | {'batch 4 ms':>10} | {'b1/floor':>8} | "
              f"{'b4/b1':>6} | weight copies in the step's HLO")
        for layout in LAYOUTS:
            t1, t2, t4 = (steps[layout, b] for b in batches)
            print(f"{layout:>10} | {t1 * 1e3:10.2f} | {t2 * 1e3:10.2f} | {t4 * 1e3:10.2f} | {t1 / floor:7.2f}x | "
                  f"{t4 / t1:5.2f}x | {copies[layout] / 2**20:.1f} MiB")
        print(f"per-layer / stacked at batch 1: {steps['per-layer', 1] / steps['stacked', 1]:.2f}x the time")
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    main()
