"""What a verify call costs against a decode call: an artifact's decode entry (B rows of one token) and its verify
entry (B rows of k + 1 tokens, export --speculative-tokens k) run through the serving runtime's Runner, rounds
interleaved in one process, at batch 1 and 4, for two exports of the model: verify bodies of the decode form (the
decode entries' C projections and attention, what export stages) and of the prefill form (XLA projections and the
prefill's attention, what it staged before SplitStep.verify). --parts: where a verify call's time goes, its body's
step in both forms with attention, without it (a copy of the queries), and without the head and acceptance, each
exported and compiled by the runtime's plugin (bench/common.on_runtime).

On the demo model (tlaloc_jax/demo_model), or a random Llama of a given shape (--random, bench/common.py's shape
flags), f32 or bf16 weights: at a weight-bound shape one call of either kind should cost about one read of the
weights, so the ratio's excess over 1 is what the verify body does beyond reading them.

    python -m bench.verify_step                                        # the demo model, k = 4
    python -m bench.verify_step --random --layers 4 --hidden 1024 --heads 16 --intermediate 3072 --vocab 32000 \
        --dtype bfloat16
    python -m bench.verify_step --parts --steps 60
    python -m bench.verify_step --checkpoint /tmp/tlaloc-spec-bench/authored-ck       # bench/speculative.py's
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

CONTEXT, START = 256, 150


def checkpoint(a) -> Path:
    """The checkpoint given, the demo model, or a random Llama of a's shape saved once."""
    from bench.common import llama_config, save_random_checkpoint
    from tlaloc_jax.checkpoint import DEMO_MODEL

    if a.checkpoint:
        return Path(a.checkpoint)
    if not a.random:
        return DEMO_MODEL
    ck = Path(a.work) / f"random-{a.layers}x{a.hidden}-{a.heads}h-{a.intermediate}-{a.vocab}"
    if not (ck / "config.json").exists():
        save_random_checkpoint(llama_config(a), ck)
    return ck


def artifact(a, form: str) -> Path:
    """The checkpoint's artifact with verify entries of a.k drafts, exported once. form "decode": as export does
    now (SplitStep.verify, the decode entries' kernels); "prefill": verify bodies that run the step's own halves as
    a prefill chunk does (XLA projections, the prefill's attention), the form before SplitStep.verify."""
    from tlaloc_jax.export import _artifact
    from tlaloc_jax.export import export_checkpoint

    ck = checkpoint(a)
    art = Path(a.work) / f"{ck.name}-{a.dtype}-k{a.k}-{form}-form"
    if not (art / "tlaloc-serving.json").exists():
        real = _artifact.SplitStep
        drop = form == "prefill"
        with mock.patch.object(_artifact, "SplitStep", lambda **kw: real(**{**kw, "verify": None} if drop else kw)):
            export_checkpoint(ck, art, batch_ladder=(1, 4), context_ladder=(CONTEXT,), speculative_tokens=a.k,
                              weight_dtype_name=a.dtype, progress=False)
    return art


def entry_calls(engine, batch: int, k: int):
    """(decode run, verify run) of `batch` rows at position START, each row its own pages."""
    from tlaloc_jax import artifact as af
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs

    m, runner = engine.manifest, engine.runner
    width = CONTEXT // m.block_size
    entries = {e.kind: e for e in m.entries if e.batch == batch and e.context == CONTEXT
               and e.kind in (af.EntryKind.DECODE, af.EntryKind.VERIFY)}
    rng = np.random.default_rng(batch)
    runs = []
    for kind, tokens in ((af.EntryKind.DECODE, 1), (af.EntryKind.VERIFY, k + 1)):
        e = entries[kind]
        rows = [RowCall(rng.integers(3, 200, tokens).tolist(), START - tokens + 1,
                        list(range(b * width, (b + 1) * width))) for b in range(batch)]
        inputs = build_step_inputs(rows, batch=e.batch, tokens=e.tokens_per_seq, width=width,
                                   block_size=m.block_size)
        want = {af.Role.NEXT_TOKEN} if kind == af.EntryKind.DECODE else {af.Role.VERIFY_ACCEPTED}
        runs.append(lambda e=e, inputs=inputs, want=want: runner.run(e, inputs, want))
    return runs


