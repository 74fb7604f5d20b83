"""python -m tlaloc_jax.tools.quality ART_A ART_B --text FILE: how far artifact B (say, int8 weights) is from A (the
unquantized model), both served by the JAX-free runtime (tlaloc_jax.serve.engine).

Three measures:
* greedy fixture ids: a few prompts cut from the text, N greedy tokens each from A and from B; how many of B's
  equal A's (the identical prefix), and B's teacher-forced top-1 on A's ids (B fed A's tokens).
* perplexity of the text on each, scored one token a call: the text is a prompt read a token a call with
  prompt logprobs (the engine's prompt_logprobs path), so each position's distribution is the runtime's own;
  a text longer than the artifacts' largest context is scored in consecutive windows of that many tokens.
* top-1 agreement: at each position of the text, whether B's most likely next token is A's.

Text: a Python standard-library source the demo model was not trained on. tlaloc_jax/tools/train.py holds out every
20th file of the sorted standard library (`held_out_files`); `--held-out NAME` picks one of them by its path
relative to the library (default difflib.py). Other checkpoints were not trained on this text either, or on
anything we know of; for them it is just code to score.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

DEFAULT_HELD_OUT = "difflib.py"


def held_out_files(val_every: int = 20) -> list[Path]:
    """The standard-library files tlaloc_jax.tools.train keeps out of the demo model's training corpus."""
    from tlaloc_jax.tools.train import corpus_files, split_files
    return split_files(corpus_files(), val_every)[1]


