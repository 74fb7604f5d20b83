"""OpenAI / vLLM server parity (issue 17), driven in process with the official openai client: logprobs and
top_logprobs (completions and chat, streamed or not), echo and prompt_logprobs, penalties, min_p, min_tokens and
logit_bias, structured output (response_format, structured_outputs, guided_*), tool calls, unknown fields,
stop_token_ids' text, /tokenize, /detokenize, /version, /v1/models/{id}, vLLM's metric names.

The artifact: tests/support/http_util.py's checkpoint and ladder, exported with the sampler in every entry ("sampled");
tests/support/http_util.py's text artifact (no sampler) is the host-side fallback. The oracle for ids is the Engine on
the same artifact; for logprobs, transformers."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import numpy as np
import openai
import pytest

from http_util import GOOD, LADDER, STOP, InProcess, loaded, serving
from tlaloc_jax.serve import Engine, Sampling
from tokenizers_util import write_tokenizer

MODEL = "sampled"
# A Qwen3-style template: the tools in a system block, calls in <tool_call> blocks, results in <tool_response>.
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "# Tools\n<tools>{%- for tool in tools %}\n{{ tool.function | tojson }}{%- endfor %}\n</tools>\n"
    "Call as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["oslo", "rome"]}},
                                      "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "clock", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                    "required": ["utc"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def artifacts(http_artifacts, tmp_path_factory):
    """(sampled artifact, the text artifact without a sampler, the checkpoint), the sampled one exported here with
    the Qwen3-style template."""
    from tlaloc_jax.export import Sampler, export_checkpoint
    ck = http_artifacts[0].parent / "ck"
    root = tmp_path_factory.mktemp("parity")
    qwen = root / "ck"
    qwen.mkdir()
    for f in ck.iterdir():
        (qwen / f.name).write_bytes(f.read_bytes())
    write_tokenizer(qwen)
    cfg = json.loads((qwen / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN3_TEMPLATE
    (qwen / "tokenizer_config.json").write_text(json.dumps(cfg))
    # Contexts 64 and 512: a tool-calling chat renders the tools' JSON into the prompt.
    export_checkpoint(qwen, root / "sampled", sampler=Sampler(top_logprobs=8, logit_bias=4),
                      **dict(LADDER, context_ladder=(64, 512), prefill_chunk=64, prefill_long_chunk=0, num_blocks=256))
    return root / "sampled", http_artifacts[0], ck


@pytest.fixture(scope="module")
def engine(artifacts, serve_cache_dir):
    with loaded(artifacts[0], serve_cache_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def host_engine(artifacts, serve_cache_dir):
    with loaded(artifacts[1], serve_cache_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(artifacts, serve_cache_dir):
    """The server on an Engine of its own: its loop thread drives that Engine (and warms it while idle), so the
    tests that drive `engine` directly never share an Engine with a running loop."""
    with loaded(artifacts[0], serve_cache_dir) as eng, InProcess(eng, model_name=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=server.client, max_retries=0)


def _solo(engine, prompt, n, sampling=None, stop=STOP):
    return engine.generate([prompt], n, sampling=sampling, stop_token_ids=stop)[0]


# -- 1. logprobs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_the_engines_and_streams_carry_them(client, engine, stream):
    kw = dict(model=MODEL, prompt=GOOD, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    if stream:
        tokens, lps, tops = [], [], []
        for chunk in client.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                if ch.logprobs:
                    tokens += ch.logprobs.tokens
                    lps += ch.logprobs.token_logprobs
                    tops += ch.logprobs.top_logprobs
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tokens, lps, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    assert len(tokens) == len(lps) == len(tops) == 6
    rid = engine.add_request(GOOD, 6, sampling=Sampling(logprobs=3))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    engine.release(rid)
    assert lps == pytest.approx([e.logprob for e in events], abs=1e-6)
    for top, e in zip(tops, events):
        assert len(top) == 3 and max(top.values()) == pytest.approx(e.top_logprobs[0][1], abs=1e-6)
    # Greedy: the chosen token is the most likely one.
    assert all(lp == pytest.approx(max(top.values()), abs=1e-6) for lp, top in zip(lps, tops))


def test_logprobs_zero_returns_the_chosen_tokens_and_chat_top_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=GOOD, max_tokens=4, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == 4 and all(t == {} for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == r.choices[0].text
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-6) for c in content)
    assert all(bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)
    with pytest.raises(openai.BadRequestError, match="needs 'logprobs': true"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       top_logprobs=2)


def test_the_host_fallback_reports_the_same_logprobs(artifacts, host_engine, engine):
    """An artifact without a sampler: the host computes the logprobs from pulled logits; they equal the body's
    within float32 rounding of one log_softmax."""
    s = Sampling(logprobs=2)
    got = []
    for eng in (engine, host_engine):
        rid = eng.add_request(GOOD, 5, sampling=s)
        events = []
        while eng.has_unfinished():
            events += eng.step()
        eng.release(rid)
        got.append(events)
    assert [e.token for e in got[0]] == [e.token for e in got[1]]
    assert [e.logprob for e in got[0]] == pytest.approx([e.logprob for e in got[1]], abs=1e-5)


def test_echo_and_prompt_logprobs(client, server):
    prompt = "the cat"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text.startswith(prompt)
    ids = server.server.tokenizer.encode(prompt)
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == ch.text.replace(prompt, "<s>" + prompt, 1) or lp.tokens[0] == "<s>"
    body = server.post("/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0,
                                           "prompt_logprobs": 2}).json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for k, entry in enumerate(plp[1:], 1):
        assert str(ids[k]) in entry and entry[str(ids[k])]["rank"] >= 1
        assert lp.token_logprobs[k] == pytest.approx(entry[str(ids[k])]["logprob"], abs=1e-6)
    # Streamed: the first chunk carries the echoed prompt and its logprobs.
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text


# -- 2. structured output and tools --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_parses_and_validates(client, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "a person"}], max_tokens=100, temperature=1.0,
              seed=3, n=4, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    if stream:
        texts = ["", "", "", ""]
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
    else:
        texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    # json_object: any JSON object.
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=40,
                                       temperature=0.7, seed=1, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_choice_and_vllm_forms(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=1.0, seed=5, n=3,
                                  extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.text) for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=1.0, seed=6, n=4,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.text in ("red", "green", "blue") for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=1.0, seed=7,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=0.8, seed=8,
                                  extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    with pytest.raises(openai.BadRequestError, match="guided_regex: the grammar does not compile"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "(["})
    with pytest.raises(openai.BadRequestError, match="one structured output at a time"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    # Control: the same request without the grammar does not give the pattern.
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=7, temperature=1.0, seed=5)
    assert not re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].text)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_with_a_qwen3_style_template(client, stream):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=80, temperature=0.8, seed=2,
              tool_choice={"type": "function", "function": {"name": "weather"}})
    if stream:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
                finish = ch.finish_reason or finish
        calls = list(calls.values())
    else:
        ch = client.chat.completions.create(**kw).choices[0]
        finish = ch.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in ch.message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    # required: any of the tools; the answer goes back through the template as a tool message.
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=80,
                                       temperature=0.8, seed=4, tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name in ("weather", "clock")
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_tools_need_a_template_that_defines_them(host_engine):
    with InProcess(host_engine) as srv:      # the tests' ChatML template has no tools
        r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]})
        assert r.status_code == 400 and "does not define tools" in r.json()["error"]["message"]
        r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                              "tool_choice": "none", "max_tokens": 2})
        assert r.status_code == 200


# -- 3. penalties, min_p, min_tokens, logit_bias ----------------------------------------------------------------


def test_penalties_and_logit_bias_in_the_body_equal_the_host_fallback(engine, host_engine, client):
    s = Sampling(repetition_penalty=1.6, presence_penalty=0.8, frequency_penalty=0.5, logit_bias=((65, 2.0),))
    assert _solo(engine, GOOD, 12, s) == _solo(host_engine, GOOD, 12, s)
    assert _solo(engine, GOOD, 12, s) != _solo(engine, GOOD, 12)       # control: they change the ids
    # A prompt that holds the tokens greedy decoding picks next (the model's own continuation): presence and
    # frequency penalties must skip them, so a side that counted the prompt would part from the other.
    echo = GOOD + _solo(engine, GOOD, 12)
    unpenalised = _solo(engine, echo, 12)
    assert set(unpenalised) & set(echo), "the echo prompt's greedy ids repeat none of its tokens"
    s = Sampling(presence_penalty=0.8, frequency_penalty=0.5)
    assert _solo(engine, echo, 12, s) == _solo(host_engine, echo, 12, s)
    r = client.completions.create(model=MODEL, prompt=GOOD, max_tokens=5, temperature=0, logit_bias={"65": 100},
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].model_extra["token_ids"] == [65] * 5
    r = client.completions.create(model=MODEL, prompt=GOOD, max_tokens=6, temperature=0.9, seed=1,
                                  presence_penalty=1.0, frequency_penalty=0.5,
                                  extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == _solo(engine, GOOD, 6, Sampling(
        temperature=0.9, seed=1, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2, min_p=0.05))


def test_min_tokens_masks_the_stop_tokens(client, engine):
    first = _solo(engine, GOOD, 1, stop=())[0]
    r = client.completions.create(model=MODEL, prompt=GOOD, max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [first], "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [first]          # control: it stops at once
    r = client.completions.create(model=MODEL, prompt=GOOD, max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [first], "min_tokens": 3, "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) >= 3 and first not in ids[:3]


# -- 4. unknown fields, 5. stop_token_ids' text --------------------------------------------------------------------


def test_unknown_fields_are_ignored_and_logged_or_refused_when_strict(server, engine, caplog):
    body = {"prompt": GOOD, "max_tokens": 2, "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}
    with caplog.at_level("WARNING", logger="tlaloc_jax.serve.http"):
        assert server.post("/v1/completions", body).status_code == 200
    assert "ignored fields metadata, service_tier, store" in caplog.text
    with InProcess(engine, strict_fields=True) as strict:
        r = strict.post("/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"


def test_a_stop_token_keeps_its_text_unless_special(client, engine, server):
    ids = _solo(engine, GOOD, 6, stop=())
    stop = next(t for t in ids[1:] if t < 256)
    r = client.completions.create(model=MODEL, prompt=GOOD, max_tokens=6, temperature=0,
                                  extra_body={"stop_token_ids": [stop], "return_token_ids": True})
    ch = r.choices[0]
    assert ch.model_extra["token_ids"][-1] == stop and ch.finish_reason == "stop"
    assert ch.text == server.server.tokenizer.decode(ch.model_extra["token_ids"])
    assert ch.text.endswith(server.server.tokenizer.token_text(stop))


# -- 6. endpoints and metrics --------------------------------------------------------------------------------------


def test_tokenize_detokenize_version_and_one_model(server, client):
    r = server.post("/tokenize", {"prompt": "the cat", "return_token_strs": True}).json()
    assert r["tokens"] == server.server.tokenizer.encode("the cat") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512 and len(r["token_strs"]) == r["count"]
    assert server.post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "the cat"}
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3
    assert server.post("/detokenize", {"tokens": [10**6]}).status_code == 400
    assert "version" in server.client.get("/version").json()
    assert client.models.retrieve(MODEL).max_model_len == 512
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_metrics_under_vllms_names(server, client):
    client.completions.create(model=MODEL, prompt=GOOD, max_tokens=2)
    text = server.client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total"):
        assert re.search(rf'^{re.escape(name)}{{[^}}]*model_name="{MODEL}"', text, re.M), name
    assert "tlaloc_generation_tokens_total" in text


# -- seeded sampling alone and batched -------------------------------------------------------------------------------


def test_a_seeded_request_gives_the_same_tokens_alone_and_batched_with_seven_others(engine):
    async def go():
        async with serving(engine, model_name=MODEL) as (http, _):
            async def one(prompt, seed):
                r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0.9,
                                                             "top_p": 0.95, "seed": seed, "ignore_eos": True,
                                                             "return_token_ids": True})
                return r.json()["choices"][0]["token_ids"]
            alone = await one(GOOD, 77)
            others = [GOOD[:k] + [k] for k in range(1, 8)]
            together = await asyncio.gather(one(GOOD, 77), *(one(p, 100 + k) for k, p in enumerate(others)))
            control = await one(GOOD, 78)
            return alone, together, control
    alone, together, control = asyncio.run(go())
    assert engine.stats()["batch_sizes"].get(8), "the eight requests never shared a call"
    assert together[0] == alone and control != alone


# -- logprobs against transformers -----------------------------------------------------------------------------------


def _logprob_events(engine, prompt, n):
    rid = engine.add_request(prompt, n, sampling=Sampling(logprobs=1, prompt_logprobs=1))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    engine.release(rid)
    return events


def _lsm(logits):
    x = np.asarray(logits, np.float64)
    return x - (x.max(-1, keepdims=True) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))


@pytest.mark.numeric
def test_greedy_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(artifacts, engine):
    """Served greedy ids against transformers' (near-tie rule); up to any divergence, each step's chosen-token logprob
    (the body's TOKEN_LOGPROB) within the tolerance model of log_softmax of transformers' logits, and so is every
    prompt token's logprob (read a token a call). The bound: a logit moves by at most D = logit_bound * max |logit|,
    so a log_softmax entry by 2 D, plus log_softmax's own roundings (a V-term sum, exp, log). Control: the served
    logprobs against the oracle's one step later are far outside it."""
    import torch

    import tlaloc_jax
    from hf_models import load_hf_torch, torch_greedy
    from margins import assert_within
    from oracle import check_greedy, engine_next_token
    from tlaloc_jax.kernels import tolerances as tol
    ck = artifacts[2]
    n = 12
    cfg = tlaloc_jax.load_hf(ck).config
    logit_bound = tol.bound(tol.decoder_roundings_of(cfg, context=len(GOOD) + n))
    lsm_bound = tol.bound(cfg.vocab_size + 2 * tol.TRANSCENDENTAL_ULPS + 2)
    ref = load_hf_torch(ck)
    want = torch_greedy(ref, GOOD, n)
    events = _logprob_events(engine, GOOD, n)
    got = [e.token for e in events]
    ties = check_greedy(GOOD, got, want, logit_bound=logit_bound, next_token=engine_next_token(engine))
    agree = ties[0].step if ties else n
    oracle = _lsm(want.logits)
    for k in range(agree):
        allowed = 2 * logit_bound * np.abs(want.logits[k]).max() + lsm_bound * np.abs(oracle[k]).max()
        assert_within(abs(events[k].logprob - oracle[k][got[k]]), allowed, f"step {k} logprob")
        assert events[k].top_logprobs[0] == (got[k], pytest.approx(events[k].logprob))
    shifted = max(abs(events[k].logprob - oracle[k + 1][got[k]]) for k in range(agree - 1))
    assert shifted > 10 * (2 * logit_bound * np.abs(want.logits).max() + lsm_bound * np.abs(oracle).max()), \
        "control: logprobs one step off pass"
    with torch.no_grad():
        prompt_logits = ref(torch.tensor([GOOD])).logits[0].float().numpy()
    prompt_lsm = _lsm(prompt_logits)
    plp = events[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(GOOD)
    for k in range(1, len(GOOD)):
        allowed = 2 * logit_bound * np.abs(prompt_logits[k - 1]).max() + lsm_bound * np.abs(prompt_lsm[k - 1]).max()
        assert_within(abs(plp[k][0] - prompt_lsm[k - 1][GOOD[k]]), allowed, f"prompt token {k} logprob")


# -- the demo model: JSON-schema requests and its tool-defining template -----------------------------------------


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory, serve_cache_dir):
    from tlaloc_jax.tools.demo import export_demo
    art = tmp_path_factory.mktemp("demo") / "artifact"
    export_demo(art)
    with loaded(art, serve_cache_dir) as eng:
        yield eng


def test_a_hundred_json_schema_requests_to_the_demo_model_parse_and_validate(demo_engine):
    """100 concurrent chat requests with response_format json_schema, sampled at temperature 1 (each its own seed):
    every answer parses and validates. Control: the same requests without the schema do not parse."""
    async def go(schema: bool, count: int):
        async with serving(demo_engine) as (http, _):
            async def one(seed):
                body = {"messages": [{"role": "user", "content": "def person():"}], "max_tokens": 120,
                        "temperature": 1.0, "seed": seed}
                if schema:
                    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]
            return await asyncio.gather(*(one(s) for s in range(count)))
    answers = asyncio.run(go(True, 100))
    for a in answers:
        assert a["finish_reason"] == "stop", a
        jsonschema.validate(json.loads(a["message"]["content"]), SCHEMA)
    parsed = 0
    for a in asyncio.run(go(False, 8)):
        try:
            jsonschema.validate(json.loads(a["message"]["content"]), SCHEMA)
            parsed += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert parsed == 0, "control: unconstrained answers validate"


