"""Issues 12 and 24, the request path: what a hostile-but-realistic client found, driven through create_app in this
process (tests/support/http_util.py). The oracle for generated ids is Engine.generate of the prompt alone."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import logging
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from http_util import CONTEXT, GOOD, STOP, InProcess, frozen_heap, health_gaps, serving, solo_runner
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.http import create_app
from tokenizers_util import build_tokenizer

TOK = build_tokenizer()
OTHER = [7, 7, 7, 1, 2, 3, 200, 100, 11, 13]
IDLE = {"running": 0, "waiting": 0, "kv_in_use": 0}


@pytest.fixture(scope="module")
def engine(http_engine):
    return http_engine


@pytest.fixture(scope="module")
def solo(engine):
    """Computed before any app starts its loop thread (the engine has one driver at a time)."""
    run = solo_runner(engine, STOP)
    for prompt, n in ((GOOD, 8), (GOOD, 30), (OTHER, 16)):
        run(prompt, n)
    return run


def _ids(r) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _error(r, status: int, code: str, message: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and re.search(message, err["message"]), err
    return err


def _good(srv, solo) -> None:
    """The pool is back to empty and a fixed prompt still gives its solo ids."""
    assert srv.wait_idle() == IDLE
    r = srv.post("/v1/completions", {"prompt": GOOD, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert _ids(r) == solo(GOOD, 8)


# -- finding 1: a negative seed --------------------------------------------------------------------

def test_a_negative_seed_is_a_400_and_leaks_no_pages(engine, solo):
    with InProcess(engine) as srv:
        # 6 pages promised per request: a dozen leaks would have filled the 64-page pool.
        for _ in range(12):
            r = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 40, "temperature": 1, "seed": -1})
            err = _error(r, 400, "invalid_value", r"Invalid value for 'seed': must be >= 0, got -1")
            assert err["param"] == "seed"
        _good(srv, solo)
        r = srv.post("/v1/completions", {"prompt": GOOD, "max_tokens": 4, "temperature": 1, "seed": 2**63})
        _error(r, 400, "invalid_value", r"'seed': must be <= 9223372036854775807")
        r = srv.post("/v1/completions", {"prompt": GOOD, "max_tokens": 4, "temperature": 1, "seed": 2**63 - 1,
                                         "n": 3})
        assert r.status_code == 200, r.text
        _good(srv, solo)


# -- finding 2: a tiny temperature -------------------------------------------------------------------

def test_a_tiny_temperature_is_served_beside_other_requests(engine, solo):
    async def main():
        async with serving(engine) as (client, _):
            greedy = client.post("/v1/completions", json={"prompt": GOOD, "max_tokens": 30, "temperature": 0,
                                                          "return_token_ids": True})
            tiny = client.post("/v1/completions", json={"prompt": OTHER, "max_tokens": 16, "temperature": 1e-308,
                                                        "seed": 4, "return_token_ids": True})
            return await asyncio.gather(greedy, tiny)

    greedy, tiny = asyncio.run(main())
    assert _ids(greedy) == solo(GOOD, 30)
    assert _ids(tiny) == solo(OTHER, 16)        # all the mass on the largest logit: the greedy ids


# -- finding 6: tokenizing on the event loop ------------------------------------------------------------

class _SlowTokenizer:
    """A tokenizers.Tokenizer that also encodes `busy` text on every call, as a slow tokenizer would: with the
    real library's locking (encode holds the GIL for the whole call, encode_batch releases it)."""

    def __init__(self, real, busy: str = ""):
        self.real, self.busy, self.calls = real, busy, 0

    def encode(self, *args, **kw):
        self.calls += 1
        if self.busy:
            self.real.encode(self.busy)
        return self.real.encode(*args, **kw)

    def encode_batch(self, inputs, *args, **kw):
        self.calls += len(inputs)
        if self.busy:
            self.real.encode_batch([self.busy])
        return self.real.encode_batch(inputs, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _busy_text(seconds: float) -> tuple[str, float]:
    """Text that takes at least `seconds` to encode here, and how long it took."""
    text = "the café 🌮 naïve words " * 2000
    while True:
        t0 = time.perf_counter()
        TOK.encode(text)
        took = time.perf_counter() - t0
        if took >= seconds:
            return text, took
        text *= 2


class _OnTheCallingThread(cf.Executor):
    """An executor that runs each job at once on the thread that submits it: the control's tokenizer pool, which
    puts tokenizing back on the event loop."""

    def submit(self, fn, *args, **kw):
        fut = cf.Future()
        fut.set_result(fn(*args, **kw))
        return fut


@pytest.mark.parametrize("on_loop", [False, True], ids=["", "control: tokenized on the event loop"])
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 2, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}),
])
def test_tokenizing_leaves_the_event_loop_free(engine, path, body, on_loop):
    """A request whose tokenizing takes ~0.4 s: /health, polled meanwhile on the same event loop, keeps answering.
    Control: with the tokenizing on the event loop, /health waits for all of it."""
    busy, took = _busy_text(0.4)

    async def main():
        async with serving(engine) as (client, server):
            server.tokenizer.tok = slow = _SlowTokenizer(server.tokenizer.tok, busy)
            if on_loop:
                server.prompt_tokenizer._pool = _OnTheCallingThread()
            request = asyncio.ensure_future(client.post(path, json=body))
            gaps = await health_gaps(client, request)
            return await request, gaps, slow.calls

    with frozen_heap():
        r, gaps, calls = asyncio.run(main())
    assert r.status_code == 200, r.text
    assert calls >= 1 and len(gaps) >= 1, "the request was never tokenized while /health was polled"
    if on_loop:
        assert max(gaps) >= took / 3, f"control: /health waited at most {max(gaps):.3f} s, tokenizing took {took:.3f} s"
    else:
        assert len(gaps) >= 2 and max(gaps) < took / 3, \
            f"/health waited {max(gaps):.3f} s while tokenizing took {took:.3f} s"


