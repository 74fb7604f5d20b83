"""The tiny artifacts the HTTP tests serve, and the in-process harness that drives `create_app` without a socket.

One seeded llama checkpoint, exported with its tokenizer (the "text" artifact) and without it (the "ids"
artifact): decode batches 1 and 8, prefill batch 1, contexts 32 and 64, a pool of 64 pages of 8 positions.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from pathlib import Path

import httpx
from starlette.testclient import TestClient

from hf_models import build_checkpoint
from tlaloc_jax.export import export_checkpoint
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.http import create_app
from tokenizers_util import EOS, IMAGE, VOCAB, write_tokenizer

LADDER = dict(batch_ladder=(1, 8), context_ladder=(32, 64), block_size=8, prefill_chunk=16, prefill_long_chunk=0,
              prefill_max_batch=1, num_blocks=64, progress=False)
CONTEXT = 64
NUM_PAGES = 64
STOP = [EOS]            # the checkpoint's eos: the server stops on it, so an oracle run does too
GOOD = [5, 17, 99, 3, 250, 8, 61]
# A compact chat template that defines tools in the Hermes format (an assistant's calls written as the demo model's
# template writes them: a dict through tojson).
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for call in m['tool_calls'] or [] %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if tools %}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def export_http_artifacts(root: Path) -> tuple[Path, Path]:
    """(text artifact, ids artifact) under root. Same ladder, so the same bodies: the second load compiles
    from the cache."""
    ck = build_checkpoint(root / "ck", "llama", seed=31, vocab_size=VOCAB, eos_token_id=EOS)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["image_token_id"] = IMAGE
    (ck / "config.json").write_text(json.dumps(cfg))
    export_checkpoint(ck, root / "ids", **LADDER)
    write_tokenizer(ck)
    export_checkpoint(ck, root / "text", **LADDER)
    return root / "text", root / "ids"


@contextlib.contextmanager
def loaded(artifact: Path, cache_dir: Path):
    """The Engine on `artifact`, compiled executables cached in `cache_dir`, closed on leaving."""
    with Engine.load(artifact, cache_dir=cache_dir, progress=False) as engine:
        yield engine


def solo_runner(engine, stop=()):
    """prompt ids, max_tokens (, sampling) -> the ids Engine.generate gives that prompt alone (stopping on `stop`),
    each asked once."""
    memo = {}

    def run(prompt, max_tokens, sampling=None):
        key = (tuple(prompt), max_tokens, sampling)
        if key not in memo:
            memo[key] = engine.generate([prompt], max_tokens, sampling=sampling, stop_token_ids=stop)[0]
        return memo[key]
    return run


class InProcess:
    """create_app(engine, **kw) driven in this process by starlette's TestClient (the app's lifespan, hence
    its engine loop thread, runs inside the `with`)."""

    def __init__(self, engine, **kw):
        self.app = create_app(engine, **kw)
        self.server = self.app.state.server
        self.client = TestClient(self.app, base_url="http://localhost", raise_server_exceptions=False)

    def __enter__(self) -> "InProcess":
        self.client.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.client.__exit__(*exc)

    def post(self, path: str, body, headers: dict | None = None):
        if isinstance(body, (bytes, str)):
            return self.client.post(path, content=body, headers={"Content-Type": "application/json",
                                                                  **(headers or {})})
        return self.client.post(path, json=body, headers=headers)

    def pool(self) -> dict:
        """Pages held per pool, and the sequences running and waiting, read on the loop thread between steps."""
        def read(loop):
            st = loop.engine.stats()
            return dict(running=len(loop._running), waiting=len(loop._waiting) + st["waiting"],
                        **{f"{n}_in_use": p["pages_in_use"] for n, p in st["pools"].items()})
        return self.server.loop.call(read).result(timeout=30)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """The pool state once nothing runs, waits or holds a page (aborts land at the next step boundary);
        the last state read if that does not happen within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.pool()
            if not any(state.values()) or time.monotonic() > deadline:
                return state
            time.sleep(0.01)


@contextlib.asynccontextmanager
async def serving(engine, **kw):
    """(httpx.AsyncClient, server) for create_app(engine, **kw) on the running asyncio loop: requests made
    concurrently with asyncio.gather share the app's event loop, as a real server's clients do."""
    app = create_app(engine, **kw)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost",
                                     timeout=60) as client:
            yield client, app.state.server


@contextlib.contextmanager
def frozen_heap():
    """A latency check's window with the heap frozen, as `python -m tlaloc_jax.serve` freezes its own once loaded
    (serve/__main__.py freeze_heap): a test worker holds a million objects from earlier tests, and one full
    collection of them stops every thread of the process for 0.4-1.4 s, which is no request's doing."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def stream_ids(http: httpx.AsyncClient, body: dict, started: asyncio.Event) -> list[int]:
    """A streamed completion's token ids (each chunk's choices[0].token_ids), `started` set at the first chunk."""
    ids = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
                started.set()
    return ids


async def health_gaps(client, request: asyncio.Future) -> list[float]:
    """Poll /health on the running event loop until `request` is done -> the seconds between answers."""
    gaps, last = [], time.perf_counter()
    while not request.done():
        await asyncio.sleep(0.005)      # a poll that never suspends would starve the request's task
        assert (await client.get("/health")).status_code == 200
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return gaps
