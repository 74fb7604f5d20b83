"""Decode and prefill speed of one artifact: the JAX-free runtime against in-process JAX and against a
control that copies the KV pool to the host and back every step (the seed's framework-free path).

Everything is measured in one run, so the ratios hold on a noisy machine even when the absolute numbers
drift. Builds a Llama-shaped model (about 100M parameters by default, f32, random weights), exports it,
and prints:

  - decode tokens/s at batch 1, 4, 8, 32 for the runtime, in-process JAX and the host-copy control, and each
    runtime step as a multiple of its read floor (the weight bytes and the rows' KV bytes at the better of a
    1-thread and an all-thread read rate of the runtime's own weight memory) and of the batch-1 step: steps back
    to back, as a decode loop runs them, in rounds with read passes, each round's step against the read rate of
    its own round (the median);
  - prefill tokens/s of one call for the runtime and in-process JAX, and the runtime's FLOP rate as a fraction
    of the best this CPU's XLA reaches on a large matmul of the weights' dtype through the same plugin (and the
    other dtype's, for reference) and of the CPU's f32 FMA peak (bench/common.py's fma_peak);
  - the weight bytes a decode step reads, the memory bandwidth measured here, and the runtime's decode
    step time as a multiple of that floor;
  - what returning the argmax next to the logits saves per step (greedy pulls 4 bytes a row, not V * 4);
  - with --decode-steps K (default 8; 0 skips it): the runtime's tokens/s with K-step decode entries against
    single steps (the same engine, interleaved) at batch 1, 2, 4, on the tiny model (the tests' 3-layer shape)
    and on the model above, and the runtime against in-process JAX running the same bodies (the artifact's
    .exported files) for the single-step and the K-step entries.

    python -m bench.decode                       # ~100M parameters
    python -m bench.decode --hidden 256 --layers 2 --heads 4 --kv-heads 2 --intermediate 512 --vocab 4096 --steps 8  # quick
    python -m bench.decode --only-decode-steps     # the decode_steps comparison alone (tiny and ~100M)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from bench.common import (Reader, add_model_args, fma_peak, llama_config, matmul_peak, median_times,
                          prefill_flops, save_random_checkpoint, steady_rounds, step_fields, weight_memory)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--prefill", type=int, default=128, help="tokens of the prefill call")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per measurement")
    ap.add_argument("--floor-rounds", type=int, default=7,
                    help="rounds of back-to-back steps and read passes for the x floor and x batch-1 columns")
    ap.add_argument("--plugin", default=None)
    ap.add_argument("--weight-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the artifact's weights (and in-process JAX's)")
    ap.add_argument("--weight-quant", default=None,
                    help="int8,fp8,int4: compare the decode step of each weight scheme with bf16 and f32 instead "
                         "(bench/decode_quant.py, which reads the arguments itself)")
    ap.add_argument("--decode-steps", type=int, default=8, metavar="K",
                    help="K of the decode_steps comparison (0: skip it)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence (decode_steps runs)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the decode_steps comparison")
    ap.add_argument("--only-decode-steps", action="store_true", help="run the decode_steps comparison alone")
    args = ap.parse_args(argv)
    if args.weight_quant:
        import sys

        from bench import decode_quant
        return decode_quant.main(sys.argv[1:] if argv is None else argv)
    if args.only_decode_steps:
        return decode_steps_bench(args)

    import jax

    import tlaloc_jax
    from tlaloc_jax.artifact import Role
    from tlaloc_jax.decoder import StepInputs
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.families import config_from_hf
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs
    from tlaloc_jax.serve import Engine

    hf = llama_config(args)
    cfg = config_from_hf(hf)[1]
    batches = (1, 4, 8, 32)
    block = 16
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n_params = save_random_checkpoint(hf, tmp / "ck")
        t0 = time.perf_counter()
        m = export_checkpoint(tmp / "ck", tmp / "art", batch_ladder=batches, context_ladder=(args.context,),
                              prefill_max_batch=1, prefill_chunk=args.prefill, block_size=block, progress=False,
                              weight_layout="per-layer", weight_dtype_name=args.weight_dtype)
        export_s = time.perf_counter() - t0
        engine = Engine.load(tmp / "art", args.plugin, cache_dir=None, progress=False)
        # In-process JAX runs the layout the exporter wrote (tlaloc_jax.layout), so the ratio is the runtime's own.
        model = tlaloc_jax.load_hf(tmp / "ck", dtype=args.weight_dtype, block_size=block, weight_layout="per-layer")
        print(f"model: llama, {n_params / 1e6:.1f}M parameters ({args.weight_dtype}), {args.layers} layers, hidden {args.hidden}, "
              f"vocab {args.vocab}; context {args.context}; export {export_s:.1f} s, load {engine.load_seconds:.1f} s")
        print(f"plugin: {engine.device.plugin_package or engine.device.plugin_path} ({engine.device.platform_name}); "
              f"jax {jax.__version__} on {jax.devices()[0].platform}")

        width = args.context // block
        capacity = m.pool("kv").capacity         # rows past it share pages (a block table names pages in the pool)
        pages = [[(b * width + j) % capacity for j in range(width)] for b in range(max(batches))]
        pos = args.context // 2

        def step_inputs(b, tokens=1, start=pos):
            rows = [RowCall([7] * tokens, start, pages[i]) for i in range(b)]
            return build_step_inputs(rows, batch=b, tokens=tokens, width=width, block_size=block)

        embed = next(w for w in m.weights if w.slot == "embed")
        step_bytes = sum(w.nbytes for w in m.weights) - embed.nbytes + embed.nbytes // args.vocab
        kv_row = (pos + 1) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4   # keys and values a row reads
        cores = os.cpu_count() or 1
        memory = weight_memory(engine, {"embed"})        # the floor reads the step's own weights
        read1, read_all = (Reader(memory, n) for n in (1, cores))
        # and, for comparison, a buffer of the same size allocated now (the floor's memory before)
        fresh = Reader([np.ones(sum(a.nbytes for a in memory), np.uint8)], cores)
        rows = []
        jax_pools = model.new_pools(m.pool("kv").capacity)
        for b in batches:
            entry = m.entry(f"decode_b{b}_c{args.context}")
            inputs = step_inputs(b)

            def runtime_step():
                return engine.runner.run(entry, inputs, {Role.NEXT_TOKEN})[Role.NEXT_TOKEN]

            def jax_step():
                nonlocal jax_pools
                nxt, _, jax_pools = model._greedy(model.weights, jax_pools, StepInputs(**inputs))
                return np.asarray(nxt)

            exe = engine.executables[entry.name]
            host_pool = np.zeros(m.pool("kv").shape, np.float32)

            def host_copy_step():
                nonlocal host_pool
                bufs = [engine.device.upload(inputs[k]) for k in step_fields(entry)]
                pool = engine.device.upload(host_pool)
                outs = engine.device.execute(exe, bufs + [pool] + [engine.runner.weights[w.slot] for w in m.weights],
                                             donate=())
                host_pool = engine.device.to_host(outs[2])
                nxt = engine.device.to_host(outs[1])
                for buf in bufs + [pool] + outs:
                    buf.close()
                return nxt

            def runtime_step_logits():
                return engine.runner.run(entry, inputs, {Role.NEXT_TOKEN, Role.LOGITS})

            t_rt, t_jax, t_host, t_logits = median_times(
                [runtime_step, jax_step, host_copy_step, runtime_step_logits], args.steps)
            # The floor: this batch's bytes at the better of 1 and all threads' read rate, in rounds with its steps.
            steady = steady_rounds(runtime_step, (read1, read_all), args.steps, args.floor_rounds,
                                    fresh if b == 1 else None)
            floor_bytes = step_bytes + b * kv_row
            rows.append((b, t_rt, t_jax, t_host, steady, [t * rate / floor_bytes for t, rate, _ in steady]))
            if b == 1:
                t_rt_logits, t_rt_next = t_logits, t_rt

        print()
        print(f"{'decode':>8} | {'runtime tok/s':>13} | {'in-process JAX':>14} | {'host-copy ctrl':>14} | "
              f"{'runtime/JAX':>11} | {'runtime/ctrl':>12} | {'x floor':>7} | {'x batch-1':>9}")
        steady1 = statistics.median(t for t, _, _ in rows[0][4])
        for b, t_rt, t_jax, t_host, steady, ratios in rows:
            print(f"batch {b:>2} | {b / t_rt:13.1f} | {b / t_jax:14.1f} | {b / t_host:14.1f} | "
                  f"{t_jax / t_rt:10.2f}x | {t_host / t_rt:11.2f}x | {statistics.median(ratios):6.2f}x | "
                  f"{statistics.median(t for t, _, _ in steady) / steady1:8.2f}x")
        print(f"(tok/s and the ratios before the last two columns: single calls, the forms interleaved; x floor and x "
              f"batch-1: steps back to back, the last {args.steps} of {2 * args.steps} timed, medians of "
              f"{args.floor_rounds} rounds, each against the read rate measured in its round)")

        pentry = m.entry(f"prefill_b1_c{args.context}")
        pin = step_inputs(1, tokens=args.prefill, start=0)

        def jax_prefill():
            nonlocal jax_pools
            nxt, _, jax_pools = model._greedy(model.weights, jax_pools, StepInputs(**pin))
            return np.asarray(nxt)
        t_rt_p, t_jax_p = median_times([lambda: engine.runner.run(pentry, pin, {Role.NEXT_TOKEN}), jax_prefill],
                                        max(3, args.steps // 4))
        print(f"prefill {args.prefill} tokens | runtime {args.prefill / t_rt_p:.0f} tok/s | in-process JAX "
              f"{args.prefill / t_jax_p:.0f} tok/s | runtime/JAX {t_jax_p / t_rt_p:.2f}x")
        peak = {dt: matmul_peak(engine.device, dt) for dt in ("float32", "bfloat16")}
        fma = fma_peak()
        rate = prefill_flops(cfg, args.prefill) / t_rt_p
        # Against the matmul rate of the weights' dtype: bf16 projections run bf16 dots (AVX512-BF16 or AMX).
        dt, other = (("bfloat16", "float32") if args.weight_dtype == "bfloat16" else ("float32", "bfloat16"))
        name = {"float32": "f32", "bfloat16": "bf16"}
        print(f"prefill FLOP rate {rate / 1e9:.1f} GFLOP/s = {rate / peak[dt]:.2f}x the {name[dt]} matmul peak "
              f"measured through the plugin ({peak[dt] / 1e9:.1f} GFLOP/s; {name[other]} operands "
              f"{peak[other] / 1e9:.1f} GFLOP/s, {peak[other] / peak[dt]:.2f}x) = {rate / fma:.2f}x the f32 FMA peak "
              f"of {cores} cores ({fma / 1e9:.1f} GFLOP/s; bench/prefill_parts.py breaks the prefill down)")

        _, t1, _, _, steady, ratios = rows[0]
        bw = statistics.median(rate for _, rate, _ in steady)
        floor = (step_bytes + kv_row) / bw
        every = [rate for row in rows for _, rate, _ in row[4]]
        print()
        print(f"weight bytes a decode step reads: {step_bytes / 2**20:.1f} MiB (every weight, one embedding row), "
              f"and {kv_row / 2**20:.1f} MiB of keys and values a row")
        print(f"read bandwidth in the batch-1 rounds (a numpy sum over the runtime's weights, the better of 1 and "
              f"{cores} threads): median "
              f"{bw / 1e9:.2f} GB/s -> floor {floor * 1e3:.2f} ms (every round of the run: {min(every) / 1e9:.2f}-"
              f"{max(every) / 1e9:.2f} GB/s)")
        print(f"runtime decode step at batch 1, back to back: {steady1 * 1e3:.2f} ms = {statistics.median(ratios):.2f}x "
              f"the floor (rounds: {', '.join(f'{r:.2f}' for r in ratios)}); a single step timed between the other "
              f"calls: {t1 * 1e3:.2f} ms")
        fastest = max(read1.rate(read1.best), read_all.rate(read_all.best))
        print(f"(the fastest read pass of the run, {fastest / 1e9:.2f} GB/s, would put the batch-1 step at "
              f"{steady1 * fastest / (step_bytes + kv_row):.2f}x)")
        fresh_ratios = [t * rate / (step_bytes + kv_row) for t, _, rate in steady]
        print(f"(against a buffer of the same size allocated at the start, read in the same rounds with {cores} "
              f"threads at {statistics.median(r for _, _, r in steady) / 1e9:.2f} GB/s: the batch-1 step = "
              f"{statistics.median(fresh_ratios):.2f}x that floor; rounds "
              f"{', '.join(f'{r:.2f}' for r in fresh_ratios)})")
        # What the argmax output saves is the logits copy itself: time it alone, on the last step's outputs.
        exe = engine.executables[f"decode_b1_c{args.context}"]
        inputs = step_inputs(1)
        bufs = [engine.device.upload(inputs[k]) for k in step_fields(m.entry(f"decode_b1_c{args.context}"))]
        pool = engine.device.upload(np.zeros(m.pool("kv").shape, np.float32))
        outs = engine.device.execute(exe, bufs + [pool] + [engine.runner.weights[w.slot] for w in m.weights], donate=())
        t_logits_copy, t_next_copy = median_times([lambda: engine.device.to_host(outs[0]),
                                                    lambda: engine.device.to_host(outs[1])], 50)
        print(f"greedy argmax output (NEXT_TOKEN): copying the logits ({args.vocab * 4 / 1024:.0f} KiB) to the host "
              f"takes {t_logits_copy * 1e6:.0f} us, the argmax {t_next_copy * 1e6:.0f} us: it saves "
              f"{(t_logits_copy - t_next_copy) * 1e6:.0f} us a step ({(t_logits_copy - t_next_copy) / t1:.2%} of "
              f"this step); whole steps with and without the pull: {t_rt_logits * 1e3:.2f} / {t_rt_next * 1e3:.2f} ms")
        for b in bufs + [pool] + outs:
            b.close()
        engine.close()
    if args.decode_steps > 1:
        decode_steps_bench(args)



# -- decode_steps: K tokens per call against single steps, and the runtime against in-process JAX ---------------

TINY = dict(hidden=64, layers=3, heads=4, kv_heads=2, intermediate=96, vocab=256)   # tests/support/hf_models.py TINY


def _export_shape(root: Path, shape: dict, args, *, context: int, block: int):
    """A random Llama of `shape` exported with the sampler (as the CLI stages it) and decode_steps entries."""
    from tlaloc_jax.export import Sampler, export_checkpoint
    n_params = save_random_checkpoint(llama_config(argparse.Namespace(**shape, context=context)), root / "ck")
    export_checkpoint(root / "ck", root / "art", batch_ladder=(1, 2, 4), context_ladder=(context,),
                      prefill_max_batch=1, prefill_chunk=64, block_size=block, progress=False, sampler=Sampler(),
                      decode_steps=args.decode_steps, exported=True)
    return n_params


def _generate_rate(engine, batch: int, new_tokens: int, multi: bool, prompt_len: int = 32) -> float:
    """Decode tokens/s of `batch` greedy sequences through Engine.step, after their prompts are read."""
    engine.use_decode_steps = multi
    rng = np.random.default_rng(batch)
    rids = [engine.add_request(rng.integers(1, engine.vocab, prompt_len).tolist(), new_tokens) for _ in range(batch)]
    try:
        while any(not engine.request_info(r).generated for r in rids):
            engine.step()
        done = sum(len(engine.request_info(r).generated) for r in rids)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        dt = time.perf_counter() - t0
        return (sum(len(engine.request_info(r).generated) for r in rids) - done) / dt
    finally:
        for r in rids:
            engine.release(r)


def _entry_pair(engine, art: Path, entry, start: int):
    """(runtime call, in-process JAX call) of one entry at batch entry.batch, every row decoding from `start`:
    the same body (the artifact's .exported, jitted with its pools donated), the same inputs, the same output
    pulled (the chosen tokens)."""
    import jax
    import jax.numpy as jnp
    from jax import export as jax_export
    from tlaloc_jax import artifact as af
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs
    m, B = engine.manifest, entry.batch
    width = entry.context // m.block_size
    rows = [RowCall([7], start, list(range(b * width, (b + 1) * width))) for b in range(B)]
    inputs = build_step_inputs(rows, batch=B, tokens=1, width=width, block_size=m.block_size)
    kept = {}
    if engine.sampler is not None:
        # Greedy rows: the engine passes the sampler's neutral inputs, kept on the device; so does JAX here.
        for role in af.SAMPLER_INPUTS:
            inputs[role] = engine.runner.neutral_buffer(entry, role)
            kept[role] = jnp.asarray(engine.device.to_host(inputs[role]))
    multi = entry.kind == af.EntryKind.DECODE_STEPS
    if multi:
        inputs[af.Role.STEP_LIMIT] = np.full(B, entry.steps, np.int32)
        inputs[af.Role.STOP_IDS] = np.full(entry.inputs[entry.input_index(af.Role.STOP_IDS)].shape, -1, np.int32)
    want = af.Role.STEP_TOKENS if multi else (af.Role.SAMPLED_TOKEN if engine.sampler else af.Role.NEXT_TOKEN)

    def runtime_call():
        return engine.runner.run(entry, inputs, {want})[want]

    exp = jax_export.deserialize(bytearray((art / entry.exported).read_bytes()))
    fn = jax.jit(exp.call, donate_argnums=tuple(i for _, i in entry.donations))
    weights = {w.slot: jnp.asarray(np.fromfile(art / w.file, af.numpy_dtype(w.dtype)).reshape(w.shape))
               for w in m.weights}
    pools = {p.name: jnp.zeros(p.shape, af.numpy_dtype(p.dtype)) for p in m.pools}
    out_i = entry.output_index(want)

    def jax_call():
        args = []
        for sig in entry.inputs:
            if sig.role == af.Role.POOL_IN:
                args.append(pools[sig.slot])
            elif sig.role == af.Role.WEIGHT:
                args.append(weights[sig.slot])
            elif sig.role in kept:
                args.append(kept[sig.role])
            else:
                args.append(inputs[af.STEP_FIELDS.get(sig.role, sig.role)])
        outs = fn(*args)
        for o, i in entry.donations:
            pools[entry.inputs[i].slot] = outs[o]
        return np.asarray(outs[out_i])

    return runtime_call, jax_call


def decode_steps_bench(args) -> None:
    """K-step decode entries against single steps through the runtime, and the runtime against in-process JAX on
    the same bodies, on the tiny model and on the model of the command line; ratios measured in one run."""
    from tlaloc_jax.serve import Engine
    K, block, context = args.decode_steps, 16, args.context
    main_shape = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                      intermediate=args.intermediate, vocab=args.vocab)
    print(f"\ndecode_steps: K = {K}; {args.new_tokens} greedy tokens per sequence after a 32-token prompt; "
          f"context {context}; medians of {args.rounds} interleaved rounds")
    for label, shape in (("tiny", TINY), ("model", main_shape)):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            t0 = time.perf_counter()
            n_params = _export_shape(tmp, shape, args, context=context, block=block)
            export_s = time.perf_counter() - t0
            engine = Engine.load(tmp / "art", args.plugin, cache_dir=None, progress=False)
            print(f"\n{label}: {n_params / 1e6:.2f}M parameters (f32), hidden {shape['hidden']}, {shape['layers']} "
                  f"layers, {shape['heads']}/{shape['kv_heads']} heads, vocab {shape['vocab']}; export "
                  f"{export_s:.1f} s, load {engine.load_seconds:.1f} s")
            print(f"{'batch':>5} | {'single tok/s':>12} | {f'K={K} tok/s':>11} | {'K/single':>8} || "
                  f"{'runtime/JAX 1-step':>18} | {f'runtime/JAX K={K}':>16}")
            for b in (1, 2, 4):
                rates = {True: [], False: []}
                for _ in range(args.rounds):
                    for multi in (False, True):
                        rates[multi].append(_generate_rate(engine, b, args.new_tokens, multi))
                single, multi = statistics.median(rates[False]), statistics.median(rates[True])
                ratios = []
                for kind in ("decode", "decode_steps"):
                    entry = engine.manifest.entry(f"{kind}_b{b}_c{context}")
                    rt, jx = _entry_pair(engine, tmp / "art", entry, context // 2 - K)
                    t_rt, t_jax = median_times([rt, jx], max(5, args.steps))
                    ratios.append(t_jax / t_rt)
                print(f"{b:>5} | {single:12.1f} | {multi:11.1f} | {multi / single:7.2f}x || {ratios[0]:17.2f}x | "
                      f"{ratios[1]:15.2f}x")
            st = engine.stats()
            print(f"  (decode_steps calls {st['decode_steps_calls']} of {st['decode_calls']} decode calls; pools in "
                  f"place {st['pool_in_place']}/{st['pool_address_checks']} checks)")
            engine.close()


if __name__ == "__main__":
    main()
