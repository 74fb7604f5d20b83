"""What a warm-up leaves to the first request: an artifact's engine warmed with every entry's empty rows (the old
warm-up) and with rows that read a few pages and write nothing (Engine.warm_up's), alternating in one process, each
followed by three identical generate calls (8 prompts of 24 tokens, 8 out); prints each call's time. The first
call's excess over the next two is the one-time cost the warm-up did not pay.

    python -m bench.warm_up ARTIFACT [--cache-dir DIR] [--rounds 4]      # e.g. bench/serving.py's --work/art
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--cache-dir", default="/tmp/tlaloc-warm-up-bench-cache")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args(argv)

    from tlaloc_jax.serve import Engine
    from tlaloc_jax.serve.core import inputs as call_inputs

    prompts = [[(7 * i + 3 * j) % 4000 + 5 for j in range(24)] for i in range(8)]
    forms = {"empty rows": call_inputs.empty_call_inputs, "reading rows": call_inputs.warm_up_inputs}
    excess = {form: [] for form in forms}
    try:
        for _ in range(a.rounds):
            for form, inputs in forms.items():
                call_inputs.warm_up_inputs = inputs      # what Engine.warm_up runs
                with Engine.load(a.artifact, cache_dir=a.cache_dir, progress=False) as eng:
                    for e in eng.cold_entries():
                        eng.warm_up(e)
                    times = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        eng.generate(prompts, 8)
                        times.append(time.perf_counter() - t0)
                excess[form].append(times[0] - statistics.median(times[1:]))
                print(f"{form:>12} warm-up: generate x3 " + " ".join(f"{t * 1e3:5.0f}" for t in times) + " ms",
                      flush=True)
    finally:
        call_inputs.warm_up_inputs = forms["reading rows"]
    for form, xs in excess.items():
        print(f"{form:>12} warm-up: the first call's excess, median of {len(xs)}: "
              f"{statistics.median(xs) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
