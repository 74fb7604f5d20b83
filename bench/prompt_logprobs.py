"""Prompt logprobs of a long prompt: scored in the body by the scoring prefill entries (read in chunks) against the
token-a-call fallback (an artifact without them: one call per prompt token, log_softmax on the host from pulled
logits), and a plain prefill that asks for none. Prints each one's calls and time for the prompt, and the ratios,
measured in one run with the three interleaved.

    python -m bench.prompt_logprobs [--tokens 256] [--top 5] [--reps 3]

The model is the embedded demo model (tlaloc_jax/demo_model: 4 layers, vocabulary 4096), exported with one
context of 256, prefill chunks of 128, the sampler and the scorer (--prompt-logprobs); the fallback is the same
artifact served with its scorer ignored.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tlaloc_jax.export import Sampler, export_checkpoint
from tlaloc_jax.serve import Engine, Sampling
from tlaloc_jax.tools.demo import DEMO_MODEL


def run(engine: Engine, prompt: list[int], sampling: Sampling) -> tuple[float, int, tuple | None]:
    """(seconds, prefill calls, prompt logprobs) of one request for a token after `prompt`."""
    calls = engine.stats()["prefill_calls"]
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, 1, sampling=sampling)
    plp = None
    while engine.has_unfinished():
        for ev in engine.step():
            plp = ev.prompt_logprobs or plp
    engine.release(rid)
    return time.perf_counter() - t0, engine.stats()["prefill_calls"] - calls, plp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        art = Path(tmp) / "artifact"
        export_checkpoint(DEMO_MODEL, art, batch_ladder=(1,), context_ladder=(256,), prefill_chunk=128, block_size=16,
                          progress=False, sampler=Sampler(), prompt_logprobs=args.top)
        with Engine.load(art, cache_dir=Path(tmp) / "cache", progress=False) as engine:
            prompt = [(37 * k + 11) % (engine.vocab - 1) + 1 for k in range(args.tokens)]
            scorer = engine.scheduler.planner.scorer
            asked = Sampling(prompt_logprobs=args.top)

            def scored():
                engine.scheduler.planner.scorer = scorer
                return run(engine, prompt, asked)

            def fallback():
                engine.scheduler.planner.scorer = None          # as an artifact without scoring entries is served
                return run(engine, prompt, asked)

            def plain():
                engine.scheduler.planner.scorer = scorer
                return run(engine, prompt, Sampling())

            variants = {"scored in the body": scored, "token a call (fallback)": fallback, "plain prefill": plain}
            for fn in variants.values():      # warm: the scoring entries compile on first use
                fn()
            times = {name: [] for name in variants}
            calls = {}
            for _ in range(args.reps):
                for name, fn in variants.items():
                    dt, n, _ = fn()
                    times[name].append(dt)
                    calls[name] = n
            a, b = scored()[2], fallback()[2]
            diff = max(abs(x[0] - y[0]) for x, y in zip(a[1:], b[1:]))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"prompt of {args.tokens} tokens, prompt_logprobs={args.top}, median of {args.reps} interleaved runs")
    for name in variants:
        print(f"  {name:26s} {calls[name]:4d} prefill calls  {med[name] * 1e3:9.1f} ms")
    print(f"  fallback / scored: {med['token a call (fallback)'] / med['scored in the body']:.1f}x the time, "
          f"{calls['token a call (fallback)'] / calls['scored in the body']:.0f}x the calls; "
          f"scored / plain: {med['scored in the body'] / med['plain prefill']:.2f}x the time")
    print(f"  largest |scored - fallback| prompt logprob: {diff:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
