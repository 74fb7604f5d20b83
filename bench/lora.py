"""What do LoRA adapter slots cost a decode step? Forms of one batch-8 step, timed interleaved in one run:

    python -m bench.lora                  # the 82M Llama of bench/serving.py, 8 slots of rank 16 on every projection
    python -m bench.lora --hidden 2048 --layers 4 --heads 16 --intermediate 5632    # adapters a smaller share

- "8 adapters f32" / "8 adapters bf16": the artifact exported with --max-loras 8 --max-lora-rank 16 and the
  adapters' A and B held in that dtype (--lora-dtype), each row with its own adapter;
- "slot 0": the f32 artifact, every row without an adapter (the call skips the adapter products);
- "no lora": the artifact exported without slots.
Each is the decode entry of 8 rows run through the runtime (Runner.run) on rows that read 48 positions and write
nothing (core.inputs.warm_up_inputs), the adapters written into the slots as the server writes them. Prints the
floor first: the bytes a step reads (every weight but the embedding table, whose rows it gathers, and every
adapter buffer) against the step without slots, since a batch-8 step is bound by reading them; then the medians
(wall and CPU) and the ratios to "no lora". The issue's bar is 8 adapters at most 1.3x.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

DTYPES = {"f32": "float32", "bf16": "bfloat16"}


def _export(ck: Path, out: Path, loras: int, rank: int, context: int, dtype: str) -> None:
    from tlaloc_jax.export import export_checkpoint
    if not (out / "tlaloc-serving.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        export_checkpoint(ck, out, batch_ladder=(8,), context_ladder=(context,), progress=False, max_loras=loras,
                          max_lora_rank=rank, lora_dtype=dtype, mixed=False, packed=False, prefill_long_chunk=0)


def step_bytes(m) -> int:
    """The bytes a decode step of manifest `m` reads: its weights but the embedding table (a gather of its rows;
    the bench's Llama has a head of its own), and its adapter buffers."""
    from tlaloc_jax.serve.runtime.adapters import adapter_bytes
    return sum(w.nbytes for w in m.weights if w.slot != m.model.embedding_slot) + adapter_bytes(m.lora)


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
    ap.add_argument("--lora-dtypes", default="f32,bf16", help="the adapter dtypes to time, comma-separated")
    ap.add_argument("--work", default="/tmp/tlaloc-lora-bench")
    a = ap.parse_args(argv)

    work = Path(a.work)
    ck = work / "ck"
    if not (ck / "model.safetensors").exists():
        save_random_checkpoint(llama_config(a), ck)
    kinds = [k for k in a.lora_dtypes.split(",") if k]
    for k in kinds:
        _export(ck, work / f"lora-{k}", a.rows, a.rank, a.context, DTYPES[k])
    _export(ck, work / "plain", 0, a.rank, a.context, None)

    rng = np.random.default_rng(0)
    engines = {k: Engine(work / f"lora-{k}", progress=False, cache_dir=None) for k in kinds}
    plain = Engine(work / "plain", progress=False, cache_dir=None)
    try:
        shape = engines[kinds[0]].manifest.lora
        for slot in range(1, a.rows + 1):     # a different random adapter in every slot, as the server writes them
            weights = {t.name: (rng.normal(0, 0.02, (t.layers, t.inputs, a.rank)).astype(np.float32),
                                rng.normal(0, 0.02, (t.layers, a.rank, t.outputs)).astype(np.float32))
                       for t in shape.targets}
            for eng in engines.values():
                eng.runner.adapters.write(slot, weights, 2.0)

        def step(engine, slots=None):
            e = next(x for x in engine.manifest.entries if x.kind == af.EntryKind.DECODE and x.batch == a.rows)
            inputs = warm_up_inputs(e, engine.runner, engine.ring_pages)
            if slots is not None:
                inputs[af.Role.LORA_SLOTS] = np.asarray(slots, np.int32)
            return lambda: engine.runner.run(e, inputs, {af.Role.NEXT_TOKEN})

        forms = {f"8 adapters {k}": step(eng, range(1, a.rows + 1)) for k, eng in engines.items()}
        forms.update({"slot 0": step(engines[kinds[0]], [0] * a.rows), "no lora": step(plain)})
        base_bytes = step_bytes(plain.manifest)
        floors = {k: step_bytes(eng.manifest) / base_bytes for k, eng in engines.items()}
        times = dict(zip(forms, median_wall_cpu(list(forms.values()), a.steps, warmup=3)))
    finally:
        for eng in [*engines.values(), plain]:
            eng.close()
    base_wall, base_cpu = times["no lora"]
    print(f"batch-{a.rows} decode step, {len(shape.targets)} targets, rank {a.rank}, context {a.context}, "
          f"{a.layers} layers of {a.hidden} (medians of {a.steps}, interleaved)")
    print(f"  floor: the step reads {base_bytes / 2**20:.1f} MiB without slots; with {a.rows} slots and slot 0: "
          + ", ".join(f"{k} {f:.3f}x" for k, f in floors.items()))
    for name, (wall, cpu) in times.items():
        print(f"  {name:16s} {wall * 1e3:7.2f} ms wall ({wall / base_wall:.2f}x)  {cpu * 1e3:7.2f} ms CPU "
              f"({cpu / base_cpu:.2f}x)")


if __name__ == "__main__":
    main()