def test_the_demo_models_template_defines_tools(demo_engine):
    with InProcess(demo_engine) as srv:
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=srv.client, max_retries=0)
        r = client.chat.completions.create(model=demo_engine.manifest.model.name, max_tokens=50, temperature=0,
                                           messages=[{"role": "user", "content": "weather in oslo"}],
                                           tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0].function
        schema = {"weather": WEATHER, "clock": CLOCK}[call.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.arguments), schema)


# -- 7. serving and export options ---------------------------------------------------------------------------


def test_max_model_len_max_num_seqs_and_the_compile_bar(artifacts, serve_cache_dir, capfd):
    from tlaloc_jax.serve.__main__ import main
    assert main([str(artifacts[0]), "--max-model-len", "4096", "--cache-dir", str(serve_cache_dir)]) == 2
    assert "--max-model-len 4096 is past the artifact's largest context (512)" in capfd.readouterr().err
    with pytest.raises(SystemExit):
        main([str(artifacts[0]), "--max-num-seqs", "0"])
    assert "--max-num-seqs" in capfd.readouterr().err
    with Engine.load(artifacts[0], cache_dir=serve_cache_dir, max_model_len=40) as eng:
        assert "compile" in capfd.readouterr().err              # the bar, on stderr
        with InProcess(eng, max_batch=2) as srv:
            assert srv.client.get("/v1/models").json()["data"][0]["max_model_len"] == 40
            r = srv.post("/v1/completions", {"prompt": GOOD, "max_tokens": 40})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert srv.post("/v1/completions", {"prompt": GOOD, "max_tokens": 30}).status_code == 200
            assert srv.server.loop.max_running == 2


