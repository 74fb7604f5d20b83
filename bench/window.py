"""The windowed KV pool against full-history pages, for a model with 3 of 4 layers sliding.

One run, one model (random weights), two artifacts of it: windowed (manifest v3: sliding layers keep a
ring of pages per sequence) and --windowed-kv false (every layer keeps full-history pages). For a
sequence of 4x, 16x and 64x the window it prints the KV bytes the sequence holds, read from the
runtime's page allocators after the prompt is in (not computed from a formula), and the time of the
prompt's last prefill chunk through each artifact.

    python -m bench.window                     # window 64, pages of 16, chunks of 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="prompts timed per length (median)")
    args = ap.parse_args(argv)

    from tlaloc_jax.checkpoint import random_weights, save_checkpoint
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.families import config_from_hf
    from tlaloc_jax.serve import Engine

    W, S = args.window, args.block_size
    multiples = (4, 16, 64)
    contexts = tuple(m * W for m in multiples)
    hf = dict(model_type="gemma3_text", vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              sliding_window=W, query_pre_attn_scalar=32, rms_norm_eps=1e-6, max_position_embeddings=contexts[-1],
              layer_types=["sliding_attention"] * 3 + ["full_attention"], tie_word_embeddings=True,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    fam, cfg = config_from_hf(hf)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_checkpoint(tmp / "ck", hf, random_weights(cfg, fam, seed=0))
        ladder = dict(batch_ladder=(1,), context_ladder=contexts, prefill_chunk=args.chunk, block_size=S,
                      progress=False)
        engines = {}
        for name, windowed in (("windowed", True), ("full-history", False)):
            export_checkpoint(tmp / "ck", tmp / name, windowed_kv=windowed, **ladder)
            engines[name] = Engine.load(tmp / name, cache_dir=None, progress=False)
        m = engines["windowed"].manifest
        page_bytes = {p.name: p.shape[0] * 2 * S * p.shape[4] * p.shape[5] * 4 for p in m.pools}  # all layers of the pool
        full_page_bytes = engines["full-history"].manifest.pool("kv").shape[0] * 2 * S * cfg.num_kv_heads * cfg.head_dim * 4
        print(f"model: gemma3_text-shaped, 4 layers (3 sliding, window {W}), {cfg.num_kv_heads} KV heads of "
              f"{cfg.head_dim}, f32 KV, pages of {S}; ring of {m.ring.ring_pages} pages; prefill chunks of {args.chunk}")
        print()
        print(f"{'positions':>10} | {'full-history KV/seq':>19} | {'windowed KV/seq':>15} | {'ratio':>5} | "
              f"{'last chunk, full':>16} | {'last chunk, ring':>16} | {'speed-up':>8}")
        for mult in multiples:
            n = mult * W
            prompt = [(i * 7 + 3) % 512 for i in range(n - 1)]   # n positions once the first token is in
            held, last = {}, {}
            for name, eng in engines.items():
                times = []
                for _ in range(args.repeats):
                    # Two new tokens: the sequence is still alive (holding its pages) after its first.
                    rid = eng.add_request(prompt, max_new_tokens=2)
                    first = True
                    while eng.has_unfinished():
                        t0 = time.perf_counter()
                        events = eng.step()
                        dt = time.perf_counter() - t0
                        if events and first:      # the step whose call read the prompt's last chunk
                            first = False
                            times.append(dt)
                            held[name] = {p: a["pages_in_use"] for p, a in eng.stats()["pools"].items()}
                    eng.release(rid)
                last[name] = statistics.median(times)
            kv_full = held["full-history"]["kv"] * full_page_bytes
            kv_win = sum(held["windowed"][p] * page_bytes[p] for p in held["windowed"])
            print(f"{n:>10,} | {kv_full / 2**10:>15,.0f} KiB | {kv_win / 2**10:>11,.0f} KiB | {kv_full / kv_win:5.2f} | "
                  f"{last['full-history'] * 1e3:>13.1f} ms | {last['windowed'] * 1e3:>13.1f} ms | "
                  f"{last['full-history'] / last['windowed']:7.2f}x")
        for eng in engines.values():
            eng.close()


if __name__ == "__main__":
    main()
