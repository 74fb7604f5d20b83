"""What does a packed prefill save over rows padded to the chunk? Measured in one run.

    python -m bench.packed_prefill                 # the 82M Llama of bench/serving.py, 8 prompts of 24 tokens
    python -m bench.packed_prefill --rows 4 --prompt 10

In-process JAX on the per-layer layout the artifact holds: the decoder's prefill call of R rows of a 32-token chunk
(each prompt right-aligned in its row, the rest padding) against the packed call of the same rows (their tokens side
by side in the ladder's smallest N that holds them, tlaloc_jax.serve.core.paging.pack_step_inputs). Prints both times (medians,
interleaved), the ratio, and checks that the packed call's logits are the padded call's within the decoder's bound.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402


def main(argv=None) -> None:
    import jax

    import tlaloc_jax
    from bench.common import median_times, add_model_args, llama_config, save_random_checkpoint
    from tlaloc_jax.export._entries import packed_token_ladder
    from tlaloc_jax.decoder import forward
    from tlaloc_jax.inputs import StepInputs
    from tlaloc_jax.kernels import tolerances as tol
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs, pack_step_inputs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.set_defaults(vocab=4096)
    ap.add_argument("--rows", type=int, default=8, help="prompts read together (the entry's rows: 8)")
    ap.add_argument("--prompt", type=int, default=24, help="tokens of each prompt")
    ap.add_argument("--chunk", type=int, default=32, help="tokens of a row (the export's prefill chunk)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--work", default="/tmp/tlaloc-packed-prefill")
    a = ap.parse_args(argv)
    if not 0 < a.prompt <= a.chunk:
        ap.error(f"--prompt {a.prompt} must be 1..--chunk {a.chunk}")

    ck = Path(a.work) / "ck"
    if not (ck / "model.safetensors").exists():
        save_random_checkpoint(llama_config(a), ck)
    block, batch = 16, 8
    model = tlaloc_jax.load_hf(ck, block_size=block, weight_layout="per-layer")
    cfg, weights = model.config, model.weights
    width = a.context // block
    rows = [RowCall([(r * 37 + j * 11) % 4000 + 3 for j in range(a.prompt)], 0,
                    list(range(r * width, (r + 1) * width))) for r in range(a.rows)]
    plain = build_step_inputs(rows, batch=batch, tokens=a.chunk, width=width, block_size=block)
    n = next(n for n in packed_token_ladder(batch, a.chunk) if n >= a.rows * a.prompt)
    packed = pack_step_inputs(plain, n)
    fwd = jax.jit(lambda w, p, i: forward(cfg, w, p, i), donate_argnums=1)
    state = {"p": model.new_pools(batch * width)}

    def run(inputs):
        def go():
            out, state["p"] = fwd(weights, state["p"], StepInputs(**inputs))
            return out.block_until_ready()
        return go

    padded_call, packed_call = run(plain), run(packed)
    want, got = np.asarray(padded_call())[:a.rows], np.asarray(packed_call())[:a.rows]
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=a.context))
    err = np.abs(got - want).max() / np.abs(want).max()
    t_plain, t_packed = median_times([padded_call, packed_call], a.steps)
    print(f"82M-shaped Llama, {a.rows} prompts of {a.prompt} tokens, jax {jax.__version__} "
          f"({jax.devices()[0].platform})")
    print(f"padded call, {batch} rows of {a.chunk} ({batch * a.chunk} positions)  {t_plain * 1e3:8.1f} ms")
    print(f"packed call, N = {n} ({a.rows * a.prompt} tokens)        {t_packed * 1e3:8.1f} ms  "
          f"= {t_packed / t_plain:.2f}x the padded call")
    print(f"packed logits against the padded call's: {err:.2e} of the largest (bound {bound:.2e}): "
          f"{'within' if err <= bound else 'OUTSIDE'}")


if __name__ == "__main__":
    main()