@pytest.mark.parametrize("body,code,message", [
    ({"prompt": ["a", "b"], "n": 33}, "invalid_value", r"Invalid value for 'n': prompts x n is 66, over the limit of 64"),
    ({"prompt": ["a"] * 65}, "invalid_value", r"Invalid value for 'n': prompts x n is 65, over the limit of 64"),
    ({"prompt": "z" * 100_000}, "context_length_exceeded",
     r"prompt of 100000 characters is longer than the largest context \(64 tokens of at most \d+ characters"),
])
def test_cheap_limits_are_checked_before_any_tokenizing(engine, solo, body, code, message):
    with InProcess(engine) as srv:
        srv.server.tokenizer.tok = counting = _SlowTokenizer(srv.server.tokenizer.tok)
        _error(srv.post("/v1/completions", body), 400, code, message)
        assert counting.calls == 0
        # A chat is measured as its template renders it, before that text is tokenized.
        r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * 100_000}]})
        _error(r, 400, "context_length_exceeded", r"the chat as its template renders it, 100\d{3} characters, is longer "
                                                  r"than the largest context \(64 tokens")
        assert counting.calls == 0
        # Control: a request within the limits is tokenized, by the same counter.
        _good(srv, solo)
        assert srv.post("/v1/completions", {"prompt": "a", "max_tokens": 1}).status_code == 200
        assert counting.calls == 1


