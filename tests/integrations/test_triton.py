"""The artifact as a decoupled NVIDIA Triton model (serve/integrations/triton.py, through PyTriton): `python -m
tlaloc_jax.serve.triton` on loopback ports, driven by Triton's own client library (tritonclient) over gRPC and HTTP.
The oracle for every generated id is the in-process Engine on the same artifact (Engine.generate).

PyTriton 0.7.0 requires numpy < 2 and JAX 0.10.2 numpy >= 2, so the server runs in a second, JAX-free environment
(`make test-engines` builds it as .venv-triton; $TLALOC_TRITON_PYTHON names another) while this test, which exports
the artifact with JAX, runs in the project's. Needs the `triton-client` extra here."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="the `triton-client` extra is not installed "
                                                             "(pip install -e '.[triton-client]')")
httpclient = pytest.importorskip("tritonclient.http", reason="the `triton-client` extra is not installed")
from http_util import LADDER, loaded
from process_util import wait_ready
from tlaloc_jax.serve import Sampling
from tokenizers_util import EOS
from tritonclient.utils import InferenceServerException

ROOT = Path(__file__).resolve().parents[2]
TRITON_PYTHON = Path(os.environ.get("TLALOC_TRITON_PYTHON", ROOT / ".venv-triton" / "bin" / "python"))
if not TRITON_PYTHON.exists():
    pytest.skip(f"no PyTriton environment at {TRITON_PYTHON} (`make test-engines` builds .venv-triton; "
                "$TLALOC_TRITON_PYTHON names another)", allow_module_level=True)

pytestmark = pytest.mark.slow        # starts a Triton server: ~40 s; `make test-engines` runs it

MODEL = "ck"
PROMPTS = [[5, 17, 99, 3], [250, 8, 61], [1, 2, 3, 4, 5, 6, 7], [42], [100, 200, 7, 9, 11], [77, 78]]
BAD_ID = 99999
STOP = [EOS]            # the checkpoint's eos (tests/support/http_util.py): the model stops on it, so the oracle does too


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def ids_artifact(http_artifacts):
    return http_artifacts[1]


@pytest.fixture(scope="module")
def engine(ids_artifact, serve_cache_dir):
    with loaded(ids_artifact, serve_cache_dir) as eng:
        yield eng


@contextlib.contextmanager
def serving(artifact, tmp_path_factory):
    """(http url, grpc url) of a Triton server serving `artifact`, stopped (and its exit checked) on leaving."""
    http, grpc, metrics = _free_ports(3)
    log = tmp_path_factory.mktemp("triton") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(TRITON_PYTHON), "-m", "tlaloc_jax.serve.triton", str(artifact),
                                 "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                 "--cache-dir", str(tmp_path_factory.mktemp("triton-executables")),
                                 "--log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    urls = (f"127.0.0.1:{http}", f"127.0.0.1:{grpc}")
    try:
        client = httpclient.InferenceServerClient(urls[0])
        wait_ready(proc, lambda: client.is_model_ready(MODEL), log, "triton server", timeout=240,
                   errors=(InferenceServerException, OSError))
        yield urls
    finally:
        proc.send_signal(signal.SIGTERM)       # the server stops Triton and its model process, then exits
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def triton(ids_artifact, tmp_path_factory):
    """(http url, grpc url) of the Triton server serving the ids artifact."""
    with serving(ids_artifact, tmp_path_factory) as urls:
        yield urls


def _inputs(prompt, max_tokens, **params):
    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t
    out = [tensor("prompt_ids", np.asarray(prompt, np.int64), "INT64"),
           tensor("max_tokens", np.asarray([max_tokens], np.int32), "INT32")]
    for name, value in params.items():
        kind = {"temperature": (np.float32, "FP32"), "top_p": (np.float32, "FP32"), "top_k": (np.int32, "INT32"),
                "seed": (np.int64, "INT64")}[name]
        out.append(tensor(name, np.asarray([value], kind[0]), kind[1]))
    return out


def _stream(grpc_url: str, requests: dict[str, tuple]) -> dict[str, dict]:
    """Send every request on one gRPC stream at once; per request id: ids, responses, finish reason, error."""
    got = {rid: {"ids": [], "responses": 0, "finish": None, "error": None} for rid in requests}
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for rid, (prompt, max_tokens, params) in requests.items():
            client.async_stream_infer(MODEL, _inputs(prompt, max_tokens, **params), request_id=rid,
                                      enable_empty_final_response=True)
        open_ = set(requests)
        while open_:
            result, error = answers.get(timeout=120)
            if error is not None:
                # A failed request's error names no request id in the stream callback: match it by message.
                rid = next(r for r in sorted(open_) if requests[r][0] and BAD_ID in requests[r][0])
                got[rid]["error"] = str(error)
                open_.discard(rid)
                continue
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            if response.outputs:
                got[response.id]["ids"] += result.as_numpy("token_ids").tolist()
                got[response.id]["responses"] += 1
                reason = result.as_numpy("finish_reason")[0].decode()
                got[response.id]["finish"] = reason or got[response.id]["finish"]
            if final:
                open_.discard(response.id)
    finally:
        client.stop_stream()
        client.close()
    return got


def test_the_model_config_says_decoupled(triton):
    configs = [httpclient.InferenceServerClient(triton[0]).get_model_config(MODEL),
               grpcclient.InferenceServerClient(triton[1]).get_model_config(MODEL, as_json=True)["config"]]
    for config in configs:
        assert config["model_transaction_policy"] == {"decoupled": True}, config
        assert int(config.get("max_batch_size", 0)) == 0, config      # the engine batches, not Triton


def test_grpc_streams_engine_generate_ids_for_several_prompts_at_once(triton, engine):
    wants = engine.generate(PROMPTS, 20, stop_token_ids=STOP)
    got = _stream(triton[1], {f"r{k}": (p, 20, {}) for k, p in enumerate(PROMPTS)})
    ids = [got[f"r{k}"]["ids"] for k in range(len(PROMPTS))]
    assert ids == wants
    # Control: the check tells the prompts apart.
    assert ids != wants[1:] + wants[:1]
    for k, want in enumerate(wants):
        g = got[f"r{k}"]
        assert g["error"] is None
        assert g["responses"] == len(want) > 1, "streamed: one response per engine step"
        assert g["finish"] == ("stop" if want[-1] in STOP else "length")


def test_sampling_parameters_reach_the_engine(triton, engine):
    params = {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 11}
    want = engine.generate([PROMPTS[0]], 16, sampling=Sampling(**params), stop_token_ids=STOP)[0]
    greedy = engine.generate([PROMPTS[0]], 16, stop_token_ids=STOP)[0]
    got = _stream(triton[1], {"s": (PROMPTS[0], 16, params), "g": (PROMPTS[0], 16, {})})
    assert got["s"]["ids"] == want and got["g"]["ids"] == greedy
    assert want != greedy       # control: the sampled run is not the greedy one


def test_a_bad_request_gets_the_engines_message_and_the_others_run(triton, engine):
    refused = None
    try:
        engine.add_request([5, BAD_ID], 4)
    except ValueError as e:
        refused = str(e)
    assert refused and "outside the vocabulary" in refused
    wants = engine.generate(PROMPTS[:2], 12, stop_token_ids=STOP)
    got = _stream(triton[1], {"a": (PROMPTS[0], 12, {}), "bad": ([5, BAD_ID], 4, {}), "b": (PROMPTS[1], 12, {})})
    assert refused in got["bad"]["error"]
    assert [got["a"]["ids"], got["b"]["ids"]] == wants


def test_http_serves_the_model_and_refuses_decoupled_infer(triton):
    client = httpclient.InferenceServerClient(triton[0])
    assert client.is_server_live() and client.is_model_ready(MODEL)
    meta = client.get_model_metadata(MODEL)
    assert {i["name"] for i in meta["inputs"]} >= {"prompt_ids", "max_tokens", "temperature", "seed"}
    assert [o["name"] for o in meta["outputs"]] == ["token_ids", "finish_reason"]
    t = httpclient.InferInput("prompt_ids", [3], "INT64")
    t.set_data_from_numpy(np.asarray([5, 17, 99], np.int64))
    with pytest.raises(InferenceServerException, match="decoupled"):
        client.infer(MODEL, [t])


def test_http_generate_stream_gives_the_same_ids(triton, engine):
    """Triton's HTTP generate extension streams a decoupled model as server-sent events (not in tritonclient)."""
    import httpx
    want = engine.generate([PROMPTS[2]], 10, stop_token_ids=STOP)[0]
    ids = []
    with httpx.stream("POST", f"http://{triton[0]}/v2/models/{MODEL}/generate_stream",
                      json={"prompt_ids": PROMPTS[2], "max_tokens": 10}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                t = event["token_ids"]
                ids += t if isinstance(t, list) else [t]
    assert ids == want


def test_a_two_device_artifact_streams_its_engines_ids(ids_artifact, tmp_path_factory, serve_cache_dir):
    """docs/multi-device.md: Triton serves a tensor-parallel artifact unchanged, its runtime one client of 2 devices
    in the JAX-free environment."""
    from tlaloc_jax.export import export_checkpoint
    art = tmp_path_factory.mktemp("tp2") / "art"
    export_checkpoint(Path(ids_artifact).parent / "ck", art, tensor_parallel=2, **LADDER)
    with loaded(art, serve_cache_dir) as eng:
        assert eng.stats()["devices"] == 2
        wants = eng.generate(PROMPTS, 20, stop_token_ids=STOP)
    with serving(art, tmp_path_factory) as urls:
        got = _stream(urls[1], {f"r{k}": (p, 20, {}) for k, p in enumerate(PROMPTS)})
    assert [got[f"r{k}"]["ids"] for k in range(len(PROMPTS))] == wants
