"""Issue 55, the scheduler's limits over HTTP: `n` against --max-waiting and --max-wait-seconds, `priority` with
--scheduling-policy, and return_tokens_as_token_ids, driven through create_app in this process (tests/support/http_util.py).
The oracle for generated ids is Engine.generate of the prompt alone."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from types import SimpleNamespace

import pytest

from http_util import STOP, InProcess, serving, solo_runner
from tlaloc_jax.serve.loop import EngineLoop

PROMPT = [10, 20, 30, 40]


@pytest.fixture(scope="module")
def solo(http_engine):
    """Worked out before any app starts its loop thread (the engine has one driver at a time)."""
    run = solo_runner(http_engine, STOP)
    run(PROMPT, 40)
    return run


def _error(r, status: int, param: str, message: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(message, err["message"]), err
    assert err["type"] == "invalid_request_error", err
    return err


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# -- finding 1: n past --max-waiting ---------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_past_max_waiting_is_a_400_naming_n_and_the_limit(http_engine, solo, path):
    """An idle server with --max-waiting 2 and a request for 3 sequences: it could never be admitted, so 400 (not
    503 + Retry-After, which a client would retry forever); the limit's own size still runs."""
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    with InProcess(http_engine, max_waiting=2) as srv:
        r = srv.post(path, dict(body, max_tokens=4, temperature=0, n=3))
        err = _error(r, 400, "n", r"3 sequences.*--max-waiting is 2.*could never be admitted")
        assert "retry-after" not in r.headers and err["code"] == "invalid_value"
        r = srv.post(path, dict(body, max_tokens=4, temperature=0, n=2))
        assert r.status_code == 200, r.text
        if path == "/v1/completions":       # prompts x n: three prompts of one choice each are three sequences
            r = srv.post(path, {"prompt": [PROMPT] * 3, "max_tokens": 4})
            _error(r, 400, "prompt", r"3 sequences.*--max-waiting is 2")
        assert srv.wait_idle() == {"running": 0, "waiting": 0, "kv_in_use": 0}


def test_a_queue_full_now_is_still_a_503_with_retry_after(http_engine, solo):
    """--max-waiting 1, --max-num-seqs 1: one request runs; a second, then a third, arrive together: the second
    waits, the third (which would fit an emptier queue) gets 503 queue_full with Retry-After, and the other two keep
    their solo ids."""
    async def attempt():
        async with serving(http_engine, max_batch=1, max_waiting=1) as (http, server):
            running = await _one_running(server.loop, http.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "return_token_ids": True}))
            later = await _arrive_together(server.loop, [
                lambda: http.post("/v1/completions", json={
                    "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "return_token_ids": True}),
                lambda: http.post("/v1/completions", json={"prompt": [8, 9], "max_tokens": 4})])
            return await asyncio.gather(running, *later)

    first, waiting, third = asyncio.run(attempt())
    assert third.status_code == 503 and third.headers["retry-after"] == "1", third.text
    err = third.json()["error"]
    assert err["code"] == "queue_full" and re.search(r"1 sequences wait to run .*--max-waiting is 1", err["message"])
    assert first.status_code == 200 and first.json()["choices"][0]["token_ids"] == solo(PROMPT, 40)
    assert waiting.status_code == 200 and waiting.json()["choices"][0]["token_ids"] == solo([5, 6, 7], 4)


async def _one_running(loop: EngineLoop, post) -> asyncio.Task:
    """`post` (a coroutine) sent, once its sequence runs in the engine."""
    task = asyncio.create_task(post)
    while not await asyncio.wrap_future(loop.call(lambda lp: len(lp.engine.scheduler.running))):
        await asyncio.sleep(0.001)
    return task


def _count_submits(loop: EngineLoop) -> list:
    """The requests handed to the loop so far (one item each), recorded as they are submitted."""
    submitted, original = [], loop.submit

    def submit(*args, **kw):
        submitted.append(args[0])
        return original(*args, **kw)
    loop.submit = submit
    return submitted


async def _arrive_together(loop: EngineLoop, posts) -> list[asyncio.Task]:
    """Send each of `posts` (a coroutine each) in turn, while the engine loop is held between two steps, each once
    the one before it reached the loop: the loop then admits them in that order before its next step."""
    submitted = _count_submits(loop)
    release = threading.Event()
    held = loop.call(lambda lp: release.wait(30))
    tasks = []
    try:
        for post in posts:
            before = len(submitted)
            tasks.append(asyncio.create_task(post()))
            while len(submitted) == before:
                await asyncio.sleep(0.001)
    finally:
        release.set()
    await asyncio.wrap_future(held)
    del loop.submit
    return tasks


# -- finding 2: a request's own choices and --max-wait-seconds -------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_requests_own_choices_do_not_time_out_behind_each_other(http_engine, solo, stream):
    """--max-num-seqs 1 --max-wait-seconds: a request with n=2 runs its choices one after another; choice 1 waiting
    behind choice 0 of the same request is not a queue timeout (it was: 503 queue_timeout, or choice 0's tokens
    then an error event)."""
    async def attempt():
        async with serving(http_engine, max_batch=1, max_wait_seconds=0.001) as (http, _):
            return await http.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "n": 2, "ignore_eos": True,
                "return_token_ids": True, "stream": stream})

    r = asyncio.run(attempt())
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text[-2000:]
        ids = {0: [], 1: []}
        for chunk in _sse(r.text):
            for c in chunk["choices"]:
                ids[c["index"]] += c.get("token_ids") or []
        got = [ids[0], ids[1]]
    else:
        got = [c["token_ids"] for c in r.json()["choices"]]
    want = engine_ids = solo(PROMPT, 40)
    assert len(engine_ids) == 40 and got == [want, want]


