"""/v1/embeddings (issue 16): an embedding program served beside the decoder, by one app (in this process, through
create_app) and by `python -m tlaloc_jax.serve --embedding-artifact` (a subprocess under the import guard), driven by
the official openai client. The oracle is the embedder run in process at each input's exact size
(tests/support/bounded_models.py), within the tolerance model's bound the artifact records; bad input is a 400 that names
it, in the decoder endpoints' words."""

from __future__ import annotations

import base64
import logging
import re
import subprocess
import sys

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

import bounded_models as bmod
import tlaloc_jax
from http_util import InProcess
from margins import assert_within
from test_http import SERVE, Server
from tlaloc_jax import exact_valid
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.serve import BoundedProgram, Engine
from tlaloc_jax.serve.openai.embeddings import Embeddings, load_embedding_tokenizer
from tokenizers_util import VOCAB, build_tokenizer, write_tokenizer

MAX_TOKENS = 32
NAME = "tiny-embedder"
TOK = build_tokenizer()
TEXTS = ["hello there", "taco 🌮", "the cat sat on the mat, then the hat"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(artifact, params): the test embedder over the test tokenizer's vocabulary, with its tokenizer files."""
    root = tmp_path_factory.mktemp("embedder")
    (root / "tok").mkdir()
    write_tokenizer(root / "tok")
    params = bmod.embed_params(VOCAB, MAX_TOKENS, seed=5)
    ids = np.random.default_rng(6).integers(0, VOCAB, (4, MAX_TOKENS)).astype(np.int32)
    tlaloc_jax.stage_bounded(bmod.embed, params, {"ids": ids}, root / "artifact", name=NAME,
                             bounds=bmod.embed_bounds(max_tokens=MAX_TOKENS, buckets=(8, 16, 32)),
                             embedding=tlaloc_jax.EmbeddingTask("ids", "embedding", VOCAB), tokenizer_dir=root / "tok",
                             progress=False)
    return root / "artifact", params


@pytest.fixture(scope="module")
def engine(http_artifacts, serve_cache_dir):
    with Engine.load(http_artifacts[0], cache_dir=serve_cache_dir, progress=False) as eng:
        yield eng


@pytest.fixture(scope="module")
def program(embedder, engine, serve_cache_dir):
    """The embedder on the decoder's device, as the server runs it."""
    with BoundedProgram.load(embedder[0], device=engine.device, cache_dir=serve_cache_dir) as p:
        yield p


@pytest.fixture(scope="module")
def reference(embedder):
    """ids -> the embedding the embedder gives them in process."""
    params = jax.tree.map(jnp.asarray, embedder[1])
    bounds = bmod.embed_bounds(max_tokens=MAX_TOKENS, buckets=(8, 16, 32))
    run = jax.jit(lambda inputs: bmod.embed(params, inputs, exact_valid(bounds, inputs))["embedding"])
    return lambda ids: np.asarray(run({"ids": np.asarray([ids], np.int32)})[0])


def serving(engine, program, embedder, **kw) -> InProcess:
    return InProcess(engine, embeddings=Embeddings(program, load_embedding_tokenizer(embedder[0], program.manifest)),
                     **kw)


def _openai(srv: InProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=srv.client, max_retries=0)


def _check_vectors(got, ids_list, reference, program, what):
    bound = tol.bound(dict(program.manifest.output("embedding").roundings))
    assert len(got) == len(ids_list)
    for i, (vector, ids) in enumerate(zip(got, ids_list)):
        assert_within(tol.relative_error(np.asarray(vector, np.float32), reference(ids)), bound, f"{what} input {i}")


@pytest.mark.numeric
def test_the_openai_client_gets_the_in_process_embeddings(engine, program, embedder, reference):
    """Text (base64, which the client asks for and decodes by default, and float) and token ids; usage counts the
    tokens."""
    ids = [TOK.encode(t).ids for t in TEXTS]
    with serving(engine, program, embedder) as srv:
        client = _openai(srv)
        r64 = client.embeddings.create(model=NAME, input=TEXTS)
        _check_vectors([d.embedding for d in r64.data], ids, reference, program, "embeddings base64")
        assert [d.index for d in r64.data] == [0, 1, 2] and r64.model == NAME
        assert r64.usage.prompt_tokens == r64.usage.total_tokens == sum(len(i) for i in ids)
        rf = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
        assert [d.embedding for d in rf.data] == [d.embedding for d in r64.data], "float and base64 differ"
        one = client.embeddings.create(model=NAME, input=ids[2])
        _check_vectors([one.data[0].embedding], [ids[2]], reference, program, "embeddings one id list")
        # A batch of id lists longer than the program's rows (4) and its buckets: several bodies, in order.
        many = [[(7 * i + j) % 280 for j in range(n)] for i, n in enumerate([1, 7, 8, 9, 15, 16, 17, 31, 32])]
        r = client.embeddings.create(model=NAME, input=many, encoding_format="float")
        _check_vectors([d.embedding for d in r.data], many, reference, program, "embeddings id batch")
        # base64 is the float32 values' little-endian bytes. (One input alone runs in a smaller body than beside
        # others, so it is compared with itself alone.)
        raw = [srv.post("/v1/embeddings", {"input": TEXTS[0], "encoding_format": f}).json()["data"][0]["embedding"]
               for f in ("base64", "float")]
        assert np.frombuffer(base64.b64decode(raw[0]), "<f4").tolist() == raw[1]


def _error(r, status: int, code: str, message: str, param: str | None = "input") -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and re.search(message, err["message"]) and err["param"] == param, err


BAD = {
    "empty-text": ({"input": ""}, "empty_prompt", r"Invalid value for 'input': the input is empty"),
    "empty-list": ({"input": []}, "empty_prompt", r"the input is empty"),
    "one-empty-text": ({"input": ["a", ""]}, "empty_prompt", r"input 1 is empty"),
    "one-empty-ids": ({"input": [[1, 2], []]}, "empty_prompt", r"input 1 is empty"),
    "too-many-ids": ({"input": list(range(1, 34))}, "context_length_exceeded",
                     r"the input has 33 tokens, more than the model's largest context 32"),
    "too-long-text": ({"input": ["ok", "z" * 100_000]}, "context_length_exceeded",
                      r"input of 100000 characters is longer than the largest context \(32 tokens"),
    "text-too-many-tokens": ({"input": ["ok", "z " * 20]}, "context_length_exceeded",
                             r"input 1 has 41 tokens, more than the model's largest context 32"),
    "number": ({"input": 5}, "invalid_type", r"Invalid type for 'input'"),
    "mixed": ({"input": [1, "a"]}, "invalid_type", r"Invalid type for 'input'"),
    "out-of-vocabulary": ({"input": [[1], [3, VOCAB]]}, "out_of_vocabulary",
                          rf"input 1 holds token id {VOCAB}, outside the vocabulary \(0 to {VOCAB - 1}\)"),
    "negative-id": ({"input": [-1]}, "out_of_vocabulary", r"the input holds token id -1"),
    "too-many-inputs": ({"input": ["a"] * 2049}, "invalid_value", r"at most 2048 inputs, got 2049"),
    "format": ({"input": "hi", "encoding_format": "int8"}, "invalid_value",
               r"'encoding_format': must be \"float\" or \"base64\", got \"int8\""),
    "dimensions": ({"input": "hi", "dimensions": 5}, "unsupported_parameter",
                   r"'dimensions' = 5: this model's embeddings have 12 dimensions"),
    "missing": ({"model": NAME}, "missing_required_parameter", r"Missing required parameter: 'input'"),
    "surrogate": (b'{"input": "hi \\ud800 there"}', "invalid_unicode", r"'input' holds a lone surrogate"),
    "surrogate-in-list": (b'{"input": ["ok", "\\udfff"]}', "invalid_unicode", r"'input\[1\]' holds a lone surrogate"),
    "deep": (b'{"input": ' + b"[" * 100 + b"1" + b"]" * 100 + b"}", "invalid_json", r"nested deeper than 64 levels"),
}
_PARAM = {"format": "encoding_format", "dimensions": "dimensions", "deep": None,
          "surrogate-in-list": "input[1]"}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_that_names_it_and_logs_no_traceback(engine, program, embedder, reference, caplog, case):
    body, code, message = BAD[case]
    with serving(engine, program, embedder) as srv:
        with caplog.at_level(logging.WARNING):
            r = srv.post("/v1/embeddings", body)
        _error(r, 400, code, message, _PARAM.get(case, "input"))
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info], caplog.text
        # Control: the same server embeds a good input.
        r = srv.post("/v1/embeddings", {"input": [5, 6, 7], "encoding_format": "float"})
        assert r.status_code == 200, r.text


