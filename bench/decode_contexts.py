"""Whether a decode call's cost depends on its entry's context bucket: the runtime's decode call at the smallest
and at the largest context of one artifact, on the same short rows, interleaved, for each decode attention; and,
the control that must differ, the largest context's call on rows that fill it (the bench sees the keys' work).

With the native decode attention (kernels/decode_attention.c loops over each row's own keys) the short rows'
calls should be within noise: the export then stages decode entries at the top context alone (--decode-contexts).
Plain ops (xla) are timed beside it: their blockwise loop also stops at the last key a row sees.

    python -m bench.decode_contexts                 # ~100M-parameter Llama (bench/common.py MODEL_DEFAULTS)
    python -m bench.decode_contexts --layers 4 --hidden 256 --heads 4 --kv-heads 2 --intermediate 512 --vocab 4096
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench.common import add_model_args, llama_config, median_wall_cpu, save_random_checkpoint


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--contexts", default="64,1024", help="the two context buckets (default 64,1024)")
    ap.add_argument("--batches", default="1,8,32", help="decode batches timed (default 1,8,32)")
    ap.add_argument("--length", type=int, default=40, help="each row's keys: its position + 1 (default 40)")
    ap.add_argument("--steps", type=int, default=30, help="timed calls per entry")
    ap.add_argument("--attention", default="native,xla", help="decode attentions to export (default native,xla)")
    args = ap.parse_args(argv)
    from tlaloc_jax.artifact import Role
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.serve import Engine
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs

    contexts = tuple(int(c) for c in args.contexts.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    block = 16
    if args.length > contexts[0]:
        raise SystemExit(f"--length {args.length} does not fit the smallest context {contexts[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n = save_random_checkpoint(llama_config(args), tmp / "ck")
        print(f"llama, {n / 1e6:.1f}M parameters (f32), {args.layers} layers; rows of {args.length} keys; "
              f"contexts {contexts[0]} and {contexts[-1]}; median of {args.steps} interleaved calls; cpu = this "
              "process's CPU time (every thread)")
        print("| attention | batch | wall c{0} | wall c{1} | wall ratio | cpu c{0} | cpu c{1} | cpu ratio | control: cpu "
              "c{1} full rows / c{0} |".format(contexts[0], contexts[-1]))
        print("|---|---|---|---|---|---|---|---|---|")
        for attention in args.attention.split(","):
            art = tmp / f"art-{attention}"
            m = export_checkpoint(tmp / "ck", art, batch_ladder=batches, context_ladder=contexts,
                                  prefill_max_batch=1, prefill_chunk=32, prefill_long_chunk=0, block_size=block,
                                  progress=False, mixed=False, decode_attention=attention, decode_contexts="every")
            engine = Engine.load(art, None, cache_dir=None, progress=False)
            capacity = m.pool("kv").capacity
            for b in batches:
                calls = []
                for c, length in ((contexts[0], args.length), (contexts[-1], args.length), (contexts[-1], contexts[-1])):
                    width = c // block
                    # Each row its own pages (wrapping where the pool is smaller); it reads its first length keys.
                    rows = [RowCall([7], length - 1, [(i * width + j) % capacity for j in range(width)])
                            for i in range(b)]
                    inputs = build_step_inputs(rows, batch=b, tokens=1, width=width, block_size=block)
                    entry = m.entry(f"decode_b{b}_c{c}")
                    calls.append(lambda entry=entry, inputs=inputs: engine.runner.run(entry, inputs, {Role.NEXT_TOKEN}))
                (w0, c0), (w1, c1), (_, c2) = median_wall_cpu(calls, args.steps, warmup=3)
                print(f"| {attention} | {b} | {w0 * 1e3:.2f} ms | {w1 * 1e3:.2f} ms | {w1 / w0:.2f} | "
                      f"{c0 * 1e3:.2f} ms | {c1 * 1e3:.2f} ms | {c1 / c0:.2f} | {c2 / c0:.2f} |", flush=True)
            engine.close()


if __name__ == "__main__":
    main()
