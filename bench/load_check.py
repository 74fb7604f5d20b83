"""What the load-time checks cost: `load_manifest` with and without hashing the weights (--trust-weights), on
the embedded demo artifact and on a random Llama of about 400 MB of f32 weights, measured in one run.

    python -m bench.load_check                 # demo + 400 MB
    python -m bench.load_check --mb 100        # a smaller second artifact

Every body, tokenizer and manifest check runs either way; only the weights' sha256 is skipped when trusted.
It prints the median of 3 reads of each (the files are in the page cache after the first: a cold read from
disk adds the disk's time, the same for hashing or for uploading the weights).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _median(fn, n=3):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=400, help="weights of the second artifact, MB (f32)")
    args = ap.parse_args(argv)

    from tlaloc_jax import artifact as af
    from tlaloc_jax.checkpoint import random_weights, save_checkpoint
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.families import config_from_hf
    from tlaloc_jax.tools.demo import export_demo

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        export_demo(tmp / "demo")
        # hidden 1024, 12 layers of 12.6M, vocab 32000 tied: about args.mb MB of f32 with the layer count scaled.
        per_layer = 4 * (4 * 1024 * 1024 + 3 * 1024 * 2816)
        layers = max(1, round((args.mb * 1e6 - 4 * 32000 * 1024) / per_layer))
        hf = dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                  num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16, head_dim=64,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 10000.0})
        fam, cfg = config_from_hf(hf)
        save_checkpoint(tmp / "ck", hf, random_weights(cfg, fam, seed=0, std=0.02))
        export_checkpoint(tmp / "ck", tmp / "big", batch_ladder=(1,), context_ladder=(64,), block_size=16,
                          progress=False)
        print(f"{'artifact':>22} | {'weights':>9} | {'all checks':>10} | {'weights trusted':>15} | hashing adds")
        for name in ("demo", "big"):
            m = af.load_manifest(tmp / name)
            mb = sum(w.nbytes for w in m.weights) / 1e6
            full = _median(lambda: af.load_manifest(tmp / name))
            trusted = _median(lambda: af.load_manifest(tmp / name, verify_weights=False))
            label = "demo (embedded model)" if name == "demo" else f"llama, {layers} layers"
            print(f"{label:>22} | {mb:7.1f} MB | {full * 1e3:7.0f} ms | {trusted * 1e3:12.0f} ms | "
                  f"{(full - trusted) * 1e3:.0f} ms ({mb / max(full - trusted, 1e-9):.0f} MB/s)")


if __name__ == "__main__":
    main()
