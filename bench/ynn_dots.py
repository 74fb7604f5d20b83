"""The per-layer decode step with and without XLA's YNNPACK dot fusions, in one process, interleaved.

On XLA's CPU backend (jax 0.10) a batch-1 projection is a matrix-vector product that XLA emits itself, while
at batch 2 and up every projection becomes a `__ynn_fusion` (YNNPACK's dot, kernel
`ynn::dot_fp32_4x64x1_1x16x1` at batch 4): it reads the [in, out] weight in place (no copy, transpose or
packing in a profile), but walks it in 64-column strips whose rows are `out * 4` bytes apart. This compiles the
same step twice -- XLA's default options, and `xla_cpu_experimental_ynn_fusion_type=""` (no YNNPACK fusions,
the dots go to XLA's own dot path) -- times both interleaved at batch 1 and 4, and prints each batch-4 step
over its batch-1 step. The runtime's plugin reads the same option from
`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`.

    python bench/ynn_dots.py                # ~100M parameters, this CPU
    python bench/ynn_dots.py --isa AVX2     # as an AVX2-only CPU would run it
"""

from __future__ import annotations

import argparse
import sys
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from decode import add_model_args, llama_config  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--steps", type=int, default=21, help="timed steps per variant and batch")
    ap.add_argument("--isa", default=None, help="xla_cpu_max_isa for both compiles (e.g. AVX2)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import tlaloc_jax
    from tlaloc_jax.checkpoint import random_weights, save_checkpoint
    from tlaloc_jax.decoder import StepInputs
    from tlaloc_jax.families import config_from_hf
    from tlaloc_jax.paging import RowCall, build_step_inputs

    hf = llama_config(args)
    fam, cfg = config_from_hf(hf)
    block, width, batches = 16, args.context // 16, (1, 4)
    base = {"xla_cpu_max_isa": args.isa} if args.isa else {}
    variants = {"default": dict(base), "no-ynn": dict(base, xla_cpu_experimental_ynn_fusion_type="")}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp) / "ck", hf, random_weights(cfg, fam, seed=0, std=0.02))
        model = tlaloc_jax.load_hf(Path(tmp) / "ck", block_size=block, weight_layout="per-layer")
    print(f"model: llama, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, f32, per-layer layout; "
          f"context {args.context}; jax {jax.__version__}; isa {args.isa or 'native'}")
    steps = {}
    for b in batches:
        rows = [RowCall([7], args.context // 2, list(range(i * width, (i + 1) * width))) for i in range(b)]
        inputs = StepInputs(**{k: jnp.asarray(v) for k, v in
                               build_step_inputs(rows, batch=b, tokens=1, width=width, block_size=block).items()})
        compiled, pools, logits = {}, {}, {}
        for name, options in variants.items():
            p = model.new_pools(width * max(batches) + 8)
            c = model._step.lower(model.weights, p, inputs).compile(compiler_options=options)
            out, pools[name] = c(model.weights, p, inputs)
            logits[name], compiled[name] = np.asarray(out), c
            print(f"batch {b} {name}: {c.as_text().count('__ynn_fusion')} YNNPACK fusions in the step's HLO")
        ref = logits["default"]
        diff = np.abs(logits["no-ynn"] - ref).max() / np.abs(ref).max()
        print(f"batch {b}: logits differ by {diff:.1e} of their largest |value|; greedy ids equal: "
              f"{bool((logits['no-ynn'].argmax(-1) == ref.argmax(-1)).all())}")
        times = {name: [] for name in variants}
        for i in range(args.steps + 2):
            for name, c in compiled.items():
                t0 = time.perf_counter()
                out, pools[name] = c(model.weights, pools[name], inputs)
                jax.block_until_ready(out)
                if i >= 2:
                    times[name].append(time.perf_counter() - t0)
        for name in variants:
            steps[name, b] = statistics.median(times[name])
    print()
    print(f"{'variant':>8} | {'batch 1 ms':>10} | {'batch 4 ms':>10} | b4/b1")
    for name in variants:
        print(f"{name:>8} | {steps[name, 1] * 1e3:10.2f} | {steps[name, 4] * 1e3:10.2f} | "
              f"{steps[name, 4] / steps[name, 1]:.2f}x")
    print(f"no-ynn / default: batch 1 {steps['no-ynn', 1] / steps['default', 1]:.2f}x, "
          f"batch 4 {steps['no-ynn', 4] / steps['default', 4]:.2f}x the time")


if __name__ == "__main__":
    main()