def held_out_text(name: str = DEFAULT_HELD_OUT) -> tuple[Path, str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = {f.relative_to(root).as_posix(): f for f in held_out_files()}
    if name not in files:
        raise ValueError(f"{name!r} is not a held-out standard-library file (held out: {', '.join(sorted(files))})")
    return files[name], files[name].read_text(encoding="utf-8", errors="replace")


@dataclass(frozen=True)
class Scored:
    """A text scored position by position: the logprob of each next token and the most likely one."""

    logprobs: list[float]
    top1: list[int]

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


def score(engine, ids: Sequence[int]) -> Scored:
    """Feed ids as a prompt read one token a call; -> the logprob of ids[1:] and the argmax after each of
    ids[:-1]."""
    from tlaloc_jax.serve.host_sampling import Sampling

    rid = engine.add_request(list(ids), 1, sampling=Sampling(prompt_logprobs=1))
    try:
        events = []
        while not engine.request_info(rid).finished:
            events += [e for e in engine.step() if e.request_id == rid]
        first = next(e for e in events if e.token is not None and e.prompt_logprobs)
    finally:
        engine.release(rid)
    entries = [p for p in first.prompt_logprobs if p is not None]
    return Scored([p[0] for p in entries], [p[2][0][0] for p in entries])


def score_windows(engine, ids: Sequence[int], window: int) -> Scored:
    """score over consecutive windows of at most `window` tokens (a model's context may be shorter than the
    text): each window's first token is context only."""
    logprobs, top1 = [], []
    for start in range(0, max(len(ids) - 1, 1), window):
        s = score(engine, ids[start:start + window])
        logprobs += s.logprobs
        top1 += s.top1
    return Scored(logprobs, top1)


def greedy(engine, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    return [engine.generate([p], n)[0] for p in prompts]


def fixture_prompts(ids: Sequence[int], count: int, length: int) -> list[list[int]]:
    """count prompts of `length` tokens, evenly spaced through the text's ids."""
    step = max(1, (len(ids) - length) // max(count, 1))
    return [list(ids[i * step:i * step + length]) for i in range(count)]


@dataclass(frozen=True)
class Report:
    a: str
    b: str
    text: str
    tokens: int
    fixture_ids_equal: int          # B's greedy ids equal to A's (each prompt's identical prefix, summed)
    fixture_ids: int
    fixture_teacher_forced: int     # B's top-1 on A's greedy ids equal to A's
    perplexity_a: float
    perplexity_b: float
    top1_agree: int
    top1_positions: int

    def line(self) -> str:
        return (f"fixture ids {self.fixture_ids_equal}/{self.fixture_ids} (teacher-forced "
                f"{self.fixture_teacher_forced}/{self.fixture_ids}), perplexity {self.perplexity_a:.4f} -> "
                f"{self.perplexity_b:.4f} ({100 * (self.perplexity_b / self.perplexity_a - 1):+.2f}%), top-1 "
                f"{self.top1_agree}/{self.top1_positions} ({100 * self.top1_agree / self.top1_positions:.1f}%)")


def prefix_equal(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(engine_a, engine_b, text_ids: Sequence[int], *, fixtures: int = 3, fixture_prompt: int = 16,
            fixture_tokens: int = 16, names=("A", "B"), text_name: str = "") -> Report:
    prompts = fixture_prompts(text_ids, fixtures, fixture_prompt)
    ga, gb = greedy(engine_a, prompts, fixture_tokens), greedy(engine_b, prompts, fixture_tokens)
    forced = 0
    for p, a in zip(prompts, ga):
        s = score(engine_b, p + a)
        forced += sum(int(x == y) for x, y in zip(s.top1[len(p) - 1:], a))
    window = min(engine_a.max_context, engine_b.max_context)
    sa, sb = score_windows(engine_a, text_ids, window), score_windows(engine_b, text_ids, window)
    return Report(a=names[0], b=names[1], text=text_name, tokens=len(text_ids),
                  fixture_ids_equal=sum(prefix_equal(a, b) for a, b in zip(ga, gb)),
                  fixture_ids=sum(len(a) for a in ga), fixture_teacher_forced=forced,
                  perplexity_a=sa.perplexity, perplexity_b=sb.perplexity,
                  top1_agree=sum(int(x == y) for x, y in zip(sa.top1, sb.top1)), top1_positions=len(sa.top1))


def text_ids_for(artifact: str, text: str, tokens: int) -> list[int]:
    from tlaloc_jax import artifact as af
    from tlaloc_jax.serve.tokenizer import load_tokenizer

    m = af.load_manifest(artifact, verify_files=False)
    tok = load_tokenizer(artifact, m)
    if tok is not None:
        return tok.encode(text, add_special_tokens=False)[:tokens]
    if m.model.vocab >= 256:      # a tokenizer-less test checkpoint: the text's UTF-8 bytes are its ids
        return list(text.encode("utf-8"))[:tokens]
    raise ValueError(f"artifact {artifact!r} has no tokenizer.json to encode the text with, and its vocabulary "
                     f"({m.model.vocab}) does not cover bytes")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlaloc_jax.tools.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("a", metavar="ART_A", help="the reference artifact (e.g. unquantized)")
    ap.add_argument("b", metavar="ART_B", help="the artifact compared with it (e.g. --weight-quant int8)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--text", type=Path, help="a text file to score (default: a held-out standard-library file)")
    src.add_argument("--held-out", default=DEFAULT_HELD_OUT,
                     help=f"a standard-library file the demo model was not trained on (default {DEFAULT_HELD_OUT})")
    ap.add_argument("--tokens", type=int, default=480, help="tokens of the text to score (default 480)")
    ap.add_argument("--fixtures", type=int, default=3, help="fixture prompts cut from the text (default 3)")
    ap.add_argument("--fixture-tokens", type=int, default=16, help="greedy tokens per fixture (default 16)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)

    from tlaloc_jax.serve.engine import Engine

    if args.text is not None:
        name, text = str(args.text), args.text.read_text(encoding="utf-8", errors="replace")
    else:
        path, text = held_out_text(args.held_out)
        name = str(path)
    ids = text_ids_for(args.a, text, args.tokens)
    if len(ids) < args.tokens:
        print(f"note: the text has {len(ids)} tokens, fewer than --tokens {args.tokens}", file=sys.stderr)
    with Engine.load(args.a, progress=False) as ea, Engine.load(args.b, progress=False) as eb:
        r = compare(ea, eb, ids, fixtures=args.fixtures, fixture_tokens=args.fixture_tokens,
                    names=(ea.manifest.model.name, eb.manifest.model.name), text_name=name)
    print(json.dumps(asdict(r), indent=1) if args.json else f"{r.b} against {r.a} on {r.text} ({r.tokens} tokens): "
          + r.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
