"""bench/peers.py at the sizes people run on CPUs (`--shape 1b|3b|8b`, issue 57): the shape's bf16 shards
(bench/shapes.py), then one variant at a time: its tlaloc-jax export and its GGUF, each written by a process of its
own that reports its peak resident set and time, the rounds, then the disk the variant took, and its files deleted
before the next variant's are written (an 8B shape's GGUF and artifact are ~11 GB each at 8 bits).
"""

from __future__ import annotations

import json
import resource
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.common import disk_bytes

SHAPE_NAMES = ("1b", "3b", "8b")


def apply_shape(a) -> None:
    """The shape's dimensions on the args (the tables and the workers read them there)."""
    from bench.shapes import SHAPES, VOCAB
    s = SHAPES[a.shape]
    a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab = (
        s["hidden"], s["layers"], s["heads"], s["kv_heads"], s["intermediate"], VOCAB)


def parameters(hf: dict) -> int:
    from tlaloc_jax.checkpoint import checkpoint_tensors
    from tlaloc_jax.families import config_from_hf
    fam, cfg = config_from_hf(hf)
    return sum(int(np.prod(s)) for s in checkpoint_tensors(fam, cfg).values())


def _mem_available() -> int:
    from tlaloc_jax.serve.runtime.host_memory import mem_available
    return mem_available() or 0


def fitting_variants(a, hf: dict) -> list[str]:
    """The asked variants but f32 where its weights (4 bytes a parameter, held by each system in turn, with the
    page cache of its file beside them) pass half of MemAvailable now: the machine is shared."""
    f32 = 4 * parameters(hf)
    free = _mem_available()
    if "f32" in a.variants and f32 > free / 2:
        print(f"f32 skipped: its weights are {f32 / 2**30:.1f} GiB, more than half of MemAvailable "
              f"({free / 2**30:.1f} GiB)", flush=True)
        return [v for v in a.variants if v != "f32"]
    return list(a.variants)


def ensure_checkpoint(hf: dict, ck: Path) -> None:
    if (ck / "config.json").exists():
        return
    from bench.shapes import write_checkpoint
    t0 = time.perf_counter()
    n = write_checkpoint(hf, ck, log=lambda line: print(line, flush=True))
    print(f"checkpoint: {n / 1e9:.2f}B parameters, bf16 shards, {disk_bytes(ck) / 2**30:.1f} GiB in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)


def prepare_worker(a, work: Path, what: str) -> None:
    """In a process of its own: the variant's artifact ("export") or GGUF ("gguf"); reports its time and peak
    resident set (ru_maxrss: this process alone)."""
    from bench import peers
    projections, quant, group = peers.VARIANTS[a.variant]
    t0 = time.perf_counter()
    if what == "export":
        from tlaloc_jax.export import export_checkpoint
        export_checkpoint(work / "ck", work / f"art-{a.variant}", batch_ladder=peers.BATCHES,
                          context_ladder=(a.context,), prefill_max_batch=max(peers.BATCHES),
                          prefill_chunk=peers.PROMPT_LEN, block_size=peers.BLOCK, progress=False,
                          weight_layout=a.weight_layout, weight_quant=quant, quant_group=group,
                          head_quant=peers.HEAD_QUANT)
    else:
        peers.write_gguf(work / "ck", peers.hf_config(a), work / f"model-{a.variant}.gguf", projections)
    peers.emit(what=what, seconds=time.perf_counter() - t0,
               peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def prepare_variant(a, work: Path, v: str, base: list[str], env: dict) -> dict:
    """The variant's artifact and GGUF, each by a prepare_worker; -> their numbers. Those a --keep run left (its
    numbers in prepared-<v>.json beside them) are reused, so the rounds can run apart from the preparing."""
    record = work / f"prepared-{v}.json"
    if record.exists() and (work / f"art-{v}").is_dir() and (work / f"model-{v}.gguf").exists():
        print(f"{v}: reusing the artifact and GGUF a --keep run prepared ({record})", flush=True)
        return json.loads(record.read_text())
    shutil.rmtree(work / f"art-{v}", ignore_errors=True)
    out = {}
    for what in ("export", "gguf"):
        p = subprocess.run(base + ["--prepare", what, "--variants", v], env=env, capture_output=True, text=True)
        got = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode or not got:
            raise SystemExit(f"{what} of {v} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
        out[what] = got[0]
    out["disk"] = dict(artifact=disk_bytes(work / f"art-{v}"), gguf=disk_bytes(work / f"model-{v}.gguf"))
    e, g = out["export"], out["gguf"]
    print(f"{v}: tlaloc-jax export {e['seconds']:.0f} s, peak resident set {e['peak_rss'] / 2**30:.2f} GiB, artifact "
          f"{out['disk']['artifact'] / 2**30:.2f} GiB; GGUF (streamed) {g['seconds']:.0f} s, peak resident set "
          f"{g['peak_rss'] / 2**30:.2f} GiB, file {out['disk']['gguf'] / 2**30:.2f} GiB", flush=True)
    record.write_text(json.dumps(out))
    return out


def drop_variant(work: Path, v: str) -> None:
    """What only this variant needed: its artifact and its GGUF."""
    shutil.rmtree(work / f"art-{v}", ignore_errors=True)
    (work / f"model-{v}.gguf").unlink(missing_ok=True)
    (work / f"prepared-{v}.json").unlink(missing_ok=True)


def summarize_scale(a, work: Path, results: list[dict], prepared: dict[str, dict]) -> None:
    """Per variant: the export's and GGUF's peak resident set and time, each server's load time and resident set
    (the largest over its rounds), and the disk the variant took beside the checkpoint's."""
    print()
    print("variant | export s | export peak GiB | GGUF s | GGUF peak GiB | disk GiB (artifact + GGUF) | system | "
          "load s | resident at load GiB | resident at end GiB | tlaloc-jax bound GiB")
    for v, prep in prepared.items():
        e, g, d = prep["export"], prep["gguf"], prep["disk"]
        for name in ("llama.cpp", "tlaloc-jax"):
            rs = [r for r in results if r["system"] == name and r["variant"] == v]
            bound = f"{rs[0]['bound'] / 2**30:.2f}" if rs and "bound" in rs[0] else "-"
            print(f"{v:>7} | {e['seconds']:8.0f} | {e['peak_rss'] / 2**30:14.2f} | {g['seconds']:6.0f} | "
                  f"{g['peak_rss'] / 2**30:13.2f} | {(d['artifact'] + d['gguf']) / 2**30:26.2f} | {name:>10} | "
                  f"{statistics.median(r['load_s'] for r in rs):6.1f} | "
                  f"{max(r['rss_load'] for r in rs) / 2**30:20.2f} | {max(r['rss_end'] for r in rs) / 2**30:19.2f} | "
                  f"{bound}")
    print(f"checkpoint (bf16 shards): {disk_bytes(work / 'ck') / 2**30:.1f} GiB, kept in {work / 'ck'}")


def resident() -> int:
    from tlaloc_jax.serve.runtime.host_memory import resident_bytes
    return resident_bytes() or 0
