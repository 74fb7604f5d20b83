"""Speculative decoding's gain: tokens/s of greedy generation with and without n-gram speculation (prompt lookup,
serve --speculative-config) on the demo model (tlaloc_jax/demo_model, trained on Python code), at batch 1 and 4,
on (a) a copy-heavy workload, a code excerpt given and then begun again (the model continues by copying it), and
(b) open generation, the start of a function to write, and (c) nothing accepted: the copy-heavy prompts with every
draft shifted to the next token id, which the model does not continue with (what speculation costs a sequence
while it backs off and before it stops drafting, serve/speculative.SpecState); with the drafts' acceptance rate and
the verify rows a sequence ran. Both engines run in one process, rounds interleaved; each round checks that
speculation's ids equal plain decoding's. Tokens/s are by wall time, and by this process's CPU time beside them (on
a busy machine the wall time also counts waiting for a core).

--peer llama.cpp adds llama.cpp on the same checkpoint (bench/speculative_peer.py): the copy-heavy workload at batch
1, plain and with llama-cpp-python's prompt lookup decoding, interleaved with this runtime's runs; its greedy ids
with lookup must equal its own without.

--draft-layers N adds a draft-model row (method "draft_model", serve/draft_model.py) on the copy-heavy and open
workloads: the draft is the target's first N of its layers (its final norm and tied head kept: a truncated copy,
no other small model of its tokenizer exists here); N = all of them is the target drafting for itself, every
draft accepted and nothing gained (the draft costs what the target does).

--model copier runs the same rows on the copier instead of the demo model: a model that continues a quoted excerpt
by copying it, as the copy-heavy workload wants (the demo model does not): the demo model fine-tuned on synthetic
copies (COPIER, tlaloc_jax/tools/train.py --synthetic-copy: a span of random token ids after a blank line, over and
over), trained once under --work (seeded, training.json beside it), never shipped. --model authored runs them on the
authored copier (bench/authored_copier.py: an induction circuit set by hand, matching the last 16 tokens, padded
with filler layers to ~133M parameters, not a trained model; written once under --work), which copies every quoted
token of the copy-heavy prompts at a weight-bound step cost.

    python -m bench.speculative [--work /tmp/tlaloc-spec-bench] [--k 4] [--new 96] [--rounds 3] [--only never]
    LLAMA_CPP_LIB_PATH=<dir of libllama.so> python -m bench.speculative --only copy-heavy --peer llama.cpp
    python -m bench.speculative --draft-layers 2
    python -m bench.speculative --model copier --draft-layers 2
    python -m bench.speculative --model authored --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
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


RESTART = 8   # tokens of the excerpt a copy-heavy prompt begins again with


def workloads(tokenizer, quote: int) -> dict[str, list[list[int]]]:
    """copy: an excerpt, a blank line, then its first RESTART tokens again; open: a function's first line."""
    copy, open_ = [], []
    for path in SOURCES:
        ids = excerpt(path, tokenizer, quote)
        copy.append(ids + tokenizer.encode("\n\n").ids + ids[:RESTART])
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


# The copier: the demo model fine-tuned on windows of one random token span repeated after a blank line
# (tlaloc_jax/tools/train.py --synthetic-copy), where copying is the only way to predict.
COPIER = {"synthetic_copy": 1.0, "steps": 600, "learning_rate": 2e-3, "warmup_steps": 10, "eval_interval": 100,
          "eval_batches": 2}


def copier(work: Path) -> Path:
    """The copier checkpoint (trained once under `work`, seeded; its training.json beside it)."""
    from tlaloc_jax.checkpoint import DEMO_MODEL
    from tlaloc_jax.tools.train import TrainConfig, train

    out = work / "copier-ck"
    if not (out / "config.json").exists():
        print(f"training the copier from the demo model ({COPIER}) into {out}", flush=True)
        train(TrainConfig(**COPIER), out, init=DEMO_MODEL, progress=False)
    return out


def authored(work: Path) -> Path:
    """The authored copier's checkpoint (bench/authored_copier.py's defaults), written once under `work`."""
    from bench.authored_copier import authored_copier

    out = work / "authored-ck"
    return out if (out / "config.json").exists() else authored_copier(out)


def copied(prompts, outputs, quote: int) -> list[int]:
    """Per copy-heavy prompt: how many of the quoted excerpt's remaining tokens its continuation repeats in order."""
    return [sum(1 for _ in itertools.takewhile(lambda t: t[0] == t[1], zip(out, p[RESTART:quote])))
            for p, out in zip(prompts, outputs)]