def test_the_character_bound_never_refuses_a_text_that_fits():
    """max_prompt_chars per token is at least the characters per token of the densest texts (the longest
    vocabulary entries repeated), for the test tokenizer and the demo model's. Control: a tokenizer whose
    pre-tokenizer drops whitespace packs any number of characters into one token, and gets no bound."""
    from tokenizers import Tokenizer, pre_tokenizers

    from tlaloc_jax.serve.openai.prompts import max_prompt_chars
    from tlaloc_jax.tools.demo import DEMO_MODEL
    for tok in (TOK, Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))):
        per_token = max_prompt_chars(SimpleNamespace(tok=tok), 1)
        vocab = tok.get_vocab(with_added_tokens=True)
        densest = 0.0
        for piece in sorted(vocab, key=len, reverse=True)[:50]:
            text = tok.decode([vocab[piece]], skip_special_tokens=False) * 20
            densest = max(densest, len(text) / len(tok.encode(text, add_special_tokens=False).ids))
        assert 2 < densest <= per_token
    dropping = build_tokenizer()
    dropping.pre_tokenizer = pre_tokenizers.Whitespace()
    assert len(dropping.encode("a" + " " * 10_000, add_special_tokens=False).ids) == 1
    assert max_prompt_chars(SimpleNamespace(tok=dropping), CONTEXT) is None


# -- finding 7: requests that can never fit -------------------------------------------------------------

def test_choices_that_together_overfill_the_pool_are_queued_not_refused(engine, solo):
    """9 choices of 3 + 60 - 1 positions need 8 pages of 8 each, 72 together, and the pool holds 64: they run as
    room frees (the ninth waits, or a younger one is preempted and computed again), each with its solo ids."""
    want = engine.generate([[1, 2, 3]], 60)[0]           # no stop ids: what ignore_eos asks
    with InProcess(engine) as srv:
        r = srv.post("/v1/completions", {"prompt": [1, 2, 3], "n": 9, "max_tokens": 60, "temperature": 0,
                                         "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert [c["token_ids"] for c in r.json()["choices"]] == [want] * 9
        # Chat without max_tokens: each choice may run to the end of the context; all nine are served.
        r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 9})
        assert r.status_code == 200 and len(r.json()["choices"]) == 9
        assert srv.wait_idle() == IDLE
        _good(srv, solo)


# -- finding 8: bad client input answered 500 ------------------------------------------------------------

def _nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


CHAT = "/v1/chat/completions"
BAD_INPUT = {
    "array-1000-deep": ("/v1/completions", _nested(1000), "invalid_json", r"nested deeper than 64 levels"),
    "field-1000-deep": ("/v1/completions", b'{"prompt": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1001, "invalid_json",
                        r"nested deeper than 64 levels"),
    "field-65-deep": ("/v1/completions", b'{"prompt": ' + _nested(64) + b"}", "invalid_json",
                      r"nested deeper than 64 levels"),
    # Control for the limit: 64 levels are parsed, and the prompt's type is what is wrong.
    "field-64-deep": ("/v1/completions", b'{"prompt": ' + _nested(63) + b"}", "invalid_type",
                      r"Invalid type for 'prompt'"),
    "brackets-in-strings": ("/v1/completions", b'{"prompt": "' + b"[{" * 500 + b'", "max_tokens": "x"}',
                            "invalid_type", r"Invalid type for 'max_tokens'"),
    "int-past-float": ("/v1/completions", b'{"prompt": [1], "temperature": 1' + b"0" * 400 + b"}", "invalid_value",
                       r"Invalid value for 'temperature': must be in \[0.0, inf\]"),
    "surrogate-prompt": ("/v1/completions", b'{"prompt": "hi \\ud800 there", "max_tokens": 2}', "invalid_unicode",
                         r"'prompt' holds a lone surrogate"),
    "surrogate-prompt-list": ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "invalid_unicode",
                              r"'prompt\[1\]' holds a lone surrogate"),
    "surrogate-chat-content": (CHAT, b'{"messages": [{"role": "user", "content": "hi \\udc00"}]}', "invalid_unicode",
                               r"'messages\[0\]\.content' holds a lone surrogate"),
    "surrogate-chat-part": (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
                            "invalid_unicode", r"'messages\[0\]\.content\[0\]\.text' holds a lone surrogate"),
    "surrogate-role": (CHAT, b'{"messages": [{"role": "\\ud800", "content": "hi"}]}', "invalid_unicode",
                       r"'messages\[0\]\.role' holds a lone surrogate"),
    "surrogate-model": ("/v1/completions", b'{"prompt": [1], "model": "\\ud83d"}', "invalid_unicode",
                        r"'model' holds a lone surrogate"),
    "surrogate-field-name": ("/v1/completions", b'{"prompt": [1], "\\ud800x": 1}', "invalid_unicode",
                             r"a field name in the request body holds a lone surrogate"),
    "surrogate-nested-field-name": ("/v1/completions", b'{"prompt": [1], "stream_options": {"\\udc00": true}}',
                                    "invalid_unicode", r"a field name in 'stream_options' holds a lone surrogate"),
    "surrogate-stop": ("/v1/completions", b'{"prompt": [1], "stop": ["ok", "\\udfff"]}', "invalid_unicode",
                       r"'stop\[1\]' holds a lone surrogate"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_400_that_names_it_and_logs_no_traceback(engine, solo, caplog, case):
    path, body, code, message = BAD_INPUT[case]
    with InProcess(engine) as srv:
        with caplog.at_level(logging.WARNING):
            r = srv.post(path, body)
        _error(r, 400, code, message)
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info], caplog.text
        _good(srv, solo)