def test_models_routes_and_the_decoder_beside_it(engine, program, embedder):
    with serving(engine, program, embedder) as srv:
        models = srv.client.get("/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(engine.manifest.model.name, 64), (NAME, 32)]
        _error(srv.post("/v1/embeddings", {"input": "hi", "model": models[0]["id"]}), 404, "model_not_found",
               r"does not exist or serves no embeddings; this server's embedding model is 'tiny-embedder'", "model")
        r = srv.post("/v1/completions", {"prompt": [5, 17, 99], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        with pytest.raises(openai.BadRequestError, match="more than the model's largest context 32"):
            _openai(srv).embeddings.create(model=NAME, input=list(range(1, 40)))
    with InProcess(engine) as srv:
        _error(srv.post("/v1/embeddings", {"input": "hi"}), 404, "model_not_found",
               r"this server serves no embedding program", None)
        assert len(srv.client.get("/v1/models").json()["data"]) == 1


@pytest.mark.numeric
def test_python_m_serve_hosts_a_decoder_and_an_embedding_program(http_artifacts, embedder, reference, program,
                                                                 serve_cache_dir, tmp_path):
    """One JAX-free process (the import guard raises on jax): completions and embeddings, float and base64."""
    srv = Server(http_artifacts[0], serve_cache_dir, tmp_path / "serve.log", "--embedding-artifact", str(embedder[0]))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        ids = [TOK.encode(t).ids for t in TEXTS]
        # The client asks for base64 and decodes it unless a format is given.
        for fmt in ({}, {"encoding_format": "float"}):
            r = client.embeddings.create(model=NAME, input=TEXTS, **fmt)
            _check_vectors([d.embedding for d in r.data], ids, reference, program, f"served process {fmt or 'base64'}")
        done = client.completions.create(model=client.models.list().data[0].id, prompt=[5, 17, 99], max_tokens=3,
                                         temperature=0)
        assert done.usage.completion_tokens == 3
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        assert srv.metrics()['tlaloc_http_requests_total{route="/v1/embeddings",status="200"}'] == 2
    finally:
        srv.stop()


@pytest.mark.parametrize("which", ["bounded-as-decoder", "decoder-as-embedding"])
def test_python_m_serve_refuses_the_wrong_kind_of_artifact_by_name(http_artifacts, embedder, which):
    args = ([str(embedder[0])] if which == "bounded-as-decoder"
            else [str(http_artifacts[0]), "--embedding-artifact", str(http_artifacts[0])])
    p = subprocess.run([sys.executable, "-c", SERVE, *args, "--port", "0"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stderr
    want = (r"no tlaloc-serving.json in the artifact directory: it holds a bounded program \(tlaloc-bounded.json\)"
            if which == "bounded-as-decoder" else
            rf"--embedding-artifact: {re.escape(str(http_artifacts[0]))}: no tlaloc-bounded.json in the artifact "
            r"directory: it holds a decoder")
    assert re.search(want, p.stderr), p.stderr