def run(generate, prompts, batch: int, new: int) -> tuple[list[list[int]], float, float, int]:
    """-> (ids, wall seconds, CPU seconds of this process, tokens): the prompts in groups of `batch`, each group
    generated together by generate(prompts, new)."""
    out, t0, c0 = [], time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        out += generate(prompts[i:i + batch], new)
    return out, time.perf_counter() - t0, time.process_time() - c0, sum(map(len, out))


def interleaved(systems: dict, prompts, batch: int, new: int, rounds: int, check) -> dict[str, dict]:
    """Each system (name -> (generate, context manager around its runs, its engine or None)) on the prompts, in turn,
    rounds + 1 times (the first warms up and is not counted); check(name, ids) after every run. -> per system: the
    median tokens/s by wall and by CPU time, and its engine's spec-decode counters summed over the counted rounds."""
    rates = {name: {"wall": [], "cpu": [], "drafted": 0, "accepted": 0, "rows": 0} for name in systems}
    for r in range(rounds + 1):
        for name, (generate, around, eng) in systems.items():
            before = eng.stats() if eng is not None else None
            with around():
                ids, wall, cpu, n = run(generate, prompts, batch, new)
            check(name, ids)
            if r == 0:
                continue
            rates[name]["wall"].append(n / wall)
            rates[name]["cpu"].append(n / cpu)
            if eng is not None:
                after = eng.stats()
                for key, stat in (("drafted", "spec_decode_num_draft_tokens"),
                                  ("accepted", "spec_decode_num_accepted_tokens"), ("rows", "spec_decode_num_drafts")):
                    rates[name][key] += after[stat] - before[stat]
    for v in rates.values():
        v["wall"], v["cpu"] = statistics.median(v["wall"]), statistics.median(v["cpu"])
    return rates


def report(name: str, batch: int, rates: dict, base: str, spec: str, sequences: int) -> None:
    p, s = rates[base], rates[spec]
    print(f"{name:>10} batch {batch}: {base} {p['wall']:6.1f} tok/s, {spec} {s['wall']:6.1f} tok/s "
          f"({s['wall'] / p['wall']:.2f}x; by CPU time {s['cpu'] / p['cpu']:.2f}x)", end="")
    if s["rows"] or s["drafted"]:
        print(f"; drafts accepted {s['accepted']}/{s['drafted']} ({s['accepted'] / max(s['drafted'], 1):.0%}), "
              f"{s['rows'] / sequences:.1f} verify rows a sequence", end="")
    print(flush=True)


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
    ap.add_argument("--peer", choices=("llama.cpp",), default=None,
                    help="also run llama.cpp plain and with its prompt lookup decoding (bench/speculative_peer.py) on "
                         "the copy-heavy workload at batch 1, interleaved with this runtime's runs")
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp's threads (its threads spin at a barrier and stall when another process takes a "
                         "core of a busy machine)")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="add a draft-model row, the draft the target's first N layers (0: none; 4: the target)")
    ap.add_argument("--model", choices=("demo", "copier", "authored"), default="demo",
                    help="the target: the demo model, the copier trained from it under --work (COPIER), or the "
                         "authored copier written under --work (bench/authored_copier.py)")
    a = ap.parse_args(argv)

    from tokenizers import Tokenizer

    from tlaloc_jax.checkpoint import DEMO_MODEL
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.serve import Engine

    ckpt = {"demo": lambda work: DEMO_MODEL, "copier": copier, "authored": authored}[a.model](Path(a.work))
    art = Path(a.work) / f"{a.model}-k{a.k}"
    if not (art / "tlaloc-serving.json").exists():
        export_checkpoint(ckpt, art, batch_ladder=(1, 4), context_ladder=(256,), speculative_tokens=a.k,
                          progress=False)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    loads = workloads(tok, a.quote)
    config = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": a.lookup_min,
              "prompt_lookup_max": a.lookup_max}
    cache = Path(a.work) / "cache"
    engines = contextlib.ExitStack()
    draft = None
    if a.draft_layers:
        small = Path(a.work) / f"{a.model}-draft-{a.draft_layers}"
        if not (small / "tlaloc-serving.json").exists():
            export_checkpoint(truncated_copy(ckpt, Path(a.work) / f"{a.model}-ck-{a.draft_layers}", a.draft_layers),
                              small, batch_ladder=(1, 4), context_ladder=(256,), progress=False)
        draft = engines.enter_context(Engine.load(art, cache_dir=cache, progress=False, speculative_config={
            "method": "draft_model", "model": str(small), "num_speculative_tokens": a.k}))
    with engines, Engine.load(art, cache_dir=cache, progress=False) as plain, \
            Engine.load(art, cache_dir=cache, progress=False, speculative_config=config) as spec:
        print(f"{a.model} model, verify entries of {a.k} drafts, ngram {a.lookup_min}-{a.lookup_max}, {a.new} new tokens "
              f"a prompt, {len(SOURCES)} prompts a workload, {a.rounds} interleaved rounds (median)")
        for name, prompts in loads.items():
            if a.only not in (None, name):
                continue
            shifted = (lambda: never_accepted(tok.get_vocab_size())) if name == "never" else contextlib.nullcontext
            for batch in (1, 4):
                want: dict[str, list] = {}

                def check(system, ids):
                    want.setdefault("plain", ids)
                    assert ids == want["plain"], f"{name} batch {batch}: {system} changed the ids"
                systems = {"plain": (plain.generate, contextlib.nullcontext, None),
                           "ngram": (spec.generate, shifted, spec)}
                if draft is not None and name != "never":
                    systems["draft model"] = (draft.generate, contextlib.nullcontext, draft)
                rates = interleaved(systems, prompts, batch, a.new, a.rounds, check)
                if name == "copy-heavy" and batch == 1:
                    print(f"greedy continuations repeat {copied(prompts, want['plain'], a.quote)} of the "
                          f"{a.quote - RESTART} quoted tokens left", flush=True)
                report(name, batch, rates, "plain", "ngram", len(prompts) * a.rounds)
                if "draft model" in systems:
                    report(f"{a.draft_layers}/{layers} draft", batch, rates, "plain", "draft model",
                           len(prompts) * a.rounds)
        if a.peer:
            peer_rounds(a, ckpt, loads["copy-heavy"], plain, spec)