def test_a_surrogate_pair_is_one_character_and_is_served(engine):
    with InProcess(engine) as srv:
        r = srv.post("/v1/completions", b'{"prompt": "taco \\ud83c\\udf2e", "max_tokens": 2, "return_token_ids": true}')
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["prompt_token_ids"] == TOK.encode("taco 🌮").ids


def test_an_internal_error_is_a_500_without_its_text_logged_once(engine, solo, http_artifacts, caplog):
    with InProcess(engine) as srv:
        def broken(*args, **kw):
            raise RuntimeError(f"cannot read {http_artifacts[0]}/weights/0000_embed.bin")

        srv.server.plan = broken
        with caplog.at_level(logging.INFO):
            r = srv.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "internal_server_error" and re.search(r"internal error \(id [0-9a-f]{12}\)", err["message"])
        assert str(http_artifacts[0]) not in r.text and "embed" not in r.text
        logged = [rec for rec in caplog.records if rec.exc_info]
        assert len(logged) == 1 and "0000_embed.bin" in caplog.text
        assert re.search(r"id [0-9a-f]{12}", logged[0].getMessage())


# -- finding 10: paths, API keys, Host headers, browser origins -----------------------------------------

def test_no_response_names_a_path_on_disk(engine, http_artifacts):
    with InProcess(engine) as srv:
        models = srv.client.get("/v1/models").json()
        assert models["data"][0]["root"] == "ck" == models["data"][0]["id"]
        bodies = [srv.client.get(p).text for p in ("/v1/models", "/health", "/metrics", "/nowhere")]
        bodies += [srv.post("/v1/completions", b).text for b in (
            {"prompt": [1, 2], "max_tokens": 2}, {"prompt": [1, 2], "model": "x"}, {"prompt": [1, 999]}, b"{")]
        root = str(http_artifacts[0].parent)
        assert all(root not in b for b in bodies)


def test_an_empty_api_key_is_refused(engine, http_artifacts, serve_cache_dir):
    with pytest.raises(ValueError, match=r"api_key is empty"):
        create_app(engine, api_key="")
    with pytest.raises(ValueError, match=r"api_key has spaces around it"):
        create_app(engine, api_key=" sk-x")
    cmd = [sys.executable, "-m", "tlaloc_jax.serve", str(http_artifacts[0]), "--port", "0", "--cache-dir",
           str(serve_cache_dir)]
    env = {k: v for k, v in os.environ.items() if k != "TLALOC_API_KEY"}
    for args, extra_env, message in (
            (["--api-key", ""], {}, "error: --api-key is empty"),
            ([], {"TLALOC_API_KEY": ""}, "error: $TLALOC_API_KEY is empty")):
        r = subprocess.run(cmd + args, env={**env, **extra_env}, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and r.stderr.startswith(message), r.stderr[-2000:]


def test_a_host_allow_list_answers_421_to_other_hosts(engine):
    with InProcess(engine, allowed_hosts=["localhost", "127.0.0.1", "[::1]"]) as srv:
        for host in ("localhost", "LocalHost:8000", "127.0.0.1:1", "[::1]:8000", "[::1]"):
            assert srv.client.get("/health", headers={"host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io:80", "::1",
                     "[::2]:8000", ""):
            for r in (srv.client.get("/health", headers={"host": host}),
                      srv.client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1},
                                      headers={"host": host})):
                _error(r, 421, "invalid_host", r"is not a host this server answers for")
    # Control: without an allow-list every Host is answered.
    with InProcess(engine) as srv:
        assert srv.client.get("/health", headers={"host": "evil.example"}).status_code == 200


