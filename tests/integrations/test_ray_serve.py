"""The OpenAI server as a Ray Serve application (serve/integrations/ray.py): a local Ray head on loopback, two replicas of the
tiny ids artifact of tests/support/http_util.py, driven through Ray's HTTP proxy by the official openai client. The oracle
for every generated id is the in-process Engine on the same artifact (Engine.generate, solo).

Needs the `ray` extra (`pip install -e '.[ray]'`; `make test-engines` installs it and runs this file)."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import socket
import time

import httpx
import openai
import pytest
from http_util import loaded, solo_runner
from tokenizers_util import EOS

if importlib.util.find_spec("ray") is None:
    pytest.skip("the `ray` extra is not installed (pip install -e '.[ray]')", allow_module_level=True)

# Ray's single-machine mode: every Ray process (GCS, raylet, workers, the HTTP proxy) on 127.0.0.1 rather than
# the machine's network address. Read when ray is imported (in the fixture: collecting this module imports no Ray),
# and inherited by the processes it starts.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

pytestmark = pytest.mark.slow        # a Ray head and two replicas: ~1 minute; `make test-engines` runs it

APP = "tlaloc"
# Sequences a replica runs at once (the artifact's decode batches are 1 and 8): 16 requests over two replicas
# share decode calls, and each replica also holds requests waiting their turn.
MAX_BATCH = 4
REPLICA = "x-tlaloc-replica"        # serve/integrations/ray.py REPLICA_HEADER
STOP = [EOS]
# 16 prompts of distinct lengths and ids: the 16 streams are told apart by their ids.
PROMPTS = [[(7 * i + 3 * k) % 250 + 1 for k in range(3 + i % 5)] for i in range(16)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ids_artifact(http_artifacts):
    return http_artifacts[1]


@pytest.fixture(scope="module")
def solo(ids_artifact, serve_cache_dir):
    """prompt ids, max_tokens -> the ids Engine.generate gives that prompt alone (greedy)."""
    with loaded(ids_artifact, serve_cache_dir) as engine:
        yield solo_runner(engine, STOP)


@pytest.fixture(scope="module")
def ray_app(ids_artifact, serve_cache_dir):
    """The application on a local Ray head bound to loopback: its base url."""
    import ray
    from ray import serve
    from tlaloc_jax.serve.ray import REPLICA_HEADER, app
    assert REPLICA_HEADER.decode() == REPLICA
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app({"artifact": str(ids_artifact), "num_replicas": 2, "cache_dir": str(serve_cache_dir),
                       "max_batch": MAX_BATCH,
                       "health_check_period_s": 1, "health_check_timeout_s": 30}),
                  name=APP, route_prefix="/")
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_states() -> dict:
    from ray import serve
    return serve.status().applications[APP].deployments["tlaloc"].replica_states


def _kill_replica(replica: str) -> None:
    import ray
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{replica}")]
    assert len(names) == 1, f"replica {replica}: actors {names}"
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


async def _stream(client, prompt, max_tokens, seen: list | None = None, both: asyncio.Event | None = None):
    """replica, ids, finish reason (and the error, if the request or its stream failed) of one streaming request.
    The replica (None if the request failed before an answer began) is noted in `seen` as soon as the answer's
    headers arrive; `both` is set once two replicas have answered."""
    out = {"replica": None, "ids": [], "finish": None}
    try:
        raw = await client.completions.with_raw_response.create(model="ck", prompt=prompt, max_tokens=max_tokens,
                                                                temperature=0, stream=True)
        out["replica"] = raw.headers.get(REPLICA)
        if seen is not None:
            seen.append(out["replica"])
            if len(set(seen)) == 2:
                both.set()
        stream = raw.parse()
        if inspect.isawaitable(stream):
            stream = await stream
        async for chunk in stream:
            ch = chunk.choices[0]
            out["ids"] += (ch.model_extra or {}).get("token_ids") or []
            out["finish"] = ch.finish_reason or out["finish"]
    except (openai.APIError, httpx.HTTPError) as e:     # the request or its stream broke
        out["error"] = e
    return out


def test_builder_args_are_checked():
    from tlaloc_jax.serve.ray import RayServeArgs
    with pytest.raises(ValueError, match="num_replicas is a fixed count"):
        RayServeArgs(artifact="a", num_replicas=2, max_replicas=4)
    with pytest.raises(ValueError, match="not both"):
        RayServeArgs(artifact="a", min_replicas=1, autoscaling_config={"max_replicas": 2})
    assert RayServeArgs(artifact="a", min_replicas="1", max_replicas="3").autoscaling() == \
        {"min_replicas": 1, "max_replicas": 3}
    assert RayServeArgs(artifact="a", allowed_origins="https://a.example, https://b.example").allowed_origins == \
        ["https://a.example", "https://b.example"]
    with pytest.raises(ValueError, match="unknown_option"):
        RayServeArgs(artifact="a", unknown_option=1)


def test_a_replica_of_a_tensor_parallel_cuda_artifact_owns_its_gpus():
    """num_gpus defaults to the GPUs a cuda artifact's mesh runs on (none for cpu); fewer is refused by name."""
    from types import SimpleNamespace

    from tlaloc_jax.serve.ray import replica_gpus
    cuda4 = SimpleNamespace(devices=4, versions=SimpleNamespace(platform="cuda"))
    cpu2 = SimpleNamespace(devices=2, versions=SimpleNamespace(platform="cpu"))
    assert replica_gpus(cuda4, None) == 4 and replica_gpus(cuda4, 8) == 8 and replica_gpus(cpu2, None) == 0
    with pytest.raises(ValueError, match="runs on 4 GPUs .* num_gpus=4, not 2"):
        replica_gpus(cuda4, 2)