def peer_rounds(a, ckpt: Path, prompts, plain, spec) -> None:
    """The copy-heavy workload at batch 1 on both engines, plain and speculating, interleaved."""
    from bench.speculative_peer import LlamaCppLookup, demo_gguf

    folder = Path(a.work) if a.model == "demo" else Path(a.work) / f"{a.model}-gguf"
    folder.mkdir(parents=True, exist_ok=True)
    gguf = demo_gguf(ckpt, folder)
    context = plain.scheduler.max_context
    lcpp = LlamaCppLookup(gguf, context=context, threads=a.threads)
    lookup = LlamaCppLookup(gguf, context=context, threads=a.threads, lookup=a.k, lookup_max=a.lookup_max)
    ids: dict[str, list] = {}

    def check(system, got):
        ids.setdefault(system, got)
        assert got == ids[system], f"{system}: its greedy ids changed between rounds"
        partner = {"ngram": "plain", "llama.cpp lookup": "llama.cpp"}.get(system)
        assert partner is None or got == ids[partner], f"{system} changed the ids of {partner}"
    systems = {"plain": (plain.generate, contextlib.nullcontext, None),
               "ngram": (spec.generate, contextlib.nullcontext, spec),
               "llama.cpp": (lcpp.generate, contextlib.nullcontext, None),
               "llama.cpp lookup": (lookup.generate, contextlib.nullcontext, None)}
    rates = interleaved(systems, prompts, 1, a.new, a.rounds, check)
    print(f"against llama.cpp ({a.threads} thread(s), lookup of {a.k} drafts from n-grams of 1-{a.lookup_max}), "
          "copy-heavy, batch 1:")
    report("tlaloc-jax", 1, rates, "plain", "ngram", len(prompts) * a.rounds)
    report("llama.cpp", 1, rates, "llama.cpp", "llama.cpp lookup", len(prompts) * a.rounds)
    agree = [sum(1 for _ in itertools.takewhile(lambda t: t[0] == t[1], zip(x, y)))
             for x, y in zip(ids["plain"], ids["llama.cpp"])]
    print(f"tlaloc-jax / llama.cpp tokens/s: plain {rates['plain']['wall'] / rates['llama.cpp']['wall']:.2f}x, "
          f"speculating {rates['ngram']['wall'] / rates['llama.cpp lookup']['wall']:.2f}x; greedy ids agree for the "
          f"first {agree} tokens of {[len(x) for x in ids['plain']]}", flush=True)

if __name__ == "__main__":
    main()
