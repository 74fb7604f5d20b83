"""Issue 24, structured output and tools: what a hostile-but-realistic client found, driven through create_app in
this process. The artifact: tests/support/http_util.py's checkpoint with the sampler staged, one context of 128 positions
(room for a forced tool call) and a compact chat template that defines tools in the Hermes format. The oracle for
generated ids is Engine.generate of the prompt alone."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import pytest

from http_util import GOOD, STOP, TOOLS_TEMPLATE, InProcess, frozen_heap, health_gaps, serving
from tlaloc_jax.serve import Engine
from tokenizers_util import EOS, VOCAB, write_tokenizer

CONTEXT = 128
HI = [{"role": "user", "content": "hi"}]
IDLE = {"running": 0, "waiting": 0, "kv_in_use": 0}


def patterned(count: int) -> dict:
    """An object schema of `count` optional string properties, each with a pattern (finding 1's schema)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"}
                                             for i in range(count)}}


@pytest.fixture(scope="module")
def artifact(http_artifacts, tmp_path_factory):
    from tlaloc_jax.export import Sampler, export_checkpoint
    root = tmp_path_factory.mktemp("structured")
    ck = root / "ck"
    ck.mkdir()
    for f in (http_artifacts[0].parent / "ck").iterdir():
        (ck / f.name).write_bytes(f.read_bytes())
    write_tokenizer(ck)
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    (ck / "tokenizer_config.json").write_text(json.dumps(cfg))
    export_checkpoint(ck, root / "artifact", batch_ladder=(1, 4), context_ladder=(CONTEXT,), block_size=8,
                      prefill_chunk=32, prefill_long_chunk=0, prefill_max_batch=1, num_blocks=64, progress=False,
                      sampler=Sampler())
    return root / "artifact"


@pytest.fixture(scope="module")
def engine(artifact, serve_cache_dir):
    """The Engine the tests start servers of their own on, one at a time."""
    with Engine.load(artifact, cache_dir=serve_cache_dir, progress=False) as eng:
        yield eng


@pytest.fixture(scope="module")
def solo(engine):
    return engine.generate([GOOD], 8, stop_token_ids=STOP)[0]


@pytest.fixture(scope="module")
def srv(artifact, serve_cache_dir, solo):
    """The module's server, on an Engine of its own: its loop drives that Engine (and warms it while idle) for the
    whole module, while other tests start servers on `engine`."""
    with Engine.load(artifact, cache_dir=serve_cache_dir, progress=False) as eng, InProcess(eng) as s:
        yield s


def _error(r, code: str, param: str | None, message: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and re.search(message, err["message"]), err
    return err


def _good(srv, solo) -> None:
    """Nothing runs or holds a page, and a fixed prompt still gives its solo ids."""
    assert srv.wait_idle() == IDLE
    r = srv.post("/v1/completions", {"prompt": GOOD, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == solo, r.text


# -- finding 1: a grammar compiled on the event loop, once per sequence ---------------------------------------------

def test_a_huge_patterned_schema_with_n_4_leaves_health_answering_and_names_the_limit(engine):
    """3,000 patterned properties, n 4: compiled once, off the event loop (about a second here), then refused
    because its first token `{` opens a parser row past llguidance's 2,000 items. /health, polled meanwhile on the
    same event loop, keeps answering."""
    body = {"messages": HI, "n": 4, "max_tokens": 8, "guided_json": patterned(3000)}

    async def main():
        async with serving(engine) as (client, _):
            t0 = time.perf_counter()
            request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            gaps = await health_gaps(client, request)
            return await request, gaps, time.perf_counter() - t0

    with frozen_heap():
        r, gaps, took = asyncio.run(main())
    _error(r, "grammar_too_complex", "guided_json", r"guided_json: the grammar is past a limit of the grammar library "
                                                    r"after its first token .*Current row has \d+ items; max is 2000")
    assert len(gaps) >= 5, "the request was answered before /health was polled"
    assert max(gaps) < took / 4, f"/health waited {max(gaps):.3f} s of the request's {took:.3f} s"


# -- finding 2: grammars that compile but fail at the first token ----------------------------------------------------

def test_a_grammar_that_fails_at_its_first_token_is_a_400(srv, solo):
    r = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_grammar": 'start: "a" start'})
    _error(r, "grammar_too_complex", "guided_grammar", r"past a limit of the grammar library after its first token "
                                                       r".*Too many items \(limit 50000")
    _good(srv, solo)


def test_2500_choices_are_served(srv, solo):
    """A parser row holds at most 2,000 items: choices are a regex alternation instead, which has no such limit."""
    choices = [f"opt{i}" for i in range(2500)]
    r = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 3,
                                     "guided_choice": choices})
    assert r.status_code == 200, r.text
    assert all(c["text"] in choices and c["finish_reason"] == "stop" for c in r.json()["choices"]), r.text
    odd = ["a b", "(x)", "\\", "é", "a|b", "#&-~", "[z]"]      # regex meta characters are literal in a choice
    r = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 12, "temperature": 1.0, "seed": 4, "n": 4,
                                     "guided_choice": odd})
    assert r.status_code == 200 and all(c["text"] in odd for c in r.json()["choices"]), r.text
    _good(srv, solo)


