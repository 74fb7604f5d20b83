"""The body limit over a real socket (uvicorn on a loopback port, in this process): an over-size body gets its 413
while streams run beside it, whether it declares its length or comes chunked. A server that answers before reading
the body and closes the connection resets it, and a client still sending never reads the answer."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from http_util import loaded, solo_runner, stream_ids
from tlaloc_jax.serve.http import DEFAULT_MAX_BODY_BYTES, create_app
from tlaloc_jax.serve.openai import server

LIMIT = DEFAULT_MAX_BODY_BYTES
HOLDERS = [[10 + i, 20, 30] for i in range(8)]      # eight streams of 63 positions: the decode batch of 8


@pytest.fixture(scope="module")
def engine(http_artifacts, serve_cache_dir):
    with loaded(http_artifacts[1], serve_cache_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def want(engine):
    """Each stream's solo ids, computed before the server's loop thread takes the engine."""
    solo = solo_runner(engine)
    return [solo(p, 60) for p in HOLDERS]


@pytest.fixture(scope="module")
def url(engine, want):
    server = uvicorn.Server(uvicorn.Config(create_app(engine, max_body_bytes=LIMIT), log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)
    sock.close()


def _over_size(chunked: bool):
    """A completion body of twice the limit: its bytes (Content-Length), or a generator of 64 KiB pieces (chunked)."""
    raw = json.dumps({"prompt": "x" * (2 * LIMIT), "max_tokens": 4}).encode()
    if not chunked:
        return raw

    async def pieces():
        for i in range(0, len(raw), 1 << 16):
            yield raw[i:i + (1 << 16)]
    return pieces()


def test_over_size_bodies_get_their_413_while_streams_run(url, want):
    """Eight streams run while sixteen over-size bodies arrive at once, each on a connection of its own, half with
    a Content-Length and half chunked: every one is answered 413 (none reset), and the streams get their solo ids."""
    async def main():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
            async def big(chunked):
                try:
                    r = await http.post("/v1/completions", content=_over_size(chunked),
                                        headers={"Content-Type": "application/json"})
                except httpx.TransportError as e:
                    return f"{type(e).__name__} {e}"
                return r.status_code, r.json()["error"]["code"]

            events = [asyncio.Event() for _ in HOLDERS]
            streams = [asyncio.create_task(stream_ids(http, {"prompt": p, "max_tokens": 60, "temperature": 0,
                                                             "ignore_eos": True}, e))
                       for p, e in zip(HOLDERS, events)]
            await asyncio.gather(*(e.wait() for e in events))
            answers = await asyncio.gather(*(big(i % 2 == 1) for i in range(16)))
            return answers, await asyncio.gather(*streams)

    answers, ids = asyncio.run(main())
    assert answers == [(413, "request_too_large")] * 16, answers
    assert ids == want
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "\ntlaloc_kv_pages_in_use 0.0" in metrics


def _raw_answer(url: str, head: bytes, body: bytes = b"") -> bytes:
    """The status line a raw HTTP/1.1 client gets for `head` and (part of) a body, waiting at most 60 s."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head + body)
        return s.recv(4096).split(b"\r\n")[0]


def test_a_body_that_is_not_coming_is_not_waited_for(url, monkeypatch):
    """A client that sent `Expect: 100-continue` has sent none of its over-size body: it is answered 413 at once,
    not after the drain's time limit (set past the client's patience here). One that stops sending halfway is
    answered once that limit has passed."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n" % (2 * LIMIT))
    monkeypatch.setattr(server, "DRAIN_SECONDS", 600.0)
    assert _raw_answer(url, head + b"Expect: 100-continue\r\n\r\n") == b"HTTP/1.1 413 Request Entity Too Large"
    monkeypatch.setattr(server, "DRAIN_SECONDS", 0.5)
    assert _raw_answer(url, head + b"\r\n", b"{" * 1000) == b"HTTP/1.1 413 Request Entity Too Large"
