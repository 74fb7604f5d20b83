"""The HTTP server: `python -m tlaloc_jax.serve` as a subprocess on a free loopback port (under the import
guard), driven by the official openai client and raw httpx, against a tiny exported model. The oracle
for every generated id is the in-process Engine on the same artifact (Engine.generate, solo)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest

from http_util import CONTEXT, GOOD, STOP, loaded, serving, solo_runner, stream_ids
from import_guard import guarded
from tlaloc_jax.serve import Sampling
from tokenizers_util import EOS, IMAGE, VOCAB, build_tokenizer

# The artifacts of tests/support/http_util.py: decode batches of 1 and 8 (eight clients share one call), prefill batch 1,
# contexts 32 and 64: six entries.
KEY = "sk-tlaloc-test"
BODY_LIMIT = 65536
ALLOWED_HOST = "api.internal.example"
ALLOWED_ORIGIN = "https://app.example"

SERVE = guarded(textwrap.dedent("""
    from tlaloc_jax.serve.__main__ import main
    rc = main(sys.argv[1:])
    import gc
    print(f"frozen objects: {gc.get_freeze_count()}")
    leaked = BANNED & {m.split(".")[0] for m in sys.modules}
    if leaked:
        print(f"the serving path imported {sorted(leaked)}", file=sys.stderr)
    sys.exit(rc or (3 if leaked else 0))
"""))


@pytest.fixture(scope="module")
def artifacts(http_artifacts):
    """(text artifact, ids artifact): one checkpoint, exported with and without its tokenizer files."""
    return http_artifacts


class Server:
    def __init__(self, artifact: Path, cache_dir: Path, log: Path, *args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.key = args[args.index("--api-key") + 1] if "--api-key" in args else None    # /metrics needs it too
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(artifact), "--port", str(self.port), "--cache-dir", str(cache_dir),
             "--log-level", "warning", *args],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 240
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGINT) -> None:
        """End the server as a terminal (SIGINT) or a process manager (SIGTERM) would: a clean shutdown, status 0."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        out = self.log.read_text()
        assert rc == 0 and "the serving path imported" not in out, (rc, out[-4000:])
        # the loaded server's heap is frozen before it serves (serve/__main__.py freeze_heap)
        assert re.search(r"frozen objects: [1-9]", out), out[-4000:]

    def metrics(self) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else None
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).raise_for_status().text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


@pytest.fixture(scope="module")
def text_server(artifacts, serve_cache_dir, tmp_path_factory):
    srv = Server(artifacts[0], serve_cache_dir, tmp_path_factory.mktemp("log") / "text.log", "--api-key", KEY,
                 "--max-body-bytes", str(BODY_LIMIT), "--allowed-hosts", ALLOWED_HOST,
                 "--allowed-origins", ALLOWED_ORIGIN)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ids_server(artifacts, serve_cache_dir, text_server, tmp_path_factory):
    # Room for 16 running sequences while the pool holds eight of the longest: the pool fills before the batch.
    srv = Server(artifacts[1], serve_cache_dir, tmp_path_factory.mktemp("log") / "ids.log", "--max-batch", "16")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(artifacts, serve_cache_dir, text_server):
    with loaded(artifacts[0], serve_cache_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def solo(engine):
    return solo_runner(engine, STOP)


@pytest.fixture(scope="module")
def client(text_server):
    return openai.OpenAI(base_url=f"{text_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


TOK = build_tokenizer()


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


def _post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.url}{path}", content=body, headers={**headers, "Content-Type": "application/json"},
                          timeout=60, **kw)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60, **kw)


