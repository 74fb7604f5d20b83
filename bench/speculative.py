"""Speculative decoding's gain: tokens/s of greedy generation with and without n-gram speculation (prompt lookup,
serve --speculative-config) on the demo model (tlaloc_jax/demo_model, trained on Python code), at batch 1 and 4,
on (a) a copy-heavy workload, a code excerpt given and then begun again (the model continues by copying it), and
(b) open generation, the start of a function to write, and (c) nothing accepted: the copy-heavy prompts with every
draft shifted to the next token id, which the model does not continue with (what speculation costs a sequence
before it stops drafting, serve/speculative.SpecState); with the drafts' acceptance rate. Both engines run in one
process, rounds interleaved; each round checks that speculation's ids equal plain decoding's.

--draft-layers N adds a draft-model row (method "draft_model", serve/draft_model.py) on the copy-heavy and open
workloads: the draft is the demo model's first N of its 4 layers (its final norm and tied head kept: a truncated
copy, no other small model of its tokenizer exists here); N = 4 is the target drafting for itself, every draft
accepted and nothing gained (the draft costs what the target does).

    python -m bench.speculative [--work /tmp/tlaloc-spec-bench] [--k 4] [--new 96] [--rounds 3] [--only never]
                                [--draft-layers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
# Excerpts of this repository's own code: what the copy-heavy prompts quote and the open prompts begin.
SOURCES = ("serve/core/paging.py", "serve/core/kv_cache.py", "serve/host_sampling.py", "serve/core/prefix_cache.py")


def excerpt(path: str, tokenizer, tokens: int) -> list[int]:
    """The first `tokens` tokens of a source file's first function (or method)."""
    text = (ROOT / path).read_text()
    return tokenizer.encode(text[text.index("def "):]).ids[:tokens]


def workloads(tokenizer, quote: int) -> dict[str, list[list[int]]]:
    """copy: an excerpt, a blank line, then its first 8 tokens again; open: a function's first line."""
    copy, open_ = [], []
    for path in SOURCES:
        ids = excerpt(path, tokenizer, quote)
        copy.append(ids + tokenizer.encode("\n\n").ids + ids[:8])
        open_.append(ids[:12])
    return {"copy-heavy": copy, "open": open_, "never": copy}


def never_accepted(vocab: int):
    """The n-gram proposer with each draft shifted to the next token id: drafts where it drafts, none accepted but
    by chance (the "never" workload)."""
    from tlaloc_jax.serve import speculative

    real = speculative.propose_ngram
    return mock.patch.object(speculative, "propose_ngram",
                             lambda *args: [(t + 1) % vocab for t in real(*args)])


