"""Property-based fuzzing of the request path (hypothesis): any body sent to /v1/completions,
/v1/chat/completions or /tokenize is answered 2xx or 4xx, never 5xx; the answer names no path on disk; a probe
streaming beside it is never delayed by more than one step; afterwards no sequence runs, no page is held or
promised, and a fixed prompt still gives its solo ids.

A second server with tight queue limits (--max-num-seqs 1, --max-waiting 4, --max-wait-seconds) takes requests
drawn around `n` (prompts x n below, at and past --max-waiting) and `priority` (fcfs: only 0 is served): each is
answered 200 with all its choices, or 400 naming the limit or field it breaks, never 503 (nothing else waits).

Bodies: mostly JSON objects holding the real field names, each with a value that passes the schema (so
that many examples generate tokens) or a wild one (wrong types, huge, negative and float numbers, NaN,
text with lone surrogates, nested values); structured output (schemas, regexes, choices and Lark grammars:
good ones, ones that do not compile, ones past llguidance's limits, ones with no text, min_tokens they cannot
meet) and tools (good, not object schemas, forced, named, assistant calls in the history, malformed); unknown
fields; any JSON value at the top; raw bytes (deep nesting, broken UTF-8, truncated JSON). The server's template
defines tools. `make test` runs a bounded number of examples; `make test-slow` runs many more.

The probe: a streamed completion started before the fuzzed request, whose tokens the server records as it sends
them, with the engine loop's step count. While the fuzzed request is in flight, each probe token must go out
within one step of the step that made it (the probe runs in every step, so token k of the probe is made k steps
after its first): a request whose work stalls the event loop (a grammar compiled on it, a long tokenizing) holds
back tokens the engine keeps making. While the probe runs, each step lasts at least PROBE_STEP_S (as a larger
model's would): the tiny model's steps are about as short as the event loop's work for one chunk, and a step
count would measure that, not a stall.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from http_util import GOOD, STOP, TOOLS_TEMPLATE, InProcess
from tlaloc_jax import artifact as af
from tlaloc_jax.serve import Engine
from tlaloc_jax.serve.tokenizer import load_tokenizer
from tokenizers_util import IMAGE, VOCAB

IDLE = {"running": 0, "waiting": 0, "kv_in_use": 0}

# Every character, lone surrogates included (hypothesis leaves category Cs out unless told).
TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
CLEAN_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=16)
NUMBERS = (st.integers() | st.floats() | st.sampled_from([-1, 0, 1, 2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1,
                                                          10**30, 10**400, -10**400, 1e-308, 5e-324, 1e308, -0.0]))
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                        max_leaves=10)
TOKEN_IDS = st.lists(st.integers(-2, 300), max_size=10)


def _weighted(*options):
    """One of `options` ((weight, strategy) pairs), the first preferred when shrinking."""
    total = sum(w for w, _ in options)

    def pick(k):
        for w, strategy in options:
            if k < w:
                return strategy
            k -= w
    return st.integers(0, total - 1).flatmap(pick)


PART = st.fixed_dictionaries({"type": st.just("text"), "text": CLEAN_TEXT})
CALL = st.fixed_dictionaries({"function": st.fixed_dictionaries({
    "name": st.sampled_from(["f", "g"]), "arguments": st.sampled_from(['{"a": 1}', "{}", "x"])})},
    optional={"id": CLEAN_TEXT, "type": st.just("function")})
WILD_CALL = st.fixed_dictionaries({}, optional={"function": ANY_JSON, "type": ANY_JSON, "id": ANY_JSON}) | ANY_JSON
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": CLEAN_TEXT | st.lists(PART, min_size=1, max_size=2)},
                                optional={"name": CLEAN_TEXT, "tool_calls": st.lists(CALL | WILD_CALL, max_size=2)})

# Structured output: good specs, ones that do not compile, ones past llguidance's limits (a parser row of more than
# 2,000 items at the first token, items that explode), ones no text satisfies.
PATTERNED = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"}
                                              for i in range(1000)}}
SCHEMAS = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 5}, {"enum": ["a", "b", 3]},
                           {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                           {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, PATTERNED,
                           {"type": "array", "items": {"type": "boolean"}, "minItems": 2}, {"type": "nope"}])
REGEXES = st.sampled_from(["[0-9]{3}", "(a|b)*c", "([", "x{2,3}", ".*", "", "[ab]*a[ab]{12}"]) | CLEAN_TEXT
LARK = st.sampled_from(['start: "x" | "y"', 'start: "a" start', 'start: a\na: a "x"', 'start: foo',
                        'start: ("p" | "q") ("r" | "s") a\na: "a" a', 'start: /[a-z]+/ "!"']) | CLEAN_TEXT
CHOICES = st.lists(CLEAN_TEXT.filter(bool), min_size=1, max_size=4) | st.just([f"opt{i}" for i in range(2500)])
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"])},
    optional={"parameters": st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}},
                                             {}, {"type": "string"}, {"properties": {"b": {"const": "</tool_call>"}}}]),
              "description": CLEAN_TEXT})})
STOP_ITEM = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=3) | st.integers(0, 300)

# The fields either endpoint reads (OpenAI's and vLLM's names): values that pass the schema (the engine may
# still refuse them: a placeholder id, a prompt past the context, more pages than the pool), and wild ones.
VALID = {
    "model": st.just("ck"),
    "prompt": (CLEAN_TEXT | st.lists(st.integers(0, VOCAB - 1), max_size=10)
               | st.lists(CLEAN_TEXT, min_size=1, max_size=3)
               | st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_size=1, max_size=3)),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_tokens": st.integers(1, 8) | st.integers(1, 70),
    "max_completion_tokens": st.integers(1, 8),
    "temperature": st.sampled_from([0, 0.5, 1.0, 2.0, 1e-308, 5e-324, 1e308]) | st.floats(0.0, 5.0),
    "top_p": st.floats(1e-9, 1.0) | st.just(1.0),
    "top_k": st.integers(-1, 400),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=3) | st.lists(STOP_ITEM, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
    "n": st.integers(1, 3) | st.integers(1, 64),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "return_token_ids": st.booleans(),
    "ignore_eos": st.booleans(),
    "user": CLEAN_TEXT,
    "presence_penalty": st.sampled_from([0, 0.0]),
    "frequency_penalty": st.sampled_from([0, 0.0]),
    "logit_bias": st.just({}),
    "echo": st.just(False),
    "suffix": st.just(""),
    "logprobs": st.sampled_from([0, False]),
    "best_of": st.just(1),
    "top_logprobs": st.just(0),
    "add_generation_prompt": st.booleans(),
    "tools": st.lists(TOOL, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}},
                                    {"type": "function", "function": {"name": "h"}}]),
    "parallel_tool_calls": st.booleans(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | SCHEMAS.map(
        lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
    "guided_json": SCHEMAS,
    "guided_regex": REGEXES,
    "guided_choice": CHOICES,
    "guided_grammar": LARK,
    "structured_outputs": st.one_of(SCHEMAS.map(lambda s: {"json": s}), REGEXES.map(lambda r: {"regex": r}),
                                    CHOICES.map(lambda c: {"choice": c}), LARK.map(lambda g: {"grammar": g}),
                                    st.just({"json_object": True})),
    "min_tokens": st.integers(0, 12),
    "add_special_tokens": st.booleans(),
    "return_token_strs": st.booleans(),
    "priority": st.integers(-3, 3) | st.sampled_from([-2**63, 2**63 - 1]),
    "return_tokens_as_token_ids": st.booleans(),
}
WILD_PROMPT = TEXT | TOKEN_IDS | st.lists(TEXT, max_size=3) | st.lists(TOKEN_IDS, max_size=3)
WILD_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["robot", "user"]) | TEXT},
                                     optional={"content": TEXT | st.lists(ANY_JSON, max_size=2) | ANY_JSON,
                                               "name": TEXT | ANY_JSON})
WILD = {name: ANY_JSON | NUMBERS | TEXT for name in VALID}
WILD.update(prompt=WILD_PROMPT | ANY_JSON, messages=st.lists(WILD_MESSAGE, max_size=3) | ANY_JSON,
            stop=st.lists(TEXT | st.integers(-2, 300), max_size=3) | ANY_JSON, stop_token_ids=TOKEN_IDS | ANY_JSON)


COMMON = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream",
          "stream_options", "return_token_ids", "ignore_eos", "user", "presence_penalty", "frequency_penalty",
          "logit_bias", "logprobs", "response_format", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "structured_outputs", "min_tokens", "add_special_tokens", "priority",
          "return_tokens_as_token_ids"]
OWN_FIELDS = {"prompt": COMMON + ["echo", "suffix", "best_of"],
              "messages": COMMON + ["max_completion_tokens", "top_logprobs", "add_generation_prompt", "tools",
                                    "tool_choice", "parallel_tool_calls"],
              "tokenize": ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                           "return_token_strs", "tools"]}


@st.composite
def _request(draw, required: str) -> dict:
    """The endpoint's required field (mostly) and a few of its others, each valid or (one time in six) wild;
    now and then a field it does not know (another endpoint's, or any name)."""
    # The rare branches sit at the top of their ranges: hypothesis draws small integers more often than others.
    body = {}
    if required != "tokenize" and draw(st.integers(0, 19)) != 19:
        body[required] = draw(_weighted((5, VALID[required]), (1, WILD[required])))
    for name in draw(st.lists(st.sampled_from(OWN_FIELDS[required]), max_size=4, unique=True)):
        value = draw(_weighted((5, VALID[name]), (1, WILD[name])))
        if name == "prompt" and required == "tokenize" and isinstance(value, list):
            value = draw(CLEAN_TEXT)        # /tokenize's prompt is text
        body[name] = value
    if draw(st.integers(0, 9)) == 9:
        others = sorted(set(VALID) - set(OWN_FIELDS[required]) - {required})
        body.update(draw(st.dictionaries(st.sampled_from(others) | TEXT, ANY_JSON, min_size=1, max_size=2)))
    return body


def _deep(depth: int, kind: str) -> bytes:
    opening, closing = {"array": (b"[", b"]"), "object": (b'{"a":', b"}")}[kind]
    return b'{"prompt":' + opening * depth + b"1" + closing * depth + b"}"


RAW = (st.binary(max_size=64)
       | st.builds(_deep, st.integers(1, 3000), st.sampled_from(["array", "object"]))
       | st.builds(lambda body, cut: json.dumps(body).encode()[:cut], _request("prompt"), st.integers(0, 80)))


def _body(required: str):
    """bytes to send: mostly a request object (json.dumps writes a lone surrogate as its \\u escape), some
    other JSON value, or raw bytes."""
    return _weighted((18, _request(required).map(lambda b: json.dumps(b).encode())),
                     (1, ANY_JSON.map(lambda b: json.dumps(b).encode())),
                     (1, RAW))


ENDPOINTS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/tokenize": "tokenize"}
PROBE = {"prompt": GOOD, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True, "user": "probe",
         "return_token_ids": True}
PROBE_STEP_S = 0.01


class Probe:
    """Records, as the server sends them, the probe's chunks that carry tokens: (the engine loop's step count then,
    the tokens). While it streams, each engine step lasts at least PROBE_STEP_S."""

    def __init__(self, server):
        self.server, self.sent, self.first, self.running = server, [], threading.Event(), False
        original, step = server.responses.stream, server.engine.step

        async def stream(gen, req, rid, chat):
            probe = req.user == "probe"
            self.running |= probe
            try:
                async for chunk in original(gen, req, rid, chat):
                    if probe and chunk.startswith("data: {"):
                        tokens = sum(len(c.get("token_ids") or ()) for c in json.loads(chunk[6:])["choices"])
                        if tokens:
                            self.sent.append((server.loop.steps, tokens))
                            self.first.set()
                    yield chunk
            finally:
                self.running &= not probe

        def slow_step(**kw):
            t0 = time.perf_counter()
            events = step(**kw)
            if self.running:
                time.sleep(max(0.0, PROBE_STEP_S - (time.perf_counter() - t0)))
            return events
        server.responses.stream, server.engine.step = stream, slow_step

    def delays(self, since: int, until: int) -> list[int]:
        """Per probe token sent between the chunks `since` and `until`: how many steps after the one that made it it
        went out (token k of the probe is made k steps after the first)."""
        first_step = self.sent[0][0]
        out, k = [], 0
        for i, (step, tokens) in enumerate(self.sent):
            if since <= i < until:
                out.append(step - (first_step + k))
            k += tokens
        return out


@pytest.fixture(scope="module")
def served(http_artifacts, serve_cache_dir):
    """(in-process server, the fixed prompt's solo ids, the artifact's folder, the probe). The tokenizer's template
    defines tools; requests are scheduled by priority."""
    tokenizer = load_tokenizer(http_artifacts[0], af.load_manifest(http_artifacts[0]))
    tokenizer.chat_template = TOOLS_TEMPLATE
    with Engine.load(http_artifacts[0], cache_dir=serve_cache_dir, progress=False) as engine:
        want = engine.generate([GOOD], 8, stop_token_ids=STOP)[0]
        with InProcess(engine, tokenizer=tokenizer, scheduling_policy="priority") as srv:
            yield srv, want, str(http_artifacts[0].parent), Probe(srv.server)
            del engine.step            # the Engine's own step again


def _check(served, path: str, body: bytes) -> None:
    srv, want, root, probe = served
    probe.sent.clear()
    probe.first.clear()
    answers = []
    beside = threading.Thread(target=lambda: answers.append(srv.post("/v1/completions", PROBE)))
    beside.start()
    assert probe.first.wait(60), "the probe never streamed"
    since = len(probe.sent)
    r = srv.post(path, body, headers={"Content-Type": "application/json"})
    until = len(probe.sent)
    beside.join(60)
    assert 200 <= r.status_code < 500, (r.status_code, r.text[:2000])
    assert answers and answers[0].text.endswith("data: [DONE]\n\n") and "error" not in answers[0].text
    delays = probe.delays(since, until)
    event(f"probe delayed by at most {max(delays, default=0)} steps")
    assert max(delays, default=0) <= 1, f"probe tokens went out {delays} steps late beside this request"
    assert root not in r.text
    err = r.json()["error"] if r.status_code >= 400 else None
    # --hypothesis-show-statistics shows how many examples got how far: generated, or refused by which check.
    event(f"{r.status_code} {err['code']} ({err['param']})" if err else f"{r.status_code} generated")
    if err is not None:
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and "internal_server_error" not in r.text, r.text[-2000:]
    state = srv.wait_idle()
    assert state == IDLE, state
    r = srv.post(path="/v1/completions", body={"prompt": GOOD, "max_tokens": 8, "temperature": 0,
                                               "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text


FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BODIES = {path: _body(required) for path, required in ENDPOINTS.items()}


@pytest.mark.parametrize("path", list(ENDPOINTS))
@settings(max_examples=60, **FUZZ)
@given(data=st.data())
def test_any_body_is_answered_2xx_or_4xx_and_leaves_the_pool_empty(served, path, data):
    _check(served, path, data.draw(BODIES[path], label="body"))


@pytest.mark.slow
@pytest.mark.parametrize("path", list(ENDPOINTS))
@settings(max_examples=2000, **FUZZ)
@given(data=st.data())
def test_any_body_is_answered_2xx_or_4xx_and_leaves_the_pool_empty_long(served, path, data):
    _check(served, path, data.draw(BODIES[path], label="body"))


# cache_salt (issue 55): a non-empty string, anything else refused naming it; null is the same as leaving it out.
SALTS = _weighted((4, CLEAN_TEXT.filter(bool)), (1, st.just("")), (1, TEXT), (1, ANY_JSON))
PLAIN = {"/v1/completions": {"prompt": GOOD, "max_tokens": 2}, "/v1/chat/completions": {
    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


def _strict_json(value) -> bool:
    """Whether json.dumps writes `value` as JSON (no NaN or infinities)."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def _good_salt(salt) -> bool:
    """null, or a non-empty string of Unicode characters (a lone surrogate is none: the body is refused)."""
    return salt is None or isinstance(salt, str) and salt != "" and not any("\ud800" <= c <= "\udfff" for c in salt)


@pytest.mark.parametrize("path", list(PLAIN))
@settings(max_examples=30, **FUZZ)
@given(data=st.data())
def test_any_cache_salt_is_served_or_refused_by_name(served, path, data):
    """A fuzzed body with a cache_salt passes the checks above; the salt beside a plain body is served (200) when it
    is a non-empty string (or null), else refused 400 naming cache_salt."""
    salt = data.draw(SALTS, label="cache_salt")
    body = dict(data.draw(_request(ENDPOINTS[path]), label="body"), cache_salt=salt)
    _check(served, path, json.dumps(body).encode())
    r = served[0].post(path, json.dumps(dict(PLAIN[path], cache_salt=salt)).encode(),
                       headers={"Content-Type": "application/json"})
    if not _strict_json(salt):
        # NaN or an infinity somewhere in it: json.dumps writes NaN/Infinity, which is not JSON (RFC 8259)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    elif _good_salt(salt):
        assert r.status_code == 200, r.text
    else:
        # A lone surrogate deep inside a wrong-typed salt is refused by where it sits: cache_salt[0], ...
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("cache_salt"), r.text
    assert served[0].wait_idle() == IDLE


# -- n and priority against the queue limits -------------------------------------------------------

MAX_WAITING = 2
PRIORITIES = _weighted((4, st.just(0)), (1, st.none()), (1, st.integers(-2**63, 2**63 - 1)),
                       (1, st.sampled_from([2**63, -2**63 - 1, 1.0, -1e30, True, "high", [0]])))


@st.composite
def _limited_request(draw, chat: bool) -> dict:
    if chat:
        # At most 6 characters (24 bytes, a byte-level token each) beside the chat template's tokens: with 12 new
        # tokens well inside the 64-token context (16 four-byte characters did not fit).
        body = {"messages": [{"role": "user",
                              "content": draw(st.text(st.characters(exclude_categories=("Cs",)), max_size=6))}]}
    else:
        # Ids the server serves (the placeholder id is refused: the main fuzz test covers that), prompts well inside
        # the context: a 400 here can only be the queue limits' or priority's.
        ids = st.integers(0, VOCAB - 1).filter(lambda t: t != IMAGE)
        body = {"prompt": draw(st.lists(st.lists(ids, min_size=1, max_size=6), min_size=1, max_size=3)
                               | st.lists(ids, min_size=1, max_size=20))}
    body.update(max_tokens=draw(st.integers(1, 12)), ignore_eos=True, stream=draw(st.booleans()),
                return_token_ids=True)
    if (n := draw(st.none() | st.integers(1, 6))) is not None:
        body["n"] = n
    if (priority := draw(PRIORITIES)) is not None or draw(st.booleans()):
        body["priority"] = priority
    return body


@pytest.fixture(scope="module")
def limited(http_artifacts, serve_cache_dir):
    """An in-process server with --max-num-seqs 1, --max-waiting MAX_WAITING and a wait limit a few steps long
    (each step lasts at least PROBE_STEP_S): a request whose own choices timed out behind each other would fail."""
    with Engine.load(http_artifacts[0], cache_dir=serve_cache_dir, progress=False) as engine:
        step = engine.step

        def slow_step(**kw):
            t0 = time.perf_counter()
            events = step(**kw)
            time.sleep(max(0.0, PROBE_STEP_S - (time.perf_counter() - t0)))
            return events
        engine.step = slow_step
        with InProcess(engine, max_batch=1, max_waiting=MAX_WAITING, max_wait_seconds=3 * PROBE_STEP_S) as srv:
            yield srv
        del engine.step


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@settings(max_examples=40, **FUZZ)
@given(data=st.data())
def test_n_and_priority_against_the_queue_limits(limited, path, data):
    body = data.draw(_limited_request(path.endswith("chat/completions")), label="body")
    prompts = 1 if "messages" in body or not isinstance(body["prompt"][0], list) else len(body["prompt"])
    sequences = prompts * body.get("n", 1)
    priority = body.get("priority")
    bad_priority = priority is not None and (type(priority) is not int or priority != 0)
    r = limited.post(path, body)
    if r.status_code == 400:
        err = r.json()["error"]
        event(f"400 ({err['param']})")
        if err["param"] == "priority":
            assert bad_priority and re.search(r"'priority'", err["message"]), err
        else:
            assert sequences > MAX_WAITING and err["param"] in ("n", "prompt"), err
            assert f"--max-waiting is {MAX_WAITING}" in err["message"], err
    else:
        assert r.status_code == 200 and not bad_priority and sequences <= MAX_WAITING, r.text[-2000:]
        event(f"200, {sequences} sequences")
        if body["stream"]:
            assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text[-2000:]
            chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            got = {}
            for chunk in chunks:
                for c in chunk["choices"]:
                    got[c["index"]] = got.get(c["index"], 0) + len(c.get("token_ids") or ())
        else:
            got = {c["index"]: len(c["token_ids"]) for c in r.json()["choices"]}
        assert got == {i: body["max_tokens"] for i in range(sequences)}, got
    assert limited.wait_idle() == IDLE
