"""The served decode step with each decode attention form (export decode_attention "xla" and "native", the C
kernel of kernels/): one artifact of the same random Llama each (bench/decode.py's ~100M shape), loaded by
the JAX-free runtime side by side, their steps timed interleaved at batches 1, 4, 8 and 32 with every row's keys
written to the given fraction of the context. Prints each form's step and native / xla, measured in one run.

    python bench/decode_forms.py
    python bench/decode_forms.py --fill 0.8 --steps 30
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from decode import _median_times, add_model_args, llama_config, save_random_checkpoint  # noqa: E402

FORMS = ("xla", "native")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batches", default="1,4,8,32")
    ap.add_argument("--fill", type=float, default=0.5, help="keys each row has written, a fraction of the context")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per form and batch")
    args = ap.parse_args(argv)

    from tlaloc_jax.artifact import Role
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.paging import RowCall, build_step_inputs
    from tlaloc_jax.serve import Engine

    batches = [int(b) for b in args.batches.split(",")]
    block = 16
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n_params = save_random_checkpoint(llama_config(args), tmp / "ck")
        engines = {}
        for form in FORMS:
            export_checkpoint(tmp / "ck", tmp / form, batch_ladder=batches, context_ladder=(args.context,),
                              prefill_max_batch=min(batches), prefill_chunk=64, block_size=block, progress=False,
                              weight_layout="per-layer", decode_attention=form)
            engines[form] = Engine.load(tmp / form, cache_dir=None, progress=False)
        width = args.context // block
        pos = max(0, int(args.fill * args.context) - 1)
        print(f"llama {n_params / 1e6:.0f}M f32, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads; "
              f"context {args.context}, {pos + 1} keys a row; {os.cpu_count()} cores")
        print(f"{'batch':>5} | {'xla step':>9} | {'native step':>11} | native / xla")
        for b in batches:
            capacity = engines["xla"].runner.manifest.pool("kv").capacity     # rows share pages past it
            rows = [RowCall([7], pos, [(i * width + j) % capacity for j in range(width)]) for i in range(b)]
            inputs = build_step_inputs(rows, batch=b, tokens=1, width=width, block_size=block)
            steps = []
            for form in FORMS:
                runner = engines[form].runner
                entry = runner.manifest.entry(f"decode_b{b}_c{args.context}")
                steps.append(lambda runner=runner, entry=entry: runner.run(entry, inputs, {Role.NEXT_TOKEN}))
            outs = [s()[Role.NEXT_TOKEN] for s in steps]
            agree = "" if (outs[0] == outs[1]).all() else "  (greedy ids differ: near-ties of random weights?)"
            t_xla, t_native = _median_times(steps, args.steps)
            print(f"{b:5d} | {t_xla * 1e3:6.2f} ms | {t_native * 1e3:8.2f} ms | {t_native / t_xla:11.2f}x{agree}")
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    main()