def test_check_health_raises_what_health_answers():
    """Ray calls a replica's check_health; it fails with the reason /health gives (_Server.health_problem, tested
    against a stopped engine loop in test_http_hardening), and passes while there is none."""
    from types import SimpleNamespace

    from tlaloc_jax.serve.ray import OpenAIReplica
    check = OpenAIReplica.func_or_class.check_health
    assert asyncio.run(check(SimpleNamespace(server=SimpleNamespace(health_problem=lambda: None)))) is None
    with pytest.raises(RuntimeError, match="engine loop not running"):
        asyncio.run(check(SimpleNamespace(server=SimpleNamespace(health_problem=lambda: "engine loop not running"))))


def test_sixteen_concurrent_streams_over_two_replicas_get_their_solo_ids(ray_app, solo):
    wants = [solo(p, 24) for p in PROMPTS]

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{ray_app}/v1", api_key="none", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(_stream(c, p, 24) for p in PROMPTS))

    got = asyncio.run(main())
    assert [g.get("error") for g in got] == [None] * 16
    assert [g["ids"] for g in got] == wants
    # Control: the check tells the streams apart (each prompt's ids differ from its neighbour's).
    assert [g["ids"] for g in got] != wants[1:] + wants[:1]
    assert {g["replica"] for g in got} == set(_replica_ids()), "both replicas served"


def _replica_ids() -> list[str]:
    import ray
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and f"{APP}#tlaloc#" in a["name"]]
    return [n.rsplit("#", 1)[1] for n in names]


def test_killing_a_replica_fails_only_its_own_requests_and_ray_restarts_it(ray_app, solo):
    max_tokens = 56
    wants = [solo(p, max_tokens) for p in PROMPTS]
    before = set(_replica_ids())
    assert len(before) == 2

    async def main():
        both = asyncio.Event()
        seen: list[str] = []
        async with openai.AsyncOpenAI(base_url=f"{ray_app}/v1", api_key="none", max_retries=0, timeout=120) as c:
            tasks = [asyncio.ensure_future(_stream(c, p, max_tokens, seen, both)) for p in PROMPTS]
            # Both replicas have begun answering. The one that began last is killed: its first sequences have
            # just started their 56 tokens, and its later ones wait their turn (MAX_BATCH at a time).
            await asyncio.wait_for(both.wait(), 120)
            victim = seen[-1]
            _kill_replica(victim)
            return victim, await asyncio.gather(*tasks)

    victim, got = asyncio.run(main())
    survivor = (before - {victim}).pop()
    on_survivor = [k for k, g in enumerate(got) if g["replica"] == survivor]
    assert on_survivor, "the surviving replica answered nothing"
    # Every request the surviving replica answered ran to its solo ids.
    assert [got[k].get("error") for k in on_survivor] == [None] * len(on_survivor)
    assert [got[k]["ids"] for k in on_survivor] == [wants[k] for k in on_survivor]
    # The others were the victim's: those it had begun answering, and those still waiting in its queue (they never
    # got an answer: the surviving replica, alive throughout, answers every request routed to it). They failed
    # (none of them ended with a finish reason), and what a stream received before the kill is the start of its
    # solo ids.
    others = [k for k in range(len(PROMPTS)) if k not in on_survivor]
    assert {got[k]["replica"] for k in others} <= {victim, None}
    failed = [k for k in others if "error" in got[k] or got[k]["finish"] is None]
    assert failed, "the kill came after the victim's requests had finished: it was not mid-run"
    for k in others:
        assert got[k]["ids"] == wants[k][:len(got[k]["ids"])]

    # Ray replaces the replica: two running replicas again, one of them new, and it serves.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = set(_replica_ids())
        if _replica_states().get("RUNNING") == 2 and len(now) == 2 and now != before:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"Ray did not restart the replica: {_replica_states()}, replicas {_replica_ids()}")
    assert victim not in now and len(now & before) == 1

    async def again():
        async with openai.AsyncOpenAI(base_url=f"{ray_app}/v1", api_key="none", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(_stream(c, p, 24) for p in PROMPTS))

    got = asyncio.run(again())
    assert [g["ids"] for g in got] == [solo(p, 24) for p in PROMPTS]
    assert {g["replica"] for g in got} == now