def test_an_export_past_max_position_embeddings_is_refused_unless_allowed(artifacts, tmp_path, capfd):
    from tlaloc_jax.export import ExportError, export_checkpoint
    from tlaloc_jax.export.__main__ import main
    ck = artifacts[2]                  # max_position_embeddings 512
    small = dict(batch_ladder=(1,), context_ladder=(1024,), block_size=8, prefill_chunk=16, prefill_long_chunk=0,
                 progress=False)
    with pytest.raises(ExportError, match=r"reaches 1024 positions, past the checkpoint's max_position_embeddings "
                                          r"\(512\).*allow_longer_context"):
        export_checkpoint(ck, tmp_path / "refused", **small)
    assert main([str(ck), str(tmp_path / "cli"), "--context-ladder", "1024", "--batch-ladder", "1", "--quiet"]) == 2
    assert "--allow-longer-context" in capfd.readouterr().err
    with pytest.warns(UserWarning, match="past the checkpoint's max_position_embeddings"):
        m = export_checkpoint(ck, tmp_path / "allowed", allow_longer_context=True, **small)
    assert m.buckets.context_ladder == (1024,) and m.sampler is None


def test_the_serving_path_with_grammars_stays_jax_free(artifacts, tmp_path):
    """llguidance on the serving path: a guarded process compiles a JSON schema and masks a step."""
    import subprocess
    import sys

    from import_guard import guarded
    script = guarded(f"""
import numpy as np
from tlaloc_jax import artifact as af
from tlaloc_jax.serve.loop import StepWork
from tlaloc_jax.serve.openai.structured import Grammars
from tlaloc_jax.serve.tokenizer import read_listed
m = af.load_manifest({str(artifacts[0])!r})
g = Grammars(read_listed(__import__("pathlib").Path({str(artifacts[0])!r}), m, "tokenizer.json"), m.model.vocab, [283],
             StepWork())
c, = g.prepare("json", {{"type": "object"}}, 1)
words = np.full(af.mask_words(m.model.vocab), -1, np.int32)
c.fill(words)
assert (words.view(np.uint32)[123 // 32] >> (123 % 32)) & 1 and not (words.view(np.uint32)[0] & 1)
leaked = BANNED & {{n.split(".")[0] for n in sys.modules}}
assert not leaked, leaked
print("ok")
""")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_a_streamed_event_is_one_line_whatever_its_text():
    """U+2028, U+2029 and U+0085 are line breaks to str.splitlines (httpx's aiter_lines): written as escapes, an
    event holding them stays one line (a sampled stream of the tiny model cut its events in two)."""
    from tlaloc_jax.serve.http import _sse
    text = "a\u2028b\u2029c\x85d\u00e9"
    event = _sse({"text": text})
    assert event.splitlines() == [event[:-2], ""] and json.loads(event[6:])["text"] == text
