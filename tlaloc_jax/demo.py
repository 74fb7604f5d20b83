"""`make demo`: build a tiny seeded checkpoint, load it, and run the paged decode loop in-process.

Until the export and the JAX-free runtime exist this is the main job: a Llama-shaped decoder read
from a Hugging Face-format directory, prompts prefilled together in one call, then decoded together.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

DEMO_CONFIG = {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def build_demo_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    from .checkpoint import random_weights, save_checkpoint
    from .families import config_from_hf

    fam, cfg = config_from_hf(DEMO_CONFIG)
    return save_checkpoint(out_dir, DEMO_CONFIG, random_weights(cfg, fam, seed))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tlaloc_jax.demo", description=__doc__)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from . import load_hf

    with tempfile.TemporaryDirectory() as tmp:
        path = build_demo_checkpoint(Path(tmp) / "tiny-llama", args.seed)
        model = load_hf(path)
        cfg = model.config
        print(f"model: {cfg.model_type}, {cfg.num_layers} layers, {cfg.num_heads} heads "
              f"({cfg.num_kv_heads} KV heads) of {cfg.head_dim}, vocab {cfg.vocab_size}, random weights (seed {args.seed})")
        prompts = [[1, 2, 3, 4, 5], [100, 200, 300], [42] * 9]
        model.generate(prompts, max_new_tokens=args.max_new_tokens)   # compile
        t0 = time.perf_counter()
        out = model.generate(prompts, max_new_tokens=args.max_new_tokens)
        dt = time.perf_counter() - t0
        for p, o in zip(prompts, out):
            print(f"prompt {p} -> {o}")
        n = sum(map(len, out))
        print(f"{len(prompts)} sequences decoded together: {n} tokens in {dt * 1e3:.1f} ms ({n / dt:.0f} tokens/s)")


if __name__ == "__main__":
    main()