def truncated_copy(src: Path, out: Path, layers: int) -> Path:
    """A checkpoint of `src`'s first `layers` decoder layers (embedding, final norm and head kept), tokenizer copied."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    keep = {k: v for k, v in load_file(src / "model.safetensors").items()
            if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < layers}
    save_file(keep, out / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return out


def run(eng, prompts, batch: int, new: int) -> tuple[list[list[int]], float, int]:
    """-> (ids, seconds, tokens): the prompts in groups of `batch`, each group generated together."""
    out, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        out += eng.generate(prompts[i:i + batch], new)
    return out, time.perf_counter() - t0, sum(map(len, out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/tlaloc-spec-bench")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (and the export's --speculative-tokens)")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--quote", type=int, default=96, help="tokens of code the copy-heavy prompts quote")
    ap.add_argument("--new", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=("copy-heavy", "open", "never"), default=None, help="run one workload")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="add a draft-model row, the draft the demo model's first N layers (0: none; 4: the target)")
    a = ap.parse_args(argv)

    from tokenizers import Tokenizer

    from tlaloc_jax.checkpoint import DEMO_MODEL
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.serve import Engine

    art = Path(a.work) / f"demo-k{a.k}"
    if not (art / "tlaloc-serving.json").exists():
        export_checkpoint(DEMO_MODEL, art, batch_ladder=(1, 4), context_ladder=(256,), speculative_tokens=a.k,
                          progress=False)
    tok = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    loads = workloads(tok, a.quote)
    config = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": a.lookup_min,
              "prompt_lookup_max": a.lookup_max}
    cache = Path(a.work) / "cache"
    engines = contextlib.ExitStack()
    draft = None
    if a.draft_layers:
        small = Path(a.work) / f"demo-draft-{a.draft_layers}"
        if not (small / "tlaloc-serving.json").exists():
            export_checkpoint(truncated_copy(DEMO_MODEL, Path(a.work) / f"demo-ck-{a.draft_layers}", a.draft_layers),
                              small, batch_ladder=(1, 4), context_ladder=(256,), progress=False)
        draft = engines.enter_context(Engine.load(art, cache_dir=cache, progress=False, speculative_config={
            "method": "draft_model", "model": str(small), "num_speculative_tokens": a.k}))
    with engines, Engine.load(art, cache_dir=cache, progress=False) as plain, \
            Engine.load(art, cache_dir=cache, progress=False, speculative_config=config) as spec:
        print(f"demo model, verify entries of {a.k} drafts, ngram {a.lookup_min}-{a.lookup_max}, {a.new} new tokens "
              f"a prompt, {len(SOURCES)} prompts a workload, {a.rounds} interleaved rounds (median)")
        for name, prompts in loads.items():
            if a.only not in (None, name):
                continue
            shifted = never_accepted(tok.get_vocab_size()) if name == "never" else contextlib.nullcontext()
            for batch in (1, 4):
                rates = {"plain": [], "ngram": []}
                drafted = accepted = 0
                for _ in range(a.rounds + 1):        # the first round warms both up and is not counted
                    want, dt, n = run(plain, prompts, batch, a.new)
                    rates["plain"].append(n / dt)
                    before = spec.stats()
                    with shifted:
                        got, dt, n = run(spec, prompts, batch, a.new)
                    rates["ngram"].append(n / dt)
                    after = spec.stats()
                    assert got == want, f"{name} batch {batch}: speculation changed the ids"
                    drafted += after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
                    accepted += after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                p, s = (statistics.median(rates[k][1:]) for k in ("plain", "ngram"))
                print(f"{name:>10} batch {batch}: plain {p:6.1f} tok/s, ngram {s:6.1f} tok/s ({s / p:.2f}x); "
                      f"drafts accepted {accepted}/{drafted} ({accepted / max(drafted, 1):.0%})", flush=True)
                if draft is not None and name != "never":
                    d, acc = versus(plain, draft, prompts, batch, a)
                    print(f"{'':>10} batch {batch}: plain {d[0]:6.1f} tok/s, draft model ({a.draft_layers} of 4 "
                          f"layers) {d[1]:6.1f} tok/s ({d[1] / d[0]:.2f}x); drafts accepted {acc}", flush=True)


def versus(plain, spec, prompts, batch: int, a) -> tuple[tuple[float, float], str]:
    """Median tokens/s of plain and speculative decoding over interleaved rounds (the first a warm-up), ids checked
    equal; -> ((plain, spec), "accepted/drafted (rate)")."""
    rates: tuple[list, list] = ([], [])
    drafted = accepted = 0
    for _ in range(a.rounds + 1):
        want, dt, n = run(plain, prompts, batch, a.new)
        rates[0].append(n / dt)
        before = spec.stats()
        got, dt, n = run(spec, prompts, batch, a.new)
        rates[1].append(n / dt)
        after = spec.stats()
        assert got == want, f"batch {batch}: the draft model changed the ids"
        drafted += after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted += after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    medians = tuple(statistics.median(r[1:]) for r in rates)
    return medians, f"{accepted}/{drafted} ({accepted / max(drafted, 1):.0%})"


if __name__ == "__main__":
    main()