def test_allowed_origins_answer_cors_and_others_get_no_cors_headers(engine):
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    with InProcess(engine, allowed_origins=["https://app.example"]) as srv:
        r = srv.client.options("/v1/completions", headers={"origin": "https://app.example", **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = srv.client.options("/v1/completions", headers={"origin": "https://evil.example", **preflight})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = srv.client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1},
                            headers={"origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    # By default a browser page from any origin cannot read the answers.
    with InProcess(engine) as srv:
        r = srv.client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1},
                            headers={"origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_health_answers_503_once_the_engine_loop_stops(engine):
    """/health and the Ray Serve replica health check (serve/integrations/ray.py: `health_problem`) say the same: 200 while the
    engine loop runs, 503 naming why once it has stopped."""
    with InProcess(engine) as srv:
        assert srv.client.get("/health").status_code == 200
        assert srv.server.health_problem() is None
        srv.server.loop.stop()
        r = srv.client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "engine loop not running"
        assert srv.server.health_problem() == "engine loop not running"


# -- issue 24, findings 7 and 8: bounded lists, the same limits on every route -----------------------------------

def test_stop_token_ids_are_bounded(engine, solo):
    with InProcess(engine) as srv:
        r = srv.post("/v1/completions", {"prompt": GOOD, "max_tokens": 2, "stop_token_ids": [10**6] * 1025})
        err = _error(r, 400, "invalid_value", r"Invalid value for 'stop_token_ids': at most 1024 entries, got 1025")
        assert err["param"] == "stop_token_ids"
        r = srv.post("/v1/completions", {"prompt": GOOD, "max_tokens": 2, "stop_token_ids": [10**6] * 1024})
        assert r.status_code == 200, r.text            # control: at the bound
        _good(srv, solo)


def test_tokenize_checks_the_characters_whatever_add_special_tokens(engine, solo):
    with InProcess(engine) as srv:
        for add in (False, True, None):
            body = {"prompt": "z" * 100_000} if add is None else {"prompt": "z" * 100_000, "add_special_tokens": add}
            err = _error(srv.post("/tokenize", body), 400, "context_length_exceeded",
                         r"prompt of 100000 characters is longer than the largest context")
            assert err["param"] == "prompt"
            r = srv.post("/tokenize", {**body, "prompt": "z" * 10})
            assert r.status_code == 200 and r.json()["count"] == 10 + (add is not False), r.text
        _good(srv, solo)


# -- finding 11: add_special_tokens as vLLM defines it ----------------------------------------------------------------

def test_add_special_tokens_is_vllms(engine):
    """Completions and /tokenize's prompt add the tokenizer's special tokens (a BOS) unless told not to; chat and
    /tokenize's messages add none beyond what the template writes unless told to."""
    bos = TOK.token_to_id("<s>")
    bare = TOK.encode("the cat", add_special_tokens=False).ids
    with InProcess(engine) as srv:
        def completion(**kw):
            r = srv.post("/v1/completions", {"prompt": "the cat", "max_tokens": 1, "return_token_ids": True, **kw})
            return r.json()["choices"][0]["prompt_token_ids"]

        def chat(**kw):
            r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                  "return_token_ids": True, **kw})
            return r.json()["prompt_token_ids"]

        assert completion() == completion(add_special_tokens=True) == [bos] + bare
        assert completion(add_special_tokens=False) == bare
        templated = chat()
        assert templated[0] == bos and templated[1] != bos           # the template's own BOS, once
        assert chat(add_special_tokens=False) == templated and chat(add_special_tokens=True) == [bos] + templated
        tokenized = srv.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert tokenized == templated[:len(tokenized)]
        assert srv.post("/tokenize", {"prompt": "the cat", "add_special_tokens": False}).json()["tokens"] == bare