def test_another_request_still_times_out_behind_a_running_one(http_engine, solo):
    """The wait limit still holds between requests: a request whose sequences all wait past --max-wait-seconds behind
    another request's gets 503 queue_timeout, and the running one keeps its ids."""
    async def attempt():
        async with serving(http_engine, max_batch=1, max_wait_seconds=0.001) as (http, server):
            running = await _one_running(server.loop, http.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "return_token_ids": True}))
            second, = await _arrive_together(server.loop, [
                lambda: http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "n": 2})])
            return await asyncio.gather(running, second)

    first, second = asyncio.run(attempt())
    assert first.status_code == 200 and first.json()["choices"][0]["token_ids"] == solo(PROMPT, 40)
    assert second.status_code == 503 and second.json()["error"]["code"] == "queue_timeout", second.text


# -- finding 3: priority ---------------------------------------------------------------------------

@pytest.mark.parametrize("value,message", [
    ("high", r"Invalid type for 'priority': expected an integer, but got a string"),
    (-1e30, r"Invalid type for 'priority': expected an integer, but got a number"),
    (1.0, r"Invalid type for 'priority': expected an integer, but got a number"),
    (True, r"Invalid type for 'priority': expected an integer, but got a boolean"),
    (2**63, r"Invalid value for 'priority': must be <= 9223372036854775807"),
    (-2**63 - 1, r"Invalid value for 'priority': must be >= -9223372036854775808")])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_priority_is_a_400_naming_it(http_engine, path, value, message):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    with InProcess(http_engine, scheduling_policy="priority") as srv:
        _error(srv.post(path, dict(body, max_tokens=2, priority=value)), 400, "priority", message)
        r = srv.post(path, dict(body, max_tokens=2, priority=-2**63))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fcfs_refuses_a_non_zero_priority_by_the_flag(http_engine, path):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    with InProcess(http_engine) as srv:
        _error(srv.post(path, dict(body, max_tokens=2, priority=-1)), 400, "priority",
               r"--scheduling-policy fcfs.*--scheduling-policy priority")
        for ok in (0, None):
            assert srv.post(path, dict(body, max_tokens=2, priority=ok)).status_code == 200


def _first_token_order(http_engine, policy: str, priorities: dict, drop_priority: bool = False) -> list[str]:
    """--max-num-seqs 1: request A runs; B then C arrive while the loop is held, so both wait together; -> the
    requests in the order their first token was made."""
    prompts = {"A": PROMPT, "B": [5, 6, 7], "C": [8, 9, 10]}
    order: list[str] = []

    async def attempt():
        async with serving(http_engine, max_batch=1, scheduling_policy=policy) as (http, server):
            loop = server.loop
            names = {tuple(p): k for k, p in prompts.items()}
            send = loop._send

            def record(events):
                for ev in events:
                    req = loop.engine.scheduler.requests.get(ev.request_id)
                    name = names.get(tuple(req.prompt)) if req is not None else None
                    if name is not None and name not in order:
                        order.append(name)
                send(events)
            loop._send = record

            def body(name):
                return {"prompt": prompts[name], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                        **({"priority": priorities[name]} if name in priorities else {})}
            a = asyncio.create_task(http.post("/v1/completions", json=dict(body("A"), max_tokens=20)))
            while not order:
                await asyncio.sleep(0.001)
            b, c = await _arrive_together(loop, [
                lambda: http.post("/v1/completions", json=body("B")),
                lambda: http.post("/v1/completions", json=body("C"))])
            for r in await asyncio.gather(a, b, c):
                assert r.status_code == 200, r.text

    if drop_priority:       # the bug: the field is read but never reaches the engine
        add = http_engine.add_request
        http_engine.add_request = lambda *a, priority=0, **kw: add(*a, **kw)
    try:
        asyncio.run(attempt())
    finally:
        if drop_priority:
            del http_engine.add_request
    return order


