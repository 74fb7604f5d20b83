"""Prefix-cache isolation (issue 55, finding 4): a request's cache_salt enters its first page's hash, so requests with
different salts (or a salt and none) share no KV page and no state snapshot, while requests with the same salt do;
and /metrics, whose prefix-cache counters show hits, needs the API key when the server has one.

Each isolation check has its control: the same salt (or none on both sides) shares the prefix. The probe is the
issue's: the same prefix from two clients over HTTP, with and without salts, read off vllm:prefix_cache_hits_total.
"""

from __future__ import annotations

import numpy as np
import pytest
from starlette.testclient import TestClient

from http_util import InProcess, loaded
from tlaloc_jax import artifact as af
from tlaloc_jax.serve import Engine, RequestRefused
from tlaloc_jax.serve.core import kv_cache
from tlaloc_jax.serve.core.prefix_cache import PrefixCache
from tlaloc_jax.serve.core.request import Request
from tlaloc_jax.serve.host_sampling import GREEDY

PAGED, STATE = af.PoolKind.PAGED_KV, af.PoolKind.STATE_SLOTS
KEY = "sk-salt-test"
# (first client's salt, second client's salt, whether the second shares the first's prefix pages)
PAIRS = {"different salts": ("alice", "bob", False), "no salt, then a salt": (None, "bob", False),
         "a salt, then none": ("alice", None, False), "control: same salt": ("alice", "alice", True),
         "control: no salt on both": (None, None, True)}


def _prefix(k: int) -> list[int]:
    """32 tokens (four pages of 8) that no other case of the module uses."""
    return [(i * 31 + 17 * k + 5) % 240 + 3 for i in range(32)]


@pytest.fixture(scope="module")
def engines(http_artifacts, serve_cache_dir):
    """(cached, uncached): the text artifact with prefix caching on, and off (the ids oracle)."""
    with loaded(http_artifacts[0], serve_cache_dir) as cached, \
            Engine.load(http_artifacts[0], cache_dir=serve_cache_dir, progress=False,
                        enable_prefix_caching=False) as uncached:
        yield cached, uncached


def _two_clients(cached, uncached, salt_a, salt_b, k: int) -> tuple[set[int], int]:
    """Client A's prompt is read and decoding when client B sends the same 32-token prefix -> (the pages both hold
    after B's first step, the positions B found in the prefix cache). Both must get their solo ids."""
    prefix = _prefix(k)
    prompt_a, prompt_b = prefix + [11, 12, 13], prefix + [200, 3]
    want = uncached.generate([prompt_a], 12)[0], uncached.generate([prompt_b], 12)[0]
    a = cached.add_request(prompt_a, 12, cache_salt=salt_a)
    while not cached.request_info(a).generated:
        cached.step()
    hits = cached.stats()["prefix_hits"]
    b = cached.add_request(prompt_b, 12, cache_salt=salt_b)
    cached.step()
    pages_a, pages_b = (cached.request_info(r).held[PAGED] for r in (a, b))
    common = set(pages_a) & set(pages_b)
    if common:
        assert pages_b[:4] == pages_a[:4] and common == set(pages_a[:4])
        assert all(cached.scheduler.kv.pools[PAGED].holders(u) == 2 for u in common)
    hits = cached.stats()["prefix_hits"] - hits
    while cached.has_unfinished():
        cached.step()
    assert (cached.output(a), cached.output(b)) == want
    for r in (a, b):
        cached.release(r)
    assert cached.stats()["pages_in_use"] == 0
    return common, hits


@pytest.mark.parametrize("case", list(PAIRS))
def test_two_clients_with_different_salts_share_no_pages(engines, case):
    """B's page table holds none of A's pages and the prefix-cache counters show no hit, unless both sent the same
    salt (or none): then B holds A's four prefix pages (two holders each) and hits their 32 positions."""
    salt_a, salt_b, shares = PAIRS[case]
    common, hits = _two_clients(*engines, salt_a, salt_b, list(PAIRS).index(case))
    assert (len(common), hits) == ((4, 32) if shares else (0, 0))


