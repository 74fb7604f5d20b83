"""Drives vLLM (LLM.generate) on a tlaloc artifact as a JSON spec says and writes what it saw as JSON. Runs in the
vLLM environment (.venv-vllm: vLLM and torch, no JAX), started by tests/integrations/test_vllm.py:

    VLLM_PLUGINS=tlaloc python tests/support/vllm_driver.py SPEC.json OUT.json

spec: {"artifact": dir, "llm": LLM keyword arguments, "refusals": [engine-argument dicts, each expected to be
refused at start-up], "runs": [{"name", "requests": [{"prompt": ids, "max_tokens": n, "sampling": {...},
"lora": [name, int id, path] (vLLM's LoRARequest; absent: none)}], "rotate_pages": bool,
"swap_lora_slots": bool}]}. out: {"refusals": [error text], "runs": {name: {"ids", "cached", "stats"}}}: each run's
ids per request, prompt tokens vLLM's prefix cache held, and the worker's counters over the run.

rotate_pages is the control: every row reads its pages rotated by one (the engine core runs in this process,
VLLM_ENABLE_V1_MULTIPROCESSING=0, so the patch reaches the worker), so its ids must part from the artifact's.
swap_lora_slots, LoRA's control (the same way in): each call's rows take their adapter slots in reverse row order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    from tlaloc_jax.serve.integrations.vllm import runtime

    out = {"refusals": [], "runs": {}}
    for args in spec.get("refusals", []):
        try:
            EngineArgs(model=spec["artifact"], config_format="tlaloc", **args).create_engine_config()
            out["refusals"].append(None)
        except Exception as e:           # noqa: BLE001 - the test reads the message
            out["refusals"].append(f"{type(e).__name__}: {e}")
    if not spec.get("runs"):
        return _write(out_path, out)

    from vllm.lora.request import LoRARequest

    rotate = {"on": False, "swap": False}
    run = runtime.ArtifactRuntime.run

    def maybe_rotated(self, entry, rows, **kw):
        if rotate["on"]:
            rows = [dataclasses.replace(r, pages=list(r.pages[1:]) + list(r.pages[:1])) for r in rows]
        if rotate["swap"]:
            rows = [dataclasses.replace(r, lora_slot=s.lora_slot) for r, s in zip(rows, reversed(rows))]
        return run(self, entry, rows, **kw)

    runtime.ArtifactRuntime.run = maybe_rotated
    llm = LLM(model=spec["artifact"], config_format="tlaloc", **spec.get("llm", {}))
    for r in spec["runs"]:
        rotate["on"], rotate["swap"] = r.get("rotate_pages", False), r.get("swap_lora_slots", False)
        if (rotate["on"] or rotate["swap"]) and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise SystemExit("rotate_pages and swap_lora_slots need the engine core in this process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        before = llm.collective_rpc("tlaloc_stats")[0]
        prompts = [{"prompt_token_ids": q["prompt"]} for q in r["requests"]]
        params = [SamplingParams(max_tokens=q["max_tokens"], ignore_eos=True, **q.get("sampling", {}))
                  for q in r["requests"]]
        loras = [LoRARequest(*q["lora"]) if q.get("lora") else None for q in r["requests"]]
        got = llm.generate(prompts, params, use_tqdm=False, lora_request=loras if any(loras) else None)
        after = llm.collective_rpc("tlaloc_stats")[0]
        out["runs"][r["name"]] = {"ids": [list(g.outputs[0].token_ids) for g in got],
                                  "cached": [g.num_cached_tokens or 0 for g in got],
                                  "logprobs": [_logprobs(g) for g in got],
                                  "stats": _delta(before, after)}
    _write(out_path, out)


def _logprobs(g) -> list | None:
    lps = g.outputs[0].logprobs
    if lps is None:
        return None
    return [{str(t): lp.logprob for t, lp in step.items()} for step in lps]


def _delta(before: dict, after: dict) -> dict:
    out = {}
    for k, v in after.items():
        if isinstance(v, dict):
            out[k] = {kk: vv - before[k].get(kk, 0) for kk, vv in v.items() if vv != before[k].get(kk, 0)}
        else:
            out[k] = v - before[k]
    return out


def _write(path: str, out: dict) -> None:
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