def verify_body(cfg, B: int, T: int, form: str, part: str):
    """A verify body's step as a function for common.on_runtime: (pools, weights, inputs) -> (pools, a result).
    form "prefill": XLA projections and the prefill's attention over [B, T] rows; "decode": the decode entries' C
    projections and decode attention, each token a row. part "all": hidden states, head and greedy acceptance;
    "no attention": attention replaced by a copy of the queries; "no head": the hidden states only."""
    import jax.numpy as jnp

    from tlaloc_jax.export._verify import accepted_drafts
    from tlaloc_jax import decoder
    from tlaloc_jax.inputs import StepInputs
    from tlaloc_jax.kernels import in_body_sampler, paged_attention_native
    from tlaloc_jax.kernels.projection_native import native_projections

    def copy(q, *args, **kw):
        return q * 1.0001

    def f(pools, weights, inputs):
        # Traced once, when on_runtime exports it: the swaps only last for that trace.
        real = decoder.paged_attention, paged_attention_native.native_decode_attention
        if part == "no attention":
            decoder.paged_attention = paged_attention_native.native_decode_attention = copy
        try:
            with native_projections(form == "decode"):
                hidden, pools = decoder.final_hidden(
                    cfg, weights, pools, StepInputs(**inputs), all_positions=True, query_rows=form == "decode",
                    decode_attention="native" if form == "decode" else "xla")
                if part == "no head":
                    return pools, hidden[..., 0]
                greedy = in_body_sampler.first_max(decoder.logits_from_hidden(cfg, weights, hidden.reshape(B * T, -1)))
        finally:
            decoder.paged_attention, paged_attention_native.native_decode_attention = real
        return pools, accepted_drafts(greedy.reshape(B, T), inputs["token_ids"], inputs["positions"])
    return f


def parts(a) -> None:
    """The verify body's step in both forms, whole and without attention or head, on the runtime's plugin."""
    import tlaloc_jax
    from bench.common import device, on_runtime
    from bench.step_parts import interleaved_medians
    from tlaloc_jax.kernels.paged_attention_native import NATIVE_DECODE_ATTENTION
    from tlaloc_jax.kernels.projection_native import NATIVE_PROJECTION
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs

    model = tlaloc_jax.load_hf(checkpoint(a), a.dtype, block_size=16, weight_layout="per-layer")
    cfg, width = model.config, CONTEXT // 16
    for target in (NATIVE_PROJECTION, NATIVE_DECODE_ATTENTION):
        device().register_native(target)
    kinds = [(form, part) for form in ("prefill", "decode") for part in ("all", "no attention", "no head")]
    print(f"where a verify call's time goes ({a.k + 1} tokens a row): its step on the runtime's plugin, medians of "
          f"{a.steps} interleaved rounds (differences of medians: noisy where a part is small)")
    for B in (1, 4):
        rng = np.random.default_rng(B)
        rows = [RowCall(rng.integers(3, 200, a.k + 1).tolist(), START - a.k, list(range(b * width, (b + 1) * width)))
                for b in range(B)]
        inputs = build_step_inputs(rows, batch=B, tokens=a.k + 1, width=width, block_size=16)
        runs = [on_runtime(verify_body(cfg, B, a.k + 1, form, part), model.new_pools(B * width), model.weights,
                           inputs, donate=(0,), custom_calls=(NATIVE_PROJECTION, NATIVE_DECODE_ATTENTION))
                for form, part in kinds]
        walls, cpus = interleaved_medians(runs, a.steps)
        for i, form in enumerate(("prefill", "decode")):
            for clock, times in (("wall", walls), ("CPU", cpus)):
                whole, bare, hidden = (t * 1e3 for t in times[3 * i:3 * i + 3])
                print(f"batch {B}, {form:7s} form, {clock:4s} ms: {whole:7.2f} | attention {whole - bare:6.2f} | head "
                      f"and acceptance {whole - hidden:6.2f} | the rest (projections, norms, MLP) "
                      f"{bare - (whole - hidden):6.2f}")


def main(argv=None) -> None:
    from bench.common import add_model_args
    from bench.step_parts import interleaved_medians

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--random", action="store_true", help="a random Llama of the shape flags, not the demo model")
    ap.add_argument("--checkpoint", default=None, help="a checkpoint of one's own (e.g. bench/authored_copier.py's)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the weights' dtype")
    ap.add_argument("--k", type=int, default=4, help="drafts a verify row checks")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--parts", action="store_true", help="also time the verify body's parts in both forms")
    ap.add_argument("--work", default="/tmp/tlaloc-verify-step")
    a = ap.parse_args(argv)

    from tlaloc_jax.serve import Engine

    arts = {form: artifact(a, form) for form in ("prefill", "decode")}
    with contextlib.ExitStack() as stack:
        engines = {f"{form} form, ": stack.enter_context(Engine.load(path, cache_dir=Path(a.work) / "cache",
                                                                    progress=False))
                   for form, path in arts.items()}
        print(f"{checkpoint(a).name} {a.dtype}: decode call vs verify call ({a.k} drafts, {a.k + 1} tokens a row) at "
              f"position {START}, context {CONTEXT}, verify bodies of both forms; medians of {a.steps} interleaved "
              "rounds, wall ms (CPU ms of every thread)")
        for batch in (1, 4):
            runs = [run for engine in engines.values() for run in entry_calls(engine, batch, a.k)]
            walls, cpus = interleaved_medians(runs, a.steps)
            for i, label in enumerate(engines):
                (dw, vw), (dc, vc) = walls[2 * i:2 * i + 2], cpus[2 * i:2 * i + 2]
                print(f"{label}batch {batch}: decode {dw * 1e3:7.2f} ({dc * 1e3:6.1f}) | verify {vw * 1e3:7.2f} "
                      f"({vc * 1e3:6.1f}) | verify / decode {vw / dw:.2f} wall, {vc / dc:.2f} CPU")
    if a.parts:
        parts(a)


if __name__ == "__main__":
    main()