def test_control_a_salt_left_out_of_the_hash_is_caught(engines, monkeypatch):
    """With the salt left out of the first page's hash (the bug), clients with different salts share the pages: the
    check above fails."""
    monkeypatch.setattr(kv_cache, "salted_root", lambda root, salt: root)
    common, hits = _two_clients(*engines, "alice", "bob", len(PAIRS))
    assert (len(common), hits) == (4, 32)


@pytest.mark.parametrize("salt", ["", 3, b"alice", ["a"]], ids=["empty", "int", "bytes", "list"])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_refused_by_name(engines, salt):
    """Engine.add_request refuses it (RequestRefused naming cache_salt) and a running sequence keeps its ids."""
    cached, uncached = engines
    prompt = _prefix(9)[:10]
    want = uncached.generate([prompt], 10)[0]
    running = cached.add_request(prompt, 10)
    cached.step()
    with pytest.raises(RequestRefused, match=r"cache_salt must be a non-empty string") as e:
        cached.add_request(prompt, 10, cache_salt=salt)
    assert e.value.kind == "bad_request"
    assert cached.active_requests() == [running]
    while cached.has_unfinished():
        cached.step()
    assert cached.output(running) == want
    cached.release(running)


def _sequence(prompt: list[int], salt: str | None, pools: dict) -> Request:
    return Request("r", prompt, 4, frozenset(), GREEDY, np.random.default_rng(0), {kind: [] for kind in pools}, 0.0,
                   cache_salt=salt)


def _snapshot_lookup(salt_a: str | None, salt_b: str | None) -> tuple[bool, bool, int]:
    """A hybrid model's prefix cache: sequence A reads 8 positions (two pages of 4) and leaves a state snapshot at the
    page boundary; B, with the same 10 tokens, looks them up -> (B found A's two pages, B found A's snapshot, the
    positions B skips)."""
    pools = {PAGED: kv_cache.UnitPool(8, "KV"), STATE: kv_cache.UnitPool(4, "state", "slots")}
    cache = PrefixCache(pools, 4, kv_cache.artifact_seed("artifact"), snapshots=True)
    prompt = list(range(3, 13))
    a = _sequence(prompt, salt_a, pools)
    a.held = {PAGED: pools[PAGED].take(3), STATE: pools[STATE].take(1)}
    a.computed = 8
    cache.written(a, 8, reading_prompt=True)
    copies = cache.snapshot_copies()
    assert len(copies) == 1
    cache.commit(copies, ok=True)
    hit = cache.lookup(_sequence(prompt, salt_b, pools))
    cache.give_back(hit)
    return hit.pages == a.held[PAGED][:2], hit.snapshot == copies[0].dst, hit.length


@pytest.mark.parametrize("case", list(PAIRS))
def test_state_snapshots_are_salted_like_the_pages(case):
    """B finds neither A's pages nor its state snapshot unless their salts match (then both, and skips 8)."""
    salt_a, salt_b, shares = PAIRS[case]
    assert _snapshot_lookup(salt_a, salt_b) == ((True, True, 8) if shares else (False, False, 0))


def test_control_an_unsalted_snapshot_is_caught(monkeypatch):
    monkeypatch.setattr(kv_cache, "salted_root", lambda root, salt: root)
    assert _snapshot_lookup("alice", "bob") == (True, True, 8)


