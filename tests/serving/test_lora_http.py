"""LoRA adapters over HTTP as vLLM serves them: /v1/models lists each adapter with its parent, a request's `model`
picks one (the ids the engine gives with that adapter; the answer names it), an unknown model is a 404, and the
load and unload routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING, behind --api-key, answering in vLLM's
words. --lora-modules' name=path and JSON forms."""

from __future__ import annotations

import pytest

from hf_models import build_checkpoint
from http_util import InProcess
from lora_adapters import write_peft
from tlaloc_jax.serve.lora_slots import LoraError
from tlaloc_jax.serve.openai.lora_routes import RUNTIME_UPDATING_ENV, lora_modules

PROMPT = [5, 17, 99, 3, 249, 8, 61]
KEY = "sk-lora-test"


@pytest.fixture(scope="module")
def lora_artifact(tmp_path_factory):
    from tlaloc_jax.export import export_checkpoint
    root = tmp_path_factory.mktemp("lora_http")
    ck = build_checkpoint(root / "ck", "llama", seed=62)
    paths = {n: str(write_peft(root / n, ck, seed=s, rank=2, alpha=4)) for n, s in (("a1", 1), ("a2", 2))}
    art = root / "art"
    export_checkpoint(ck, art, batch_ladder=(1, 2), context_ladder=(32,), block_size=8, prefill_chunk=16,
                      prefill_long_chunk=0, progress=False, max_loras=1, max_lora_rank=2)
    return art, paths


@pytest.fixture
def engine(lora_artifact, serve_cache_dir):
    from tlaloc_jax.serve import Engine
    art, paths = lora_artifact
    modules = {"a1": paths["a1"], "a1-json": {"path": paths["a1"], "base_model_name": "the-base"}}
    with Engine(art, progress=False, cache_dir=serve_cache_dir, lora_modules=modules) as eng:
        yield eng


def _complete(srv, model, headers=None):
    return srv.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0},
                    headers)


def test_models_list_adapters_and_model_picks_one(engine):
    want = {name: engine.generate([PROMPT], 6, lora=name)[0] for name in (None, "a1")}
    assert want[None] != want["a1"]
    with InProcess(engine, tokenizer=None, model_name="base") as srv:
        cards = {c["id"]: c for c in srv.client.get("/v1/models").json()["data"]}
        assert cards["base"]["parent"] is None
        assert cards["a1"]["parent"] == "base" and cards["a1"]["root"] == "a1"
        assert cards["a1-json"]["parent"] == "the-base"
        assert srv.client.get("/v1/models/a1").json()["id"] == "a1"
        for model, ids in (("base", want[None]), ("a1", want["a1"]), (None, want[None])):
            body = _complete(srv, model).json()
            assert body["choices"][0]["token_ids"] == ids, model
            assert body["model"] == (model or "base")
        r = _complete(srv, "a9")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "'a9' does not exist" in r.json()["error"]["message"]


def test_load_and_unload_routes_are_off_unless_enabled(engine, monkeypatch):
    monkeypatch.delenv(RUNTIME_UPDATING_ENV, raising=False)
    with InProcess(engine, tokenizer=None, model_name="base") as srv:
        r = srv.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
        assert r.status_code == 404


def test_load_and_unload_while_serving(engine, lora_artifact, monkeypatch):
    _, paths = lora_artifact
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "True")
    auth = {"Authorization": f"Bearer {KEY}"}
    with InProcess(engine, tokenizer=None, model_name="base", api_key=KEY) as srv:
        body = {"lora_name": "a2", "lora_path": paths["a2"]}
        assert srv.post("/v1/load_lora_adapter", body).status_code == 401
        r = srv.post("/v1/load_lora_adapter", body, auth)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' added successfully."
        assert srv.post("/v1/load_lora_adapter", body, auth).status_code == 400     # loaded already
        bad = srv.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/nowhere"}, auth)
        assert bad.status_code == 400 and "cannot read adapter_config.json" in bad.json()["error"]["message"]
        ids = _complete(srv, "a2", auth).json()["choices"][0]["token_ids"]
        r = srv.post("/v1/unload_lora_adapter", {"lora_name": "a2"}, auth)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' removed successfully."
        assert _complete(srv, "a2", auth).status_code == 404
        assert srv.post("/v1/unload_lora_adapter", {"lora_name": "a2"}, auth).status_code == 404
    assert engine.lora.held == 0
    engine.load_lora_adapter("a2", paths["a2"])         # the loop has stopped: the engine answers directly
    assert ids == engine.generate([PROMPT], 6, lora="a2")[0] != engine.generate([PROMPT], 6)[0]


def test_lora_modules_forms():
    assert lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == {
        "a": {"path": "/x"}, "b": {"path": "/y", "base_model_name": "m"}}
    for bad, match in (("a", "neither name=path nor JSON"), ('{"name": "b"}', "needs string 'name' and 'path'"),
                       ("{nope", "is not JSON")):
        with pytest.raises(ValueError, match=match):
            lora_modules([bad])
    with pytest.raises(ValueError, match="names 'a' twice"):
        lora_modules(["a=/x", "a=/y"])


def test_an_artifact_without_slots_refuses_adapters(http_artifacts, lora_artifact, serve_cache_dir):
    from tlaloc_jax.serve import Engine
    with pytest.raises(LoraError, match="has no LoRA adapter slots, so it cannot serve adapters \\['a1'\\]"):
        Engine(http_artifacts[1], progress=False, cache_dir=serve_cache_dir,
               lora_modules={"a1": lora_artifact[1]["a1"]})


def _lora_info(text: str):
    """The vllm:lora_requests_info samples of a /metrics text: [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
            for s in f.samples]


def test_lora_requests_info_names_running_and_waiting_adapters(engine):
    """vLLM's gauge: labels max_lora, running_lora_adapters and waiting_lora_adapters (comma-separated names of the
    adapters with requests running or waiting, in their order; base-model requests name none), its value the time
    it was read. One slot and two rows a call: a1 and the base request run, a1-json (another load) waits for the
    slot and the second a1 request for a row."""
    import time

    from prometheus_client import generate_latest

    from tlaloc_jax.serve.metrics import Metrics
    metrics = Metrics("base")
    for lora in ("a1", None, "a1-json", "a1"):
        engine.add_request(PROMPT, 6, lora=lora)
    engine.step()
    before = time.time()
    metrics.engine.snapshot = dict(engine.stats(), cold_entries=0)     # as the loop's snapshot
    (labels, value), = _lora_info(generate_latest(metrics.registry).decode())
    assert labels == {"max_lora": "1", "running_lora_adapters": "a1", "waiting_lora_adapters": "a1-json,a1"}
    assert engine.stats()["lora"]["waiting"] == {"a1-json": 1, "a1": 1}
    assert before <= value <= time.time()
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["lora"] == dict(max_lora=1, running={}, waiting={})
    with InProcess(engine, tokenizer=None, model_name="base") as srv:
        (labels, _), = _lora_info(srv.client.get("/metrics").text)
        assert labels == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