def _sse_chunks(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# -- tokenizer pieces --------------------------------------------------------------------------------

def test_detokenizer_streams_multibyte_characters_whole(artifacts, engine):
    from tlaloc_jax.serve.tokenizer import load_tokenizer
    tok = load_tokenizer(artifacts[0], engine.manifest)
    text = "naïve café 🌮 x ö 漢字"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text), "some characters must span several tokens"
    det = tok.detokenizer(tok.encode("hello"))
    pieces = [det.add(t) for t in ids] + [det.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # Control: decoding each token alone splits the multi-byte characters.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    # An incomplete character at the very end is flushed as the full decode shows it.
    det = tok.detokenizer([1])
    cut = [det.add(t) for t in ids[:-1]] + [det.flush()]
    assert "".join(cut) == tok.decode(ids[:-1]) and cut[-1].endswith("\ufffd")
    assert tok.eos_token_ids == {EOS}


# -- completions and chat through the openai client ----------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_completions_greedy_ids_equal_engine_generate(client, model, solo, stream):
    prompts = ["the café 🌮", [7, 7, 7, 1, 2, 3, 200, 100, 11, 13]]
    for prompt in prompts:
        ids = TOK.encode(prompt).ids if isinstance(prompt, str) else prompt
        want = solo(ids, 20)
        kw = dict(model=model, prompt=prompt, max_tokens=20, temperature=0, extra_body={"return_token_ids": True})
        if not stream:
            r = client.completions.create(**kw)
            choice = r.choices[0]
            got, text = _extra(choice, "token_ids"), choice.text
            assert _extra(choice, "prompt_token_ids") == ids
            assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
            assert choice.finish_reason == ("stop" if want[-1] == EOS else "length")
        else:
            got, text, finish = [], "", []
            for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                if chunk.choices:
                    got += _extra(chunk.choices[0], "token_ids")
                    text += chunk.choices[0].text
                    finish.append(chunk.choices[0].finish_reason)
                else:
                    usage = chunk.usage
            assert finish[-1] in ("stop", "length") and not any(finish[:-1])
            assert usage.prompt_tokens == len(ids) and usage.completion_tokens == len(want)
        assert got == want
        assert text == TOK.decode(want)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_uses_the_artifacts_template_and_gives_engine_ids(client, model, solo, artifacts, stream):
    import transformers     # the oracle for the template: transformers' apply_chat_template on the same files
    messages = [{"role": "user", "content": "naïve café 🌮"}]
    hf = transformers.AutoTokenizer.from_pretrained(artifacts[0])
    prompt = list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    want = solo(prompt, 16)
    kw = dict(model=model, messages=messages, max_tokens=16, temperature=0, extra_body={"return_token_ids": True})
    if not stream:
        r = client.chat.completions.create(**kw)
        got, text = _extra(r.choices[0], "token_ids"), r.choices[0].message.content
        assert r.choices[0].message.role == "assistant"
        assert _extra(r, "prompt_token_ids") == prompt
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(want)
    else:
        got, text, roles = [], "", []
        for chunk in client.chat.completions.create(stream=True, **kw):
            c = chunk.choices[0]
            roles.append(c.delta.role)
            got += _extra(c, "token_ids") or []
            text += c.delta.content or ""
        assert roles[0] == "assistant" and chunk.choices[0].finish_reason in ("stop", "length")
    assert got == want
    assert text == TOK.decode(want)


def test_models_health_and_unknown_routes(text_server, client, model):
    assert model == "ck"
    r = httpx.get(f"{text_server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert r["data"][0]["max_model_len"] == CONTEXT
    assert httpx.get(f"{text_server.url}/health").json() == {"status": "ok"}
    r = httpx.get(f"{text_server.url}/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def _cuttable_solo(solo, n):
    """A prompt whose greedy text holds a two-character stop string (no U+FFFD: random bytes often are no
    UTF-8) that first occurs a few characters in -> (prompt, ids, text, stop string)."""
    for i in range(40):
        prompt = [3 + i, 40 + i, 100 + 2 * i]
        ids = solo(prompt, n)
        text = TOK.decode(ids)
        for k in range(3, len(text) - 4):
            stop = text[k:k + 2]
            if "\ufffd" not in stop and stop[0] != stop[1] and text.find(stop) >= 2 and EOS not in ids:
                return prompt, ids, text, stop
    pytest.fail("no prompt with a greedy text to cut")


def test_stop_strings_and_stop_token_ids_end_the_choice(text_server, client, model, solo):
    prompt, ids, text, stop = _cuttable_solo(solo, 24)
    cut = text.find(stop)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00never"],
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.text == text[:cut] and c.finish_reason == "stop" and _extra(c, "stop_reason") == stop
    got = _extra(c, "token_ids")
    assert got == ids[:len(got)] and stop in TOK.decode(got) and stop not in TOK.decode(got[:-1])
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True))
    assert streamed == text[:cut]
    # A stop token id (an integer in `stop`, or vLLM's stop_token_ids): its ids end at its first occurrence.
    k = 4
    for body in ({"stop": [ids[k]]}, {"stop_token_ids": [ids[k]]}):
        r = _post(text_server, "/v1/completions", dict(prompt=prompt, max_tokens=24, temperature=0,
                                                       return_token_ids=True, **body)).json()
        c = r["choices"][0]
        first = ids.index(ids[k])
        assert c["token_ids"] == ids[:first + 1] and c["finish_reason"] == "stop" and c["stop_reason"] == ids[k]
        assert r["usage"]["completion_tokens"] == first + 1
    # Pages of sequences ended by a stop string are freed.
    deadline = time.monotonic() + 10
    while text_server.metrics()["tlaloc_kv_pages_in_use"] != 0:
        assert time.monotonic() < deadline, "a stopped sequence kept its pages"
        time.sleep(0.05)


def test_n_seeded_samples_are_reproducible_and_equal_the_engines(client, model, solo):
    prompt = [9, 8, 7, 6, 5]
    kw = dict(model=model, prompt=prompt, max_tokens=12, temperature=0.9, top_p=0.95, seed=11, n=3,
              extra_body={"top_k": 50, "return_token_ids": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ids = [_extra(c, "token_ids") for c in sorted(a.choices, key=lambda c: c.index)]
    assert ids == [_extra(c, "token_ids") for c in sorted(b.choices, key=lambda c: c.index)]
    assert len({tuple(x) for x in ids}) > 1, "the three choices drew the same tokens"
    # Choice j draws from seed + j.
    assert ids == [solo(prompt, 12, Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=11 + j)) for j in range(3)]
    assert a.usage.prompt_tokens == len(prompt) and a.usage.completion_tokens == sum(map(len, ids))


# -- concurrency -------------------------------------------------------------------------------------

def test_eight_concurrent_streams_get_their_solo_outputs_in_shared_batches(text_server, model, solo):
    prompts = [f"client {i}: the {'é' * i}x" for i in range(8)]
    wants = [solo(TOK.encode(p).ids, 32) for p in prompts]
    before = text_server.metrics()

    async def one(client, prompt):
        ids, text = [], ""
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True})
        async for chunk in stream:
            ids += _extra(chunk.choices[0], "token_ids")
            text += chunk.choices[0].text
        return ids, text

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{text_server.url}/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(main())
    assert [g[0] for g in got] == wants
    assert [g[1] for g in got] == [TOK.decode(w) for w in wants]
    after = text_server.metrics()
    d = {k: after[k] - before.get(k, 0.0) for k in ("tlaloc_engine_executions_total", "tlaloc_generation_tokens_total",
                                                    "tlaloc_batch_size_count", "tlaloc_batch_size_sum",
                                                    'tlaloc_batch_size_bucket{le="4"}')}
    assert d["tlaloc_generation_tokens_total"] == sum(map(len, wants))
    # Shared batches: fewer executions than sequence-steps, and calls of more than four sequences.
    assert d["tlaloc_engine_executions_total"] < d["tlaloc_batch_size_sum"]
    assert d["tlaloc_engine_executions_total"] < d["tlaloc_generation_tokens_total"] / 3
    assert d["tlaloc_batch_size_count"] > d['tlaloc_batch_size_bucket{le="4"}'], "no call held more than 4 sequences"
    assert after["tlaloc_kv_pages_in_use"] == 0
    for name in ("tlaloc_time_to_first_token_seconds_count", "tlaloc_inter_token_latency_seconds_count",
                 "tlaloc_request_queue_seconds_count"):
        assert after[name] - before.get(name, 0.0) >= 8


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_pages(text_server, stream):
    body = {"prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0, "stream": stream, "ignore_eos": True}
    key = 'tlaloc_sequences_finished_total{reason="abort"}'
    for attempt in range(3):
        before = text_server.metrics()
        if stream:      # read one chunk, then hang up
            with httpx.stream("POST", f"{text_server.url}/v1/completions", json=body, timeout=30,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert next(r.iter_lines()).startswith("data: ")
        else:           # give up before the answer (60 steps of this tiny model can take under 20 ms)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{text_server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.001),
                           headers={"Authorization": f"Bearer {KEY}"})
        deadline = time.monotonic() + 10
        while (m := text_server.metrics())["tlaloc_kv_pages_in_use"] != 0 or m["tlaloc_requests_running"] != 0:
            assert time.monotonic() < deadline, "the disconnected request kept its pages"
            time.sleep(0.05)
        if m.get(key, 0) > before.get(key, 0):
            assert m["tlaloc_generation_tokens_total"] - before["tlaloc_generation_tokens_total"] < 60
            return
    pytest.fail("the request always finished before the server saw the disconnect")


# -- bad input ---------------------------------------------------------------------------------------

BAD = {
    "malformed-json": (b'{"prompt": [1, 2', {}, 400, "invalid_json", r"The request body is not valid JSON: "),
    "not-an-object": (b'[1, 2]', {}, 400, "invalid_json", r"The request body must be a JSON object"),
    # An unknown top-level field is ignored (vLLM's way; tests/serving/test_openai_parity.py), inside stream_options not.
    "unknown-field": ({"prompt": [1, 2], "max_tokens": 4, "stream_options": {"bogus": True}}, {}, 400,
                      "unknown_parameter", r"Unrecognized request argument supplied: stream_options.bogus"),
    "wrong-type": ({"prompt": [1, 2], "max_tokens": "four"}, {}, 400, "invalid_type",
                   r"Invalid type for 'max_tokens': expected an integer, but got a string instead"),
    "wrong-type-bool": ({"prompt": [1, 2], "stream": "yes"}, {}, 400, "invalid_type",
                        r"Invalid type for 'stream': expected a boolean, but got a string instead"),
    "wrong-type-prompt": ({"prompt": [1, "a"]}, {}, 400, "invalid_type", r"Invalid type for 'prompt'"),
    "bad-value": ({"prompt": [1, 2], "top_p": 0}, {}, 400, "invalid_value", r"Invalid value for 'top_p'"),
    "unsupported": ({"prompt": [1, 2], "best_of": 2}, {}, 400, "unsupported_parameter",
                    r"'best_of' = 2 is not supported by this server"),
    "prompt-too-long": ({"prompt": list(range(1, 70))}, {}, 400, "context_length_exceeded",
                        r"prompt of 69 tokens is longer than the largest context 64"),
    "text-prompt-too-long": ({"prompt": "ab" * 40, "max_tokens": 1}, {}, 400, "context_length_exceeded",
                             r"prompt of \d+ tokens is longer than the largest context 64"),
    "max-tokens-past-context": ({"prompt": [1, 2, 3], "max_tokens": 63}, {}, 400, "context_length_exceeded",
                                r"prompt of 3 tokens plus max_tokens 63 exceeds the largest context 64"),
    "placeholder-id": ({"prompt": [1, IMAGE, 2]}, {}, 400, "placeholder_token",
                       rf"refused token {IMAGE} \(multimodal placeholder, config key image_token_id\)"),
    "placeholder-text": ({"prompt": "look: <image>"}, {}, 400, "placeholder_token", rf"refused token {IMAGE} "),
    "out-of-vocabulary": ({"prompt": [1, VOCAB, 2]}, {}, 400, "out_of_vocabulary",
                          rf"token id {VOCAB} is outside the vocabulary \(size {VOCAB}\)"),
    "negative-id": ({"prompt": [1, -1]}, {}, 400, "out_of_vocabulary", r"token id -1 is outside the vocabulary"),
    "empty-prompt": ({"prompt": []}, {}, 400, "empty_prompt", r"prompt is empty"),
    "body-too-large": ({"prompt": "x" * (BODY_LIMIT + 10)}, {}, 413, "request_too_large",
                       rf"over the limit of {BODY_LIMIT} bytes"),
    "wrong-api-key": ({"prompt": [1, 2]}, {"key": "sk-wrong"}, 401, "invalid_api_key", r"Incorrect API key provided"),
    "missing-api-key": ({"prompt": [1, 2]}, {"key": None}, 401, "invalid_api_key", r"Missing API key"),
    "unknown-model": ({"prompt": [1, 2], "model": "gpt-9"}, {}, 404, "model_not_found",
                      r"The model 'gpt-9' does not exist"),
    "chat-wrong-type": ({"messages": "hi"}, {"path": "/v1/chat/completions"}, 400, "invalid_type",
                        r"Invalid type for 'messages': expected an array of messages"),
    "chat-template-refuses": ({"messages": [{"role": "robot", "content": "hi"}]}, {"path": "/v1/chat/completions"},
                              400, "invalid_value", r"the chat template refused the messages: unknown role robot"),
    "chat-image-part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                        {"path": "/v1/chat/completions"}, 400, "invalid_value", r"only text parts"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_answers_an_openai_error_and_changes_nothing(text_server, client, model, solo, case):
    body, opts, status, code, message = BAD[case]
    before = text_server.metrics()
    kw = {"key": opts["key"]} if "key" in opts else {}
    r = _post(text_server, opts.get("path", "/v1/completions"), body, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert re.search(message, err["message"]), err["message"]
    after = text_server.metrics()
    assert after["tlaloc_kv_pages_in_use"] == 0 and after["tlaloc_requests_running"] == 0
    assert after["tlaloc_generation_tokens_total"] == before["tlaloc_generation_tokens_total"]
    # The next good request runs to its solo output.
    r = client.completions.create(model=model, prompt=GOOD, max_tokens=16, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert _extra(r.choices[0], "token_ids") == solo(GOOD, 16)


def test_the_openai_client_raises_typed_errors(client, model):
    with pytest.raises(openai.BadRequestError, match="longer than the largest context 64") as e:
        client.completions.create(model=model, prompt=list(range(1, 70)), max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    bad = openai.OpenAI(base_url=client.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt=[1], max_tokens=1)


# -- an artifact without a tokenizer; a full pool ------------------------------------------------------

def test_an_artifact_without_tokenizer_serves_token_ids(ids_server, solo):
    c = openai.OpenAI(base_url=f"{ids_server.url}/v1", api_key="unused", max_retries=0)
    model = c.models.list().data[0].id
    prompts = [GOOD, [42, 43]]
    r = c.completions.create(model=model, prompt=prompts, max_tokens=10, temperature=0, n=2)
    got = {ch.index: (_extra(ch, "token_ids"), ch.text) for ch in r.choices}
    assert got == {i * 2 + j: (solo(p, 10), "") for i, p in enumerate(prompts) for j in range(2)}
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    streamed = []
    for chunk in c.completions.create(model=model, prompt=GOOD, max_tokens=10, temperature=0, stream=True):
        streamed += _extra(chunk.choices[0], "token_ids")
    assert streamed == solo(GOOD, 10)
    for path, body, message in [
            ("/v1/completions", {"prompt": "hello"}, r"no tokenizer: send the prompt as token ids"),
            ("/v1/completions", {"prompt": [1, 2], "stop": "x"}, r"stop strings need a tokenizer"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, r"no tokenizer, so no chat")]:
        r = _post(ids_server, path, body, key=None)
        assert r.status_code == 400 and re.search(message, r.json()["error"]["message"])


def test_a_full_pool_queues_the_request_and_it_runs_when_pages_free(ids_server, solo):
    """Eight sequences of 63 positions hold all 64 pages; a ninth waits (no 503) and gets its solo ids once pages
    free up, and the eight keep theirs."""
    holders = [[10 + i, 20, 30, 40] for i in range(8)]
    small = [5, 6, 7]

    async def attempt():
        async with httpx.AsyncClient(base_url=ids_server.url, timeout=60) as http:
            events = [asyncio.Event() for _ in holders]
            tasks = [asyncio.create_task(stream_ids(http, {"prompt": p, "max_tokens": 60, "temperature": 0}, e))
                     for p, e in zip(holders, events)]
            await asyncio.gather(*(e.wait() for e in events))
            queued = await http.post("/v1/completions", json={"prompt": small, "max_tokens": 4, "temperature": 0})
            return queued, await asyncio.gather(*tasks)

    queued, held = asyncio.run(attempt())
    assert held == [solo(p, 60) for p in holders]
    assert queued.status_code == 200, queued.text
    assert queued.json()["choices"][0]["token_ids"] == solo(small, 4)
    assert ids_server.metrics()["tlaloc_kv_pages_in_use"] == 0


def test_a_request_past_max_waiting_answers_400_and_nothing_else_changes(engine, solo):
    """--max-waiting 1: a request for two sequences could never be admitted, a 400 naming n (not 503 + Retry-After)
    and the running one keeps its ids. (A queue full now, and --max-wait-seconds: tests/serving/test_scheduling_http.py.)"""
    async def attempt(**kw):
        """A 60-token stream runs alone (max_batch 1); a request for two sequences arrives after its first token."""
        async with serving(engine, max_batch=1, **kw) as (http, _):
            ids, second = [], None
            async with http.stream("POST", "/v1/completions", json={
                    "prompt": [10, 20, 30, 40], "max_tokens": 60, "temperature": 0, "stream": True,
                    "return_token_ids": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0]["token_ids"]
                        if second is None:
                            second = asyncio.create_task(http.post("/v1/completions", json={
                                "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "n": 2,
                                "return_token_ids": True}))
            return ids, await second

    ids, second = asyncio.run(attempt(max_waiting=1))
    assert ids == solo([10, 20, 30, 40], 60)
    assert second.status_code == 400 and "retry-after" not in second.headers, second.text
    err = second.json()["error"]
    assert err["param"] == "n" and re.search(r"n is 2, 2 sequences .*--max-waiting is 1", err["message"])
    # Control: with room to wait, the same second request runs to its solo ids once the first ends.
    ids, second = asyncio.run(attempt())
    assert second.status_code == 200 and [c["token_ids"] for c in second.json()["choices"]] == [solo([5, 6, 7], 4)] * 2


def test_a_loopback_server_answers_only_its_hosts_and_origins(text_server):
    """DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1 sends Host: evil.example."""
    port = text_server.port
    for host in ("127.0.0.1", f"localhost:{port}", f"[::1]:{port}", f"{ALLOWED_HOST}:{port}"):
        assert httpx.get(f"{text_server.url}/health", headers={"Host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "evil.example", f"{ALLOWED_HOST}.evil.example"):
        r = httpx.get(f"{text_server.url}/health", headers={"Host": host})
        assert r.status_code == 421 and r.json()["error"]["code"] == "invalid_host", (host, r.text)
        r = httpx.post(f"{text_server.url}/v1/completions", json={"prompt": [1], "max_tokens": 1},
                       headers={"Host": host, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 421, (host, r.text)
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    r = httpx.options(f"{text_server.url}/v1/completions", headers={"Origin": ALLOWED_ORIGIN, **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    r = httpx.options(f"{text_server.url}/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in r.headers


def test_the_import_guard_bites():
    """Control for the guard every server here starts under."""
    r = subprocess.run([sys.executable, "-c", SERVE.replace("from tlaloc_jax.serve.__main__ import main",
                                                            "import tlaloc_jax.model")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "the serving path imported jax" in r.stderr


def test_sigterm_ends_the_server_with_status_0(ids_server):
    """A process manager stops the server with SIGTERM: it shuts down cleanly and exits 0 (uvicorn raised the signal
    again after its shutdown: status -15). Last in this file: the module's servers stop after it."""
    ids_server.stop(signal.SIGTERM)
    assert ids_server.proc.returncode == 0