def _hits(srv: InProcess) -> float:
    """vllm:prefix_cache_hits_total as /metrics shows it."""
    text = srv.client.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_the_probe_a_salted_clients_prompt_is_not_observable_by_another(engines, route):
    """The issue's probe: client A sends a prompt with a salt; client B sends the same prefix with another salt,
    then without one, and sees no prefix-cache hit; A again (the control) hits its own prefix."""
    cached, _ = engines
    chat = route == "/v1/chat/completions"
    secret = "launch code 0000."       # with the chat template's tokens, two pages (completions) or four (chat)

    def send(salt, tail):
        body = {"max_tokens": 2, "temperature": 0}
        if chat:
            body["messages"] = [{"role": "system", "content": secret}, {"role": "user", "content": tail}]
        else:
            body["prompt"] = secret + tail
        if salt is not None:
            body["cache_salt"] = salt
        before = _hits(srv)
        r = srv.post(route, body)
        assert r.status_code == 200, r.text
        return _hits(srv) - before

    with InProcess(cached) as srv:
        send("alice", "hello")
        assert send("bob", "code?") == 0
        assert send(None, "code?") == 0
        assert send("alice", "code?") >= 16       # control: the same salt hits its prefix


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt", ["", 7, None, ["a"], {"a": 1}, True], ids=["empty", "int", "null", "list", "object",
                                                                           "bool"])
def test_a_bad_cache_salt_is_answered_400_naming_it(engines, route, salt):
    """Over HTTP: 400 invalid_type or invalid_value with param cache_salt; null is the same as leaving it out."""
    cached, _ = engines
    body = {"max_tokens": 2, "cache_salt": salt}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"})
    with InProcess(cached) as srv:
        r = srv.post(route, body)
        if salt is None:
            assert r.status_code == 200, r.text
            return
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "cache_salt" and err["code"] == ("invalid_value" if salt == "" else "invalid_type")
        assert "'cache_salt'" in err["message"]
        assert srv.wait_idle() == {"running": 0, "waiting": 0, "kv_in_use": 0}


@pytest.mark.parametrize("open_metrics", [False, True], ids=["metrics need the key", "--metrics-without-key"])
def test_metrics_need_the_api_key_unless_left_open_and_health_never_does(engines, open_metrics):
    cached, _ = engines
    auth = {"Authorization": f"Bearer {KEY}"}
    with InProcess(cached, api_key=KEY, metrics_without_key=open_metrics) as srv:
        assert srv.client.get("/health").status_code == 200
        assert srv.client.get("/v1/models").status_code == 401
        r = srv.client.get("/metrics", headers=auth)
        assert r.status_code == 200 and "vllm:prefix_cache_hits_total" in r.text
        for headers in (None, {"Authorization": "Bearer sk-wrong"}):
            r = srv.client.get("/metrics", headers=headers)
            if open_metrics:
                assert r.status_code == 200 and "vllm:prefix_cache_hits_total" in r.text
            else:
                assert r.status_code == 401, r.text
                assert r.json()["error"]["code"] == "invalid_api_key" and "vllm:" not in r.text
    with InProcess(cached) as srv:           # no key: /metrics stays open
        assert srv.client.get("/metrics").status_code == 200


@pytest.mark.parametrize("flag", [False, True], ids=["--api-key", "--api-key --metrics-without-key"])
def test_the_command_line_puts_metrics_behind_the_key(http_artifacts, serve_cache_dir, monkeypatch, flag):
    """`python -m tlaloc_jax.serve --api-key KEY [--metrics-without-key]`: the app it would serve answers /metrics
    401 without the key (200 with the flag) and /health 200."""
    from tlaloc_jax.serve import __main__ as cli
    answers = {}

    class Answering:
        """In place of uvicorn's server: asks the app, then ends as a clean shutdown would."""

        def __init__(self, uvicorn, config):
            self.app, self.started = config.app, True

        def run(self):
            with TestClient(self.app, base_url="http://localhost") as c:
                answers.update({p: c.get(p).status_code for p in ("/metrics", "/health")})

    monkeypatch.setattr(cli, "_uvicorn_server", Answering)
    monkeypatch.setattr(cli, "freeze_heap", lambda: 0)
    # --lazy-compile: /health answers 200 at once (by default it is 503 until every entry is compiled)
    argv = [str(http_artifacts[0]), "--cache-dir", str(serve_cache_dir), "--no-progress", "--lazy-compile",
            "--api-key", KEY]
    assert cli.main(argv + ["--metrics-without-key"] * flag) == 0
    assert answers == {"/metrics": 200 if flag else 401, "/health": 200}