def test_priority_is_honoured_over_http(http_engine):
    """A later request of higher priority (lower number) starts before an earlier one of lower priority; control:
    the same requests in first come, first served order, and with the priority dropped on its way to the engine."""
    assert _first_token_order(http_engine, "priority", {"B": 10, "C": -5}) == ["A", "C", "B"]
    assert _first_token_order(http_engine, "priority", {"B": 10, "C": 20}) == ["A", "B", "C"]
    assert _first_token_order(http_engine, "fcfs", {}) == ["A", "B", "C"]
    assert _first_token_order(http_engine, "priority", {"B": 10, "C": -5}, drop_priority=True) == ["A", "B", "C"]


# -- also: return_tokens_as_token_ids --------------------------------------------------------------

def _logprob_tokens(body: dict, chat: bool) -> tuple[list[str], list[str]]:
    """(each logprob entry's token, the tokens of its top_logprobs) of a response body or chunk."""
    tokens, tops = [], []
    for c in body["choices"]:
        lp = c.get("logprobs")
        if not lp:
            continue
        if chat:
            for e in lp["content"]:
                tokens.append(e["token"])
                tops += [t["token"] for t in e["top_logprobs"]]
                assert all(x["bytes"] == list(x["token"].encode()) for x in [e, *e["top_logprobs"]]), e
        else:
            tokens += lp["tokens"]
            tops += [t for top in lp["top_logprobs"] for t in top or ()]
    return tokens, tops


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_tokens_as_token_ids_gives_token_id_strings(http_engine, path, stream):
    """vLLM's request field and server flag: each logprob token (an echoed prompt's too) as "token_id:N", streamed
    or not; without either, the tokens' text."""
    chat = path == "/v1/chat/completions"
    base = ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2} if chat
            else {"prompt": PROMPT, "logprobs": 2, "echo": True})
    base.update(max_tokens=5, temperature=0, return_token_ids=True, stream=stream)

    def answer(srv, **kw) -> tuple[list[str], list[str], list[int]]:
        """(logprob tokens, their top tokens, the generated ids)."""
        r = srv.post(path, dict(base, **kw))
        assert r.status_code == 200, r.text
        chunks = _sse(r.text) if stream else [r.json()]
        tokens, tops = [], []
        for ch in chunks:
            a, b = _logprob_tokens(ch, chat)
            tokens, tops = tokens + a, tops + b
        return tokens, tops, [t for ch in chunks for c in ch["choices"] for t in c.get("token_ids") or ()]

    with InProcess(http_engine) as srv:
        as_text = answer(srv)
        as_ids = answer(srv, return_tokens_as_token_ids=True)
    ids = as_text[2]
    assert as_ids[2] == ids and len(ids) == 5
    assert as_ids[0] == [f"token_id:{t}" for t in ([] if chat else PROMPT) + ids], as_ids[0]
    assert as_ids[1] and all(re.fullmatch(r"token_id:\d+", t) for t in as_ids[1]), as_ids[1]
    assert not any(t.startswith("token_id:") for t in as_text[0] + as_text[1]), as_text
    with InProcess(http_engine, return_tokens_as_token_ids=True) as srv:
        assert answer(srv) == as_ids
        assert answer(srv, return_tokens_as_token_ids=False) == as_text


def test_the_command_line_flags_reach_the_app(http_artifacts, monkeypatch):
    """`python -m tlaloc_jax.serve --scheduling-policy priority --return-tokens-as-token-ids` hands both to
    create_app; by default fcfs and text tokens, as vLLM's server."""
    from tlaloc_jax.serve import engine as engine_module
    from tlaloc_jax.serve import http
    from tlaloc_jax.serve.__main__ import main

    class Built(Exception):
        pass
    seen = []

    def create_app(engine, **kw):
        seen.append(kw)
        raise Built
    monkeypatch.setattr(http, "create_app", create_app)
    monkeypatch.setattr(engine_module.Engine, "load", classmethod(lambda cls, *a, **k: SimpleNamespace(close=list)))
    base = [str(http_artifacts[0]), "--port", "0", "--cache-dir", "none"]
    for extra in (["--scheduling-policy", "priority", "--return-tokens-as-token-ids"], []):
        with pytest.raises(Built):
            main(base + extra)
    assert [(kw["scheduling_policy"], kw["return_tokens_as_token_ids"]) for kw in seen] == \
        [("priority", True), ("fcfs", False)]
