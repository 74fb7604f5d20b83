"""Decode with quantized weights: the bytes a decode step reads and its time for each weight scheme against
bf16 and f32 (and a --prefill-token prefill's), all served by the JAX-free runtime in one run (calls interleaved),
and what XLA's CPU backend does with a quantized projection (read from the optimized HLO of the decode step).

    python -m bench.decode --weight-quant int8,fp8,int4          # or: python -m bench.decode_quant ...

One random Llama-shaped checkpoint (f32), exported as f32, bf16 and each scheme (quantized from the f32 values;
the rest of the weights in bf16, the compute dtype the codes are widened to, but the head where the exporter's
default quantizes it: int8 beside 4-bit weights, export/_quant.py); KV pools f32 in all of them.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from bench.common import add_model_args, llama_config, median_times, median_wall_cpu, save_random_checkpoint


def step_bytes(manifest, vocab: int) -> int:
    """The weight bytes a batch-1 decode step reads: every weight file, but one row of the embedding."""
    embed = next(w for w in manifest.weights if w.slot == "embed")
    return sum(w.nbytes for w in manifest.weights) - embed.nbytes + embed.nbytes // vocab


_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* (\w+)\(.*?(?:calls=%(\S+?)[,\s]|$)", re.M)


def widening_report(cfg, weights, block: int, context: int) -> str:
    """Compile the in-process decode step (batch 1) over `weights` (in the layout the artifact holds) and say which
    weight-shaped float buffers its optimized HLO produces: a convert fusion per projection means its codes (or bf16
    values) are widened in a pass of their own before the dot (a library call on CPU), not read by it."""

    import tlaloc_jax
    from tlaloc_jax.decoder import StepInputs
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs

    model = tlaloc_jax.Model(cfg, weights, block_size=block)
    pools = model.new_pools(context // block)
    inputs = StepInputs(**build_step_inputs([RowCall([7], 3, list(range(context // block)))], batch=1, tokens=1,
                                            width=context // block, block_size=block))
    hlo = model._step.lower(model.weights, pools, inputs).compile().as_text()
    from tlaloc_jax.export._quant import QUANTIZED_SLOTS
    shapes = {int(np.prod((w[0] if isinstance(w, tuple) else w).shape[-2:])): name  # one layer's, per-layer
              for name, w in weights.items() if name in QUANTIZED_SLOTS}
    body = {}
    for m in re.finditer(r"^%(\S+) .*?\{\n(.*?)\n\}", hlo, re.M | re.S):
        body[m.group(1)] = m.group(2)
    found = []
    # Only the computations that run (the entry, loop bodies and conditions), not the fused ones' insides.
    outer = "\n".join(b for name, b in body.items() if not name.startswith(("fused_", "wrapped_", "region_")))
    outer += "\n" + hlo[hlo.index("ENTRY"):]
    for name, dtype, dims, op, calls in _INSTR.findall(outer):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        if n in shapes and dtype in ("f32", "bf16") and op in ("fusion", "convert"):
            ops = sorted(set(re.findall(r"= \S+ (\w[\w-]*)\(", body.get(calls, ""))) - {"parameter", "bitcast",
                                                                                       "constant"})
            if "convert" in ops and not {"scatter", "gather"} & set(ops):     # a widened weight, not a pool
                found.append(f"{shapes[n]}: {dtype}[{dims}] = {op}({', '.join(ops) or op})")
    if not found:
        return "no weight-shaped float buffer: the projections read the codes and widen them in registers"
    return (f"{len(found)} weight-shaped float buffers in the step's loop body (instruction: its fused ops): "
            + "; ".join(sorted(set(found))))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weight-quant", default="int8,fp8,int4", help="schemes, comma-separated (int8, fp8, int4)")
    ap.add_argument("--quant-group", type=int, default=128)
    add_model_args(ap, hidden=512, layers=8, heads=8, intermediate=1536, vocab=8000)
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per variant")
    ap.add_argument("--plugin", default=None)
    ap.add_argument("--prefill", type=int, default=128, help="tokens of the timed prefill call (0: none)")
    ap.add_argument("--projections", default="native,xla",
                    help="the bf16 and quantized variants' projection forms (export --projections), each timed")
    args = ap.parse_args(argv)
    schemes = [s for s in args.weight_quant.split(",") if s and s != "none"]

    import jax

    from tlaloc_jax.checkpoint import load_checkpoint
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.export._quant import head_quant_for, quantize_weights, scheme_label
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs
    from tlaloc_jax.artifact import Role
    from tlaloc_jax.serve import Engine

    hf = llama_config(args)
    block = 16

    def rest(scheme):
        head = head_quant_for(scheme, None)
        return "bf16 rest" if head == "none" else f"{head} head, bf16 rest"
    forms = args.projections.split(",")
    variants = [("f32", "float32", "none", "xla")]
    for form in forms:
        variants += [(f"bf16, {form}", "bfloat16", "none", form)]
        variants += [(f"{scheme_label(s, args.quant_group)} ({rest(s)}), {form}", "bfloat16", s, form) for s in schemes]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n_params = save_random_checkpoint(hf, tmp / "ck")
        engines, manifests = [], []
        for i, (label, dtype, quant, form) in enumerate(variants):
            m = export_checkpoint(tmp / "ck", tmp / f"art{i}", batch_ladder=(1,), context_ladder=(args.context,),
                                  prefill_max_batch=1, prefill_chunk=args.prefill or 16, block_size=block, progress=False,
                                  weight_dtype_name=dtype, weight_quant=quant, quant_group=args.quant_group,
                                  projections=form)
            manifests.append(m)
            engines.append(Engine.load(tmp / f"art{i}", args.plugin, cache_dir=None, progress=False))
        print(f"model: llama, {n_params / 1e6:.1f}M parameters, {args.layers} layers, hidden {args.hidden}, "
              f"MLP {args.intermediate}, vocab {args.vocab}; decode batch 1 at position {args.context // 2}; "
              f"jax {jax.__version__}, {os.cpu_count()} CPUs")
        width = args.context // block
        inputs = build_step_inputs([RowCall([7], args.context // 2, list(range(width)))], batch=1, tokens=1,
                                   width=width, block_size=block)
        entry = f"decode_b1_c{args.context}"
        fns = [(lambda e=e, m=m: e.runner.run(m.entry(entry), inputs, {Role.NEXT_TOKEN})) for e, m in zip(engines, manifests)]
        wall_cpu = median_wall_cpu(fns, args.steps)
        times, cpu = [w for w, _ in wall_cpu], [c for _, c in wall_cpu]
        base_b, base_t = step_bytes(manifests[1], args.vocab), times[1]
        print()
        print(f"{'weights, projections':>40} | {'MiB a step':>10} | {'vs bf16':>7} | {'step ms':>8} | {'vs bf16':>7} | "
              f"{'vs f32':>6} | {'CPU ms':>7} | {'CPU vs f32':>10}")
        for (label, *_), m, t, c in zip(variants, manifests, times, cpu):
            b = step_bytes(m, args.vocab)
            print(f"{label:>40} | {b / 2**20:10.2f} | {b / base_b:6.2f}x | {t * 1e3:8.2f} | {t / base_t:6.2f}x | "
                  f"{t / times[0]:5.2f}x | {c * 1e3:7.2f} | {c / cpu[0]:9.2f}x")
        if args.prefill:
            pin = build_step_inputs([RowCall([7] * args.prefill, 0, list(range(width)))], batch=1,
                                    tokens=args.prefill, width=width, block_size=block)
            pentry = f"prefill_b1_c{args.context}"
            pt = median_times([(lambda e=e, m=m: e.runner.run(m.entry(pentry), pin, {Role.NEXT_TOKEN}))
                                for e, m in zip(engines, manifests)], max(3, args.steps // 3))
            print()
            print(f"prefill of {args.prefill} tokens: " + "; ".join(
                f"{label} {args.prefill / t:.0f} tok/s ({pt[0] / t:.2f}x f32)" for (label, *_), t in zip(variants, pt)))
        for e in engines:
            e.close()
        if schemes:
            import ml_dtypes

            from tlaloc_jax.layout import fuse_projections, out_major, unstack_layers
            cfg32, w32 = load_checkpoint(tmp / "ck", "float32")
            fused = fuse_projections(w32)           # as the exporter lays them out (per-layer)
            q = out_major(unstack_layers(quantize_weights(fused, schemes[0], args.quant_group, compute="bfloat16")))
            print()
            print(f"XLA CPU (in-process jaxlib), optimized HLO of the {schemes[0]} decode step: "
                  + widening_report(cfg32, q, block, args.context))
            bf = out_major(unstack_layers({k: v.astype(ml_dtypes.bfloat16) for k, v in fused.items()}))
            print("XLA CPU (in-process jaxlib), the bf16 decode step: " + widening_report(cfg32, bf, block, args.context))


if __name__ == "__main__":
    main()
