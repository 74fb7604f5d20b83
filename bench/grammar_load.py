"""What slow grammars cost the other clients of a server (issue 24), measured in one run against
`python -m tlaloc_jax.serve` on the embedded demo model (exported here: batches 1, 4, 8, context 256, sampler).

    python -m bench.grammar_load [--rounds 3] [--requests 4] [--max-tokens 32]

1. /health while a chat request with n 4 asks for a JSON object of 5,000 string properties, each with a pattern:
   the longest /health answer and gap between answers (polled every 10 ms) while it is compiled and checked, and
   what the request got (its answer, or the 400 naming the limit).
2. Eight streaming clients: six send plain completions (ignore_eos, --max-tokens tokens each, greedy and sampled
   alternately), two send the slowest grammars found that are still accepted: an ambiguous Lark grammar (its
   masks take 1.5-3 ms a token on average and up to ~8 ms on this model's texts, until it reaches llguidance's
   item limit, which ends its sequence with finish_reason "error") and one of 1,900 literals (a parser row near
   llguidance's 2,000-item limit, ~1.2 ms a token). Heavier grammars are refused at admission or fail within a
   few tokens (llguidance's limits; GrammarBudget). The six plain clients' p99 inter-token time with the two slow
   ones beside them and without (the six alone), rounds interleaved, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.load import SAMPLED, serving, stream_times

PATTERNED = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"}
                                              for i in range(5000)}}
SLOW_GRAMMARS = [
    'start: s\ns: s s | "a" | "b" | /[a-z]/ s',
    "start: x+\nx: " + " | ".join(f'"{chr(97 + i % 26)}{chr(97 + (i // 26) % 26)}{i % 10}"' for i in range(1900)),
]


def _artifact(out: Path) -> Path:
    from tlaloc_jax.export import Sampler, export_checkpoint
    from tlaloc_jax.tools.demo import DEMO_MODEL
    export_checkpoint(DEMO_MODEL, out, batch_ladder=(1, 4, 8), context_ladder=(256,), prefill_chunk=128,
                      block_size=16, progress=False, sampler=Sampler())
    return out


async def health_under_a_huge_schema(url: str) -> dict:
    body = {"messages": [{"role": "user", "content": "a record"}], "n": 4, "max_tokens": 64,
            "guided_json": PATTERNED}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        t0 = time.perf_counter()
        request = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
        latencies, answered = [], [time.perf_counter()]
        while not request.done():
            s = time.perf_counter()
            assert (await http.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - s)
            answered.append(time.perf_counter())
            await asyncio.sleep(0.01)
        r = await request
        took = time.perf_counter() - t0
    err = r.json().get("error") if r.status_code != 200 else None
    return dict(took=took, polls=len(latencies), worst=max(latencies), gap=max(np.diff(answered)),
                status=r.status_code, answer=f"{err['code']} ({err['param']}): {err['message'][:160]}" if err
                else f"{len(r.json()['choices'])} choices")


async def mixed_round(url: str, slow: bool, requests: int, max_tokens: int, seed: int) -> tuple[list[float], dict]:
    """Six plain clients (and, with `slow`, two slow-grammar clients until the plain ones are done): the plain
    clients' inter-token gaps, and the slow clients' finish reasons and tokens."""
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        done = asyncio.Event()

        async def plain(i):
            gaps = []
            for k in range(requests):
                prompt = [int(t) for t in rng.integers(1, 4000, size=int(rng.integers(4, 17)))]
                body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
                if (i + k) % 2:
                    body.update(SAMPLED, seed=seed * 100 + i * requests + k)
                gaps += (await stream_times(http, "/v1/completions", body))[1]
            return gaps

        slow_seen: dict = {}

        async def slow_client(grammar):
            while not done.is_set():
                body = {"prompt": "x", "max_tokens": max_tokens, "temperature": 1.0, "guided_grammar": grammar}
                _, _, tokens, last = await stream_times(http, "/v1/completions", body)
                reason = last.get("finish_reason")
                slow_seen[reason] = slow_seen.get(reason, 0) + 1
                slow_seen["tokens"] = slow_seen.get("tokens", 0) + tokens

        slow_tasks = [asyncio.ensure_future(slow_client(g)) for g in SLOW_GRAMMARS] if slow else []
        gaps = await asyncio.gather(*(plain(i) for i in range(6)))
        done.set()
        await asyncio.gather(*slow_tasks)
    return [g for client in gaps for g in client], slow_seen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each mix (default 3)")
    ap.add_argument("--requests", type=int, default=4, help="requests per plain client and round (default 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        artifact = _artifact(Path(tmp) / "artifact")
        with serving(artifact, Path(tmp), ["--max-batch", "8"]) as url:
            h = asyncio.run(health_under_a_huge_schema(url))
            print(f"5,000 patterned properties, n 4: answered {h['status']} after {h['took']:.2f} s "
                  f"({h['answer']}); /health polled {h['polls']} times, longest answer {h['worst'] * 1e3:.1f} ms, "
                  f"longest gap between answers {h['gap'] * 1e3:.1f} ms", flush=True)
            asyncio.run(mixed_round(url, True, 1, 8, 0))          # warm-up
            itl = {False: [], True: []}
            for r in range(args.rounds):
                for slow in (False, True):
                    gaps, seen = asyncio.run(mixed_round(url, slow, args.requests, args.max_tokens, seed=r + 1))
                    itl[slow] += gaps
                    print(f"round {r + 1}, {'6 plain + 2 slow grammars' if slow else '6 plain alone':26s}: p50 "
                          f"{statistics.median(gaps) * 1e3:.2f} ms, p99 {np.percentile(gaps, 99) * 1e3:.2f} ms "
                          f"({len(gaps)} gaps)" + (f"; the slow clients' answers: {seen}" if slow else ""), flush=True)
            alone, mixed = (np.percentile(itl[k], 99) * 1e3 for k in (False, True))
            print(f"plain clients' p99 inter-token time: {alone:.2f} ms alone, {mixed:.2f} ms beside 2 slow-grammar "
                  f"clients: ratio {mixed / alone:.2f} (p50 ratio "
                  f"{statistics.median(itl[True]) / statistics.median(itl[False]):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