# -- finding 12: text_offset indexes the echoed text ------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_text_offset_indexes_the_text(engine, stream):
    """Echo with logprobs: each token's offset is where its text starts in the choice's text; the prompt's BOS (a
    special token, no text in the echo) takes no characters."""
    prompt = "the café in the park"
    with InProcess(engine) as srv:
        r = srv.post("/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 6,
                                         "temperature": 0, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(e[6:])["choices"][0] for e in r.text.split("\n\n") if e.startswith("data: {")]
            text = "".join(c["text"] for c in chunks)
            tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
            offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        else:
            ch = r.json()["choices"][0]
            text, tokens, offsets = ch["text"], ch["logprobs"]["tokens"], ch["logprobs"]["text_offset"]
    n = len(TOK.encode(prompt).ids)
    assert text.startswith(prompt) and tokens[0] == "<s>" and len(tokens) == n + 6
    assert offsets == sorted(offsets) and 0 <= offsets[0] and offsets[-1] <= len(text)
    ends = offsets[1:] + [len(text)]
    assert text[offsets[0]:ends[0]] == ""
    assert [text[a:b] for a, b in zip(offsets[1:n], ends[1:n])] == tokens[1:n]
    assert "".join(text[a:b] for a, b in zip(offsets, ends)) == text


# -- findings 14 and 16: what a new user meets ------------------------------------------------------------------

def test_cache_dir_none_the_load_docstring_and_the_help(http_artifacts, monkeypatch, tmp_path):
    """cache_dir "none" is no cache, as --cache-dir none is (the Device gets None, not a directory named none)."""
    monkeypatch.chdir(tmp_path)     # "elsewhere" is a relative cache directory: the load writes its digests there
    from tlaloc_jax.serve import engine as engine_module

    class Opened(Exception):
        pass

    def device(plugin, **kw):
        raise Opened(kw["cache_dir"])
    monkeypatch.setattr(engine_module, "Device", device)
    for given, want in (("none", None), ("None", None), (None, None), ("elsewhere", "elsewhere")):
        with pytest.raises(Opened) as opened:
            Engine.load(http_artifacts[0], cache_dir=given, progress=False)
        assert opened.value.args[0] == want, given
    monkeypatch.undo()
    assert "cache_dir" in Engine.load.__doc__ and '"none"' in Engine.load.__doc__
    out = subprocess.run([sys.executable, "-m", "tlaloc_jax.serve", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "tlaloc_jax.stage" in out and "tokenizer is optional" in " ".join(out.split())


def test_the_plugins_start_up_lines_go_to_the_log(http_artifacts, serve_cache_dir):
    """Not into a notebook's output: at DEBUG in the log (control: they are there, not lost)."""
    script = ("import logging, sys; from tlaloc_jax.serve import Engine\n"
              "logging.basicConfig(level=logging.DEBUG if sys.argv[1] == 'debug' else logging.WARNING)\n"
              f"Engine.load({str(http_artifacts[0])!r}, cache_dir={str(serve_cache_dir)!r}, progress=False).close()\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}     # jax set it here, not in a notebook
    quiet, debug = (subprocess.run([sys.executable, "-c", script, level], capture_output=True, text=True, timeout=120,
                                   env=env) for level in ("warning", "debug"))
    assert quiet.returncode == 0 and debug.returncode == 0, quiet.stderr[-2000:]
    assert "absl::InitializeLog" not in quiet.stderr and "cpu_device_count" not in quiet.stderr, quiet.stderr
    assert re.search(r"DEBUG:tlaloc_jax\.serve\.native:.*cpu_device_count set via create_options", debug.stderr), \
        debug.stderr[-3000:]
