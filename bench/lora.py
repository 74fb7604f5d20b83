"""What do LoRA adapter slots cost a decode step? Three forms of one batch-8 step, timed interleaved in one run:

    python -m bench.lora                  # the 82M Llama of bench/serving.py, 8 slots of rank 16 on every projection

- "8 adapters": the artifact exported with --max-loras 8 --max-lora-rank 16, each row with its own adapter;
- "slot 0": the same artifact, every row without an adapter (the zero slot's gather and products);
- "no lora": the artifact exported without slots.
Each is the decode entry of 8 rows run through the runtime (Runner.run) on rows that read 48 positions and write
nothing (core.inputs.warm_up_inputs), the adapters written into the slots as the server writes them. Prints the
medians (wall and CPU) and the ratios to "no lora"; the issue's bar is "8 adapters" at most 1.3x.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402


def _export(ck: Path, out: Path, loras: int, rank: int, context: int) -> None:
    from tlaloc_jax.export import export_checkpoint
    if not (out / "tlaloc-serving.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        export_checkpoint(ck, out, batch_ladder=(8,), context_ladder=(context,), progress=False, max_loras=loras,
                          max_lora_rank=rank, mixed=False, packed=False, prefill_long_chunk=0)


def main(argv=None) -> None:
    from bench.common import add_model_args, llama_config, median_wall_cpu, save_random_checkpoint
    from tlaloc_jax import artifact as af
    from tlaloc_jax.serve import Engine
    from tlaloc_jax.serve.core.inputs import warm_up_inputs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8, help="decode rows, each with its own adapter")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--work", default="/tmp/tlaloc-lora-bench")
    a = ap.parse_args(argv)

    work = Path(a.work)
    ck = work / "ck"
    if not (ck / "model.safetensors").exists():
        save_random_checkpoint(llama_config(a), ck)
    _export(ck, work / "lora", a.rows, a.rank, a.context)
    _export(ck, work / "plain", 0, a.rank, a.context)

    rng = np.random.default_rng(0)
    with Engine(work / "lora", progress=False, cache_dir=None) as lora, \
            Engine(work / "plain", progress=False, cache_dir=None) as plain:
        shape = lora.manifest.lora
        for slot in range(1, a.rows + 1):     # a different random adapter in every slot, as the server writes them
            weights = {t.name: (rng.normal(0, 0.02, (t.layers, t.inputs, a.rank)).astype(np.float32),
                                rng.normal(0, 0.02, (t.layers, a.rank, t.outputs)).astype(np.float32))
                       for t in shape.targets}
            lora.runner.adapters.write(slot, weights, 2.0)

        def step(engine, slots=None):
            e = next(x for x in engine.manifest.entries if x.kind == af.EntryKind.DECODE and x.batch == a.rows)
            inputs = warm_up_inputs(e, engine.runner, engine.ring_pages)
            if slots is not None:
                inputs[af.Role.LORA_SLOTS] = np.asarray(slots, np.int32)
            return lambda: engine.runner.run(e, inputs, {af.Role.NEXT_TOKEN})

        forms = {"8 adapters": step(lora, range(1, a.rows + 1)), "slot 0": step(lora, [0] * a.rows),
                 "no lora": step(plain)}
        times = dict(zip(forms, median_wall_cpu(list(forms.values()), a.steps, warmup=3)))
    base_wall, base_cpu = times["no lora"]
    print(f"batch-{a.rows} decode step, {len(shape.targets)} targets, rank {a.rank}, context {a.context}, "
          f"{a.layers} layers of {a.hidden} (medians of {a.steps}, interleaved)")
    for name, (wall, cpu) in times.items():
        print(f"  {name:10s} {wall * 1e3:7.2f} ms wall ({wall / base_wall:.2f}x)  {cpu * 1e3:7.2f} ms CPU "
              f"({cpu / base_cpu:.2f}x)")


if __name__ == "__main__":
    main()