# -- finding 3: min_tokens with a mask that leaves no token ----------------------------------------------------------

def test_min_tokens_that_no_text_can_meet_is_a_400(srv, solo):
    r = srv.post("/v1/chat/completions", {"messages": HI, "guided_choice": ["yes"], "min_tokens": 10})
    _error(r, "invalid_value", "min_tokens", r"guided_choice: min_tokens 10 cannot be met")
    r = srv.post("/v1/completions", {"prompt": GOOD, "max_tokens": 4, "min_tokens": 2,
                                     "stop_token_ids": list(range(VOCAB))})
    _error(r, "invalid_value", "min_tokens", r"the stop ids .* hold every token of the vocabulary")
    # Control: min_tokens the text can meet.
    r = srv.post("/v1/chat/completions", {"messages": HI, "guided_choice": ["yes"], "min_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "yes", r.text
    _good(srv, solo)


def test_a_sequence_whose_grammar_fails_while_it_runs_ends_alone_with_an_error(engine, solo):
    """What admission cannot decide (three letters, then only the end, under min_tokens 10: more paths than the
    search's budget; a grammar whose rules explode after its second token) ends its own sequences with
    finish_reason "error" and the cause, in a 200; a request running beside them gets its solo ids."""
    cases = [({"guided_regex": "[a-z]{3}", "min_tokens": 10}, r"no token is allowed after 3 tokens: its grammar and "
                                                              r"min_tokens leave none"),
             ({"guided_grammar": 'start: ("p" | "q") ("r" | "s") a\na: "a" a'},
              r"the grammar failed after 2 tokens: .*Too many items")]

    async def main(extra):
        async with serving(engine) as (client, server):
            plain = client.post("/v1/completions", json={"prompt": GOOD, "max_tokens": 8, "temperature": 0,
                                                         "return_token_ids": True})
            bad = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "n": 2, "temperature": 1.0,
                                                       "seed": 5, **extra})
            streamed = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "temperature": 1.0,
                                                            "seed": 6, "stream": True, **extra})
            return await asyncio.gather(plain, bad, streamed)

    for extra, message in cases:
        plain, bad, streamed = asyncio.run(main(extra))
        assert plain.json()["choices"][0]["token_ids"] == solo
        assert bad.status_code == 200, bad.text
        for c in bad.json()["choices"]:
            assert c["finish_reason"] == "error" and re.search(message, c["error"]["message"]), c
        events = [json.loads(e[6:]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
        last = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][-1]["choices"][0]
        assert last["finish_reason"] == "error" and re.search(message, last["error"]["message"]), streamed.text
        assert streamed.text.endswith("data: [DONE]\n\n") and "internal_server_error" not in streamed.text


# -- finding 4: a grammar no text satisfies ----------------------------------------------------------------------------

@pytest.mark.parametrize("field,spec", [
    ("guided_json", {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
    ("guided_grammar", 'start: a\na: a "x"'),
])
def test_a_grammar_without_any_text_is_a_400(srv, solo, field, spec):
    r = srv.post("/v1/chat/completions", {"messages": HI, "max_tokens": 8, field: spec})
    _error(r, "empty_grammar", field, rf"{field}: no text satisfies the grammar")
    _good(srv, solo)


# -- findings 5, 6, 10: tool calls -------------------------------------------------------------------------------------

def test_a_forced_call_whose_arguments_hold_the_closing_tag_is_a_tool_call(srv, solo):
    tag = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"const": "</tool_call>"}}, "required": ["a"],
        "additionalProperties": False}}}
    for stream in (False, True):
        r = srv.post("/v1/chat/completions", {"messages": HI, "tools": [tag], "tool_choice": "required",
                                              "parallel_tool_calls": False, "max_tokens": 90, "temperature": 0,
                                              "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
            deltas = [c["choices"][0] for c in chunks if c["choices"]]
            calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
            finish = deltas[-1]["finish_reason"]
        else:
            ch = r.json()["choices"][0]
            calls, finish = ch["message"].get("tool_calls"), ch["finish_reason"]
        assert finish == "tool_calls" and calls and len(calls) == 1, r.text
        assert calls[0]["function"]["name"] == "f" and json.loads(calls[0]["function"]["arguments"]) == \
            {"a": "</tool_call>"}
    _good(srv, solo)


@pytest.mark.parametrize("call,param", [
    ({"function": {}}, "messages[1].tool_calls[0].function.name"),
    ({"function": {"name": "f"}}, "messages[1].tool_calls[0].function.arguments"),
    ({"type": "file", "function": {"name": "f", "arguments": "{}"}}, "messages[1].tool_calls[0].type"),
    ("f", "messages[1].tool_calls[0]"),
])
def test_a_malformed_assistant_tool_call_is_a_400_naming_it(srv, solo, call, param):
    messages = [HI[0], {"role": "assistant", "content": "", "tool_calls": [call]}, HI[0]]
    r = srv.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # Control: the same history, well formed, renders.
    good = dict(messages[1], tool_calls=[{"id": "c1", "type": "function",
                                          "function": {"name": "f", "arguments": "{\"a\": 1}"}}])
    r = srv.post("/v1/chat/completions", {"messages": [HI[0], good, HI[0]], "max_tokens": 2})
    assert r.status_code == 200, r.text
    _good(srv, solo)


def test_a_tool_whose_parameters_are_not_an_object_schema_is_a_400(srv, solo):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    r = srv.post("/v1/chat/completions", {"messages": HI, "tools": [tool], "tool_choice": "required"})
    _error(r, "invalid_value", "tools[0].function.parameters", r"must be the schema of an object")
    # Control: a schema that names no type is held to an object; the call's arguments are one.
    tool["function"]["parameters"] = {"properties": {"b": {"type": "boolean"}}, "required": ["b"],
                                      "additionalProperties": False}
    r = srv.post("/v1/chat/completions", {"messages": HI, "tools": [tool], "tool_choice": "required",
                                          "parallel_tool_calls": False, "max_tokens": 80, "temperature": 0})
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    jsonschema.validate(json.loads(call["arguments"]), dict(tool["function"]["parameters"], type="object"))
    _good(srv, solo)


# -- finding 9: errors name the request's fields -----------------------------------------------------------------------

@pytest.mark.parametrize("body,param,code,message", [
    ({"prompt": GOOD, "logit_bias": {str(VOCAB): 1}}, "logit_bias", "out_of_vocabulary",
     rf"'logit_bias': token id {VOCAB} is outside the vocabulary"),
    ({"prompt": GOOD, "logit_bias": {str(t): 1 for t in range(65)}}, "logit_bias", "invalid_value",
     r"65 entries; this artifact's sampler takes at most 64"),
    ({"prompt": GOOD, "logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias", "invalid_value",
     r"at most 300 entries, got 301"),
    ({"prompt": GOOD, "logprobs": 20, "echo": True}, None, None, None),
    ({"prompt": list(range(1, 121)), "max_tokens": 32}, "max_tokens", "context_length_exceeded",
     r"prompt of 120 tokens plus max_tokens 32 exceeds the largest context 128: at most 9 new tokens fit"),
])
def test_errors_name_the_requests_own_fields(srv, solo, body, param, code, message):
    r = srv.post("/v1/completions", body)
    if code is None:                # control: within the sampler's 20 top logprobs
        assert r.status_code == 200, r.text
    else:
        _error(r, code, param, message)
    _good(srv, solo)


def test_max_completion_tokens_past_the_context_is_named(srv):
    r = srv.post("/v1/chat/completions", {"messages": HI, "max_completion_tokens": CONTEXT})
    _error(r, "context_length_exceeded", "max_completion_tokens", r"plus max_completion_tokens 128 exceeds")


# -- the budget: each limit named in its refusal ------------------------------------------------------------------------

def test_the_grammar_budget_names_each_limit(engine, solo):
    """A server's GrammarBudget: the grammar's size and its compile time refused at admission (400 naming the
    limit), the CPU time of one token's grammar work ending that sequence alone (finish_reason "error")."""
    from tlaloc_jax.serve.openai.structured import GrammarBudget
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(50)}}
    for budget, message in ((GrammarBudget(max_grammar_size=100), r"grammar size \(number of symbols\) too big "
                                                                   r"\(limit for this grammar: 100\)"),
                            (GrammarBudget(compile_seconds=0.0), r"compiling and checking the grammar took [\d.]+ s, "
                                                                  r"past the limit of 0 s a request")):
        with InProcess(engine, grammar_budget=budget) as srv:
            r = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_json": schema})
            _error(r, "grammar_too_complex", "guided_json", message)
    with InProcess(engine, grammar_budget=GrammarBudget(token_seconds=0.0)) as srv:
        r = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "n": 2, "guided_json": schema})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert c["finish_reason"] == "error" and re.search(
                r"the grammar took [\d.]+ s of CPU time for its token 1, past the limit of 0 s a token",
                c["error"]["message"]), c
        _good(srv, solo)
    # Control: the default budget serves it.
    with InProcess(engine) as srv:
        r = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 40, "guided_json": schema})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
