"""tlaloc-jax against llama.cpp on one checkpoint, in one run: greedy decode at batch 1 and 4 on CPU.

Builds one random Llama (about 100M parameters by default: hidden 768, 12 layers, 12/4 heads, vocab 16000, f32),
writes it three ways -- a Hugging Face checkpoint, GGUFs for llama.cpp (written with the `gguf` package, with a
stand-in vocabulary: the checkpoint has no tokenizer, both systems are fed token ids), and tlaloc-jax serving
artifacts (default per-layer weight layout) -- in each of the variants (--variants):

  f32  an F32 GGUF                                  against the f32 artifact
  q8   the layer projections as Q8_0 (blocks of 32)  against `--weight-quant int8` (per output channel), the rest f32
  q4   the layer projections as Q4_0 (blocks of 32)  against `--weight-quant int4 --quant-group 32`, the rest f32

then measures, each system and variant in a process of its own (llama.cpp's threads spin at a barrier and
collapse when another process takes a core), the processes interleaved and their order rotated every round:

  - llama.cpp through llama-cpp-python's low-level API (llama_decode on one llama_batch holding every sequence:
    the prompts in one call, then one token per sequence per call; greedy = argmax of the returned logits);
  - the tlaloc-jax runtime through `Engine.generate`, and its decode entry alone (`Engine.runner.run`, as
    bench/decode.py times it).

Each generation is a 32-token prompt per row and 64 greedy tokens, 2 threads per system (--threads). Printed per
system and batch: tokens/s of the whole generation (B * 64 / wall time, prefill included), ms per decode step
((T(64 tokens) - T(1 token)) / 63, so prefill cancels), and each system's bare step; then the ratio
tlaloc-jax / llama.cpp of tokens/s per variant, how fast each worker's own weight pages read (the GGUF's pages
for llama.cpp, which maps the file; the runtime's weight memory for tlaloc-jax), and the agreement of the greedy
ids on f32 weights (a divergence
counts as a near-tie when llama.cpp's own top-2 logit gap there is within twice the tolerance model's bound,
tlaloc_jax/kernels/tolerances.py; past that, Hugging Face's model run in float64 on the same ids says which of the
two ids is right); the two quantizations differ (llama.cpp also rounds each activation to Q8_0 in its
quantized dots), so a quantized variant's ids are compared with the same system's f32 ids instead.

Optional dependencies, not in `make test`: `make peers-env` builds llama.cpp as a shared library alone (2-6
minutes on 2 cores) into .peers/ and installs the bindings and gguf into .venv; this script finds the library
there. `pip install -e '.[peers]'` builds llama.cpp from the llama-cpp-python sdist instead (about 30 minutes on 2
cores). With llama.cpp already built as a shared library elsewhere, install the bindings without building it and
point them at the library:

    CMAKE_ARGS="-DLLAMA_BUILD=OFF" pip install llama-cpp-python==0.3.36 gguf
    export LLAMA_CPP_LIB_PATH=/path/to/llama.cpp/build/bin      # the directory holding libllama.so
    python -m bench.peers                  # ~100M parameters, f32, Q8_0/int8 and Q4_0/int4, 2 rounds
    python -m bench.peers --variants f32,q8 --rounds 3
    python -m bench.peers --hidden 256 --layers 2 --heads 4 --kv-heads 2 --intermediate 512 --vocab 4096 --rounds 1

Only a quiet machine gives a fair table: the load average before and after each process is printed with it.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The library `make peers-env` builds, unless LLAMA_CPP_LIB_PATH names another.
_PEERS_LIB = Path(__file__).resolve().parent.parent / ".peers" / "build" / "bin"
if _PEERS_LIB.is_dir():
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(_PEERS_LIB))

import numpy as np

from bench.common import add_model_args, best_read_rate, llama_config, weight_memory  # noqa: E402
from bench import peers_scale  # noqa: E402
from bench.peers_gguf import write_gguf  # noqa: E402

SYSTEMS = ("llama.cpp", "tlaloc-jax")
# variant: (GGUF file type of the layer projections, tlaloc-jax weight_quant, quant_group)
VARIANTS = {"f32": ("F32", "none", 128), "q8": ("Q8_0", "int8", 128), "q4": ("Q4_0", "int4", 32)}
BATCHES = (1, 4)
# The head as the GGUF keeps it (F32, bench/peers_gguf.py), not the exporter's int8 default for 4-bit weights.
HEAD_QUANT = "none"
PROMPT_LEN, NEW_TOKENS, BLOCK = 32, 64, 16
INSTALL = ("bench/peers.py needs llama-cpp-python and gguf (optional, not in `make test`): `make peers-env` "
           "(builds libllama alone, 2-6 min on 2 cores), or pip install -e '.[peers]' (builds all of llama.cpp, ~30 "
           "min on 2 cores), or with llama.cpp already built as a "
           "shared library: CMAKE_ARGS=\"-DLLAMA_BUILD=OFF\" pip install llama-cpp-python==0.3.36 gguf and "
           "LLAMA_CPP_LIB_PATH=<dir of libllama.so>")


def hf_config(a) -> dict:
    """bench/decode.py's random Llama, with what llama.cpp's GGUF writer also reads (architecture, stop ids); with
    --shape, that shape's bf16 config (bench/shapes.py)."""
    if a.shape:
        from bench.shapes import hf_config as shape_config
        return shape_config(a.shape, a.context)
    return dict(llama_config(a), architectures=["LlamaForCausalLM"], hidden_act="silu", bos_token_id=1, eos_token_id=2,
                torch_dtype="float32")


def prompts(vocab: int) -> list[list[int]]:
    """Four seeded prompts of PROMPT_LEN ids, clear of the stand-in vocabulary's control ids 0..2."""
    rng = np.random.default_rng(1234)
    return rng.integers(3, vocab, size=(max(BATCHES), PROMPT_LEN)).tolist()


# -- the three forms of the model ------------------------------------------------------------------------


def prepare(a, work: Path) -> None:
    """Checkpoint and GGUFs under `work`, made once (kept for the next run with the same shape), and the artifacts,
    exported on every run: a kept one would hold an older exporter's bodies."""
    from tlaloc_jax.checkpoint import random_weights, save_checkpoint
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.families import config_from_hf

    hf = hf_config(a)
    ck = work / "ck"
    if not (ck / "model.safetensors").exists():
        fam, cfg = config_from_hf(hf)
        weights = random_weights(cfg, fam, seed=0, std=0.02)
        print(f"checkpoint: {sum(x.size for x in weights.values()) / 1e6:.1f}M parameters (f32)", flush=True)
        save_checkpoint(ck, hf, weights)
        del weights
    for v in a.variants:
        projections, quant, group = VARIANTS[v]
        gguf_file = work / f"model-{v}.gguf"
        if not gguf_file.exists():
            write_gguf(ck, hf, gguf_file.with_suffix(".tmp"), projections)
            os.replace(gguf_file.with_suffix(".tmp"), gguf_file)
        shutil.rmtree(work / f"art-{v}", ignore_errors=True)
        t0 = time.perf_counter()
        export_checkpoint(ck, work / f"art-{v}", batch_ladder=BATCHES, context_ladder=(a.context,),
                          prefill_max_batch=max(BATCHES), prefill_chunk=PROMPT_LEN, block_size=BLOCK, progress=False,
                          weight_layout=a.weight_layout, weight_quant=quant, quant_group=group,
                          head_quant=HEAD_QUANT)
        print(f"exported the tlaloc-jax artifact {v} ({a.weight_layout} layout, weight_quant {quant}) and wrote "
              f"{gguf_file.name} ({projections} projections) in {time.perf_counter() - t0:.1f} s", flush=True)


# -- the workers: one system each, in a process of its own -----------------------------------------------


def emit(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(name: str, gen, reps: int, extra=None) -> None:
    """For each batch: a warm-up generation (its ids are the ones compared), then `reps` pairs of a 64-token and a
    1-token generation from the same prompts."""
    ps = prompts(gen.vocab)
    for b in BATCHES:
        ids, info = gen(ps[:b], NEW_TOKENS, record=True)
        gen(ps[:b], 1)
        t64, t1 = [], []
        for _ in range(reps):
            t, (out, _) = _timed(lambda: gen(ps[:b], NEW_TOKENS))
            if out != ids:
                raise SystemExit(f"{name}: batch {b} greedy ids changed between two runs")
            t64.append(t)
            t1.append(_timed(lambda: gen(ps[:b], 1))[0])
        emit(system=name, batch=b, t64=t64, t1=t1, ids=ids, **info, **(extra(b) if extra else {}))


class LlamaCppGreedy:
    """Greedy generation for B sequences at once through llama.cpp's C API (llama-cpp-python's ctypes bindings):
    one llama_batch holds every sequence's prompt, then one token of each per llama_decode."""

    def __init__(self, gguf_path: Path, threads: int, context: int, repack: bool = True):
        import llama_cpp as L
        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = repack        # llama.cpp's weight repacking (its AMX buffer, its CPU_REPACK)
        self.model = L.llama_model_load_from_file(str(gguf_path).encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf_path}")
        cp = L.llama_context_default_params()
        nb = max(BATCHES)
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = nb * context, nb * PROMPT_LEN, nb * PROMPT_LEN, nb
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = 0          # GGML_TYPE_F32: an f32 KV cache, as the tlaloc-jax artifact's
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit("llama.cpp could not create a context")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(nb * PROMPT_LEN, 0, 1)
        self.decode_s: list[float] = []

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits)."""
        bt = self.batch
        for i, (tok, pos, seq, want) in enumerate(rows):
            bt.token[i], bt.pos[i], bt.n_seq_id[i], bt.logits[i] = tok, pos, 1, int(want)
            bt.seq_id[i][0] = seq
        bt.n_tokens = len(rows)
        t0 = time.perf_counter()
        rc = self.L.llama_decode(self.ctx, bt)
        self.decode_s.append(time.perf_counter() - t0)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc}")

    def _logits(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))

    def __call__(self, ps: list[list[int]], n: int, record: bool = False):
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        rows = [(t, j, s, j == len(p) - 1) for s, p in enumerate(ps) for j, t in enumerate(p)]
        out_at = [i for i, r in enumerate(rows) if r[3]]
        self.decode_s = []
        self._decode(rows)
        out: list[list[int]] = [[] for _ in ps]
        gaps: list[list[tuple[float, float]]] = [[] for _ in ps]
        for k in range(n):
            for s in range(len(ps)):
                lg = self._logits(out_at[s])
                out[s].append(int(lg.argmax()))
                if record:
                    top2 = np.partition(lg, -2)[-2:]
                    gaps[s].append((float(top2[1] - top2[0]), float(np.abs(lg).max())))
            if k + 1 < n:
                self._decode([(out[s][-1], len(ps[s]) + k, s, True) for s in range(len(ps))])
                out_at = list(range(len(ps)))
        info = dict(top2_gap=gaps, decode_ms=statistics.median(self.decode_s[1:]) * 1e3) if record else {}
        return out, info


def weights_read_rate(arrays: list[np.ndarray], threads: int) -> float:
    """GB/s of the best of three passes over `arrays` with `threads` threads (decode._Reader): how fast this
    process's own weight pages read. On a VM two allocations of the same size can read 25% apart (docs/cpu.md),
    so each worker reports its own."""
    return best_read_rate(arrays, threads) / 1e9


def llama_repack(a) -> bool:
    """Whether llama.cpp repacks weights (--llama-repack; auto: not on a CPU with AMX-INT8, where its AMX buffer's
    Q8_0 matmul crashed at the first decode: llama.cpp issue 20824, seen with 0.3.36's library; `--no-repack` in
    its own tools)."""
    if a.llama_repack != "auto":
        return a.llama_repack == "on"
    from tlaloc_jax.serve.runtime.compile_cache import host_cpu
    return "amx_int8" not in host_cpu()


def llama_worker(a, work: Path) -> None:
    import llama_cpp
    t0 = time.perf_counter()
    gen = LlamaCppGreedy(work / f"model-{a.variant}.gguf", a.threads, a.context, repack=llama_repack(a))
    load = dict(load_s=time.perf_counter() - t0, rss_load=peers_scale.resident())
    decode_ms = {}

    def gen_record(ps, n, record=False):
        out, info = gen(ps, n, record)
        if record:
            decode_ms[len(ps)] = info["decode_ms"]
        return out, info
    gen_record.vocab = gen.vocab
    gguf = work / f"model-{a.variant}.gguf"     # its pages are llama.cpp's weights (it maps the file)
    rate = functools.cache(lambda: weights_read_rate([np.memmap(gguf, np.uint8, mode="r")], a.threads))
    measure("llama.cpp", gen_record, a.reps,
            extra=lambda b: dict(version=llama_cpp.__version__, variant=a.variant, read_gbs=rate(), **load,
                                 rss_end=peers_scale.resident()))


def tlaloc_worker(a, work: Path) -> None:
    from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs
    from tlaloc_jax.artifact import Role
    from tlaloc_jax.serve import Engine

    eng = Engine.load(work / f"art-{a.variant}", cache_dir=work / "compile-cache", progress=False)
    load = dict(load_s=eng.load_seconds, rss_load=eng.resident_at_load, bound=eng.resident_bound)

    def gen(ps, n, record=False):
        return eng.generate(ps, n), {}
    gen.vocab = a.vocab

    rate = functools.cache(lambda: weights_read_rate(weight_memory(eng, {"embed"}), a.threads))

    def step_ms(b):
        """The decode entry alone (batch b, context bucket a.context, position a.context // 2), median of 20."""
        width = a.context // BLOCK
        entry = eng.manifest.entry(f"decode_b{b}_c{a.context}")
        rows = [RowCall([7], a.context // 2, list(range(i * width, (i + 1) * width))) for i in range(b)]
        inputs = build_step_inputs(rows, batch=b, tokens=1, width=width, block_size=BLOCK)
        for _ in range(3):
            eng.runner.run(entry, inputs, {Role.NEXT_TOKEN})
        ts = [_timed(lambda: eng.runner.run(entry, inputs, {Role.NEXT_TOKEN}))[0] for _ in range(20)]
        return dict(decode_ms=statistics.median(ts) * 1e3, variant=a.variant, read_gbs=rate(), **load,
                    rss_end=peers_scale.resident())
    measure("tlaloc-jax", gen, a.reps, extra=step_ms)
    eng.close()


# -- the run: interleaved, rotated, summarised ---------------------------------------------------------


def worker_command(a, work: Path) -> tuple[list[str], dict]:
    """The command line of a worker process on this run's model, and its environment."""
    base = [sys.executable, "-m", "bench.peers", "--work", str(work)] + [f"--{k}={v}" for k, v in (
        ("hidden", a.hidden), ("layers", a.layers), ("heads", a.heads), ("kv-heads", a.kv_heads),
        ("intermediate", a.intermediate), ("vocab", a.vocab), ("context", a.context), ("threads", a.threads),
        ("reps", a.reps), ("llama-repack", a.llama_repack), ("weight-layout", a.weight_layout))]
    base += [f"--shape={a.shape}"] if a.shape else []
    root = str(Path(__file__).resolve().parent.parent)      # where `bench` imports from
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return base, dict(os.environ, OMP_NUM_THREADS=str(a.threads), JAX_PLATFORMS="cpu", PYTHONPATH=path)


def run_rounds(a, work: Path, variants: list[str]) -> list[dict]:
    results = []
    base, env = worker_command(a, work)
    for r in range(a.rounds):
        order = SYSTEMS[r % 2:] + SYSTEMS[:r % 2]
        for v, name in [(v, name) for v in variants for name in order]:
            l0 = os.getloadavg()
            t0 = time.perf_counter()
            p = subprocess.run(base + ["--worker", name, "--variants", v], env=env, capture_output=True, text=True)
            l1 = os.getloadavg()
            got = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
            print(f"round {r} {name} {v}: {time.perf_counter() - t0:.0f} s, load average (1 min) {l0[0]:.2f} -> "
                  f"{l1[0]:.2f}", flush=True)
            if p.returncode or len(got) != len(BATCHES):
                raise SystemExit(f"{name} worker failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
            for g in got:
                g.update(round=r, load=[l0[0], l1[0]])
            results += got
    return results


def agreement(a, work: Path, llama: dict, tlaloc: dict) -> str:
    """How the greedy ids of the two systems compare, row by row: equal, or where they part and whether
    llama.cpp's own top-2 gap there is a near-tie under the tolerance model (when not, which id the float64
    reference picks)."""
    from tlaloc_jax.families import config_from_hf
    from tlaloc_jax.kernels.tolerances import bound, decoder_roundings_of

    _, cfg = config_from_hf(hf_config(a))
    rel = bound(decoder_roundings_of(cfg, a.context))
    parts = []
    for s, (x, y) in enumerate(zip(llama["ids"], tlaloc["ids"])):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if k is None:
            parts.append(f"row {s}: all {len(x)} equal")
            continue
        gap, scale = llama["top2_gap"][s][k]
        tie = "a near-tie" if gap <= 2 * rel * scale else "NOT a near-tie"
        if gap > 2 * rel * scale:     # a --shape model in float64 would take 8 bytes a parameter: none asked
            tie += "; " + ("no float64 reference at --shape sizes" if a.shape else
                           reference_choice(work, prompts(a.vocab)[s] + x[:k], x[k], y[k]))
        parts.append(f"row {s}: equal to step {k}, then llama.cpp {x[k]} vs tlaloc-jax {y[k]} (llama.cpp's top-2 gap "
                     f"{gap:.3g}, allowed {2 * rel * scale:.3g}: {tie})")
    return "; ".join(parts)


@functools.cache
def _float64_model(work: Path):
    """The checkpoint as Hugging Face's model in float64, loaded once for every divergence it arbitrates."""
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(work / "ck", torch_dtype=torch.float64)


def reference_choice(work: Path, ids: list[int], llama_id: int, tlaloc_id: int) -> str:
    """Which of two next ids Hugging Face's model in float64 prefers after `ids` (the arbiter of a divergence)."""
    try:
        import torch
        import transformers  # noqa: F401  (_float64_model's)
    except ImportError:
        return "no float64 reference: transformers is not installed"
    with torch.no_grad():
        logits = _float64_model(work)(torch.tensor([ids])).logits[0, -1]
    d = float(logits[tlaloc_id] - logits[llama_id])
    return f"transformers in float64 prefers {tlaloc_id if d > 0 else llama_id} by {abs(d):.3g}"


def summarize(a, work: Path, results: list[dict]) -> None:
    print()
    print(f"{'system':>10} | variant | batch | tokens/s median [min-max] | ms/step (T64-T1)/63 | bare step ms | runs")
    tps, by = {}, {}
    for v in a.variants:
        for name in SYSTEMS:
            for b in BATCHES:
                rs = [r for r in results if r["system"] == name and r["batch"] == b and r["variant"] == v]
                by[name, v, b] = rs[0]
                tok = [b * NEW_TOKENS / t for r in rs for t in r["t64"]]
                step = [(t64 - t1) / (NEW_TOKENS - 1) * 1e3 for r in rs for t64, t1 in zip(r["t64"], r["t1"])]
                bare = [r["decode_ms"] for r in rs]
                tps[name, v, b] = statistics.median(tok)
                print(f"{name:>10} | {v:>7} | {b:5d} | {statistics.median(tok):7.1f} [{min(tok):.1f}-{max(tok):.1f}] | "
                      f"{statistics.median(step):8.1f} [{min(step):.1f}-{max(step):.1f}] | "
                      f"{statistics.median(bare):6.1f} | {len(tok)}")
    print()
    for v in a.variants:
        for b in BATCHES:
            rounds = sorted({r["round"] for r in results})
            per_round = [statistics.median(b * NEW_TOKENS / t for r in results if r["system"] == "tlaloc-jax"
                                           and r["variant"] == v and r["batch"] == b and r["round"] == k for t in r["t64"])
                         / statistics.median(b * NEW_TOKENS / t for r in results if r["system"] == "llama.cpp"
                                             and r["variant"] == v and r["batch"] == b and r["round"] == k
                                             for t in r["t64"]) for k in rounds]
            print(f"{v} ({VARIANTS[v][0]} / {VARIANTS[v][1]}), batch {b}: tlaloc-jax / llama.cpp tokens/s = "
                  f"{tps['tlaloc-jax', v, b] / tps['llama.cpp', v, b]:.2f}x (rounds: "
                  f"{', '.join(f'{x:.2f}' for x in per_round)})")
    for v in a.variants:
        rounds = sorted({r["round"] for r in results})
        reads = {name: [next(r["read_gbs"] for r in results if r["system"] == name and r["variant"] == v
                             and r["round"] == k) for k in rounds] for name in SYSTEMS}
        print(f"{v}: each worker's own weights read at (GB/s, 2-thread passes, by round): "
              + "; ".join(f"{name} {', '.join(f'{x:.1f}' for x in reads[name])}" for name in SYSTEMS))
    for v in a.variants:
        for name in SYSTEMS:
            step = {b: statistics.median(r["decode_ms"] for r in results
                                         if r["system"] == name and r["variant"] == v and r["batch"] == b)
                    for b in BATCHES}
            print(f"{name} {v}: batch-4 step / batch-1 step (bare) = {step[4] / step[1]:.2f}x")
    print()
    if "f32" in a.variants:
        for b in BATCHES:
            ids = agreement(a, work, by["llama.cpp", "f32", b], by["tlaloc-jax", "f32", b])
            print(f"greedy ids, f32, batch {b}: {ids}")
        for v in [v for v in a.variants if v != "f32"]:
            for name in SYSTEMS:
                same = [sum(x == y for x, y in zip(q, f)) for b in BATCHES
                        for q, f in zip(by[name, v, b]["ids"], by[name, "f32", b]["ids"])]
                print(f"greedy ids, {name} {v} against its own f32 (first divergence ends agreement later on): "
                      f"{sum(same)}/{len(same) * NEW_TOKENS} equal positions")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="timed generations per batch in each process")
    ap.add_argument("--weight-layout", default="per-layer", choices=("per-layer", "stacked"))
    ap.add_argument("--work", default=None, help="where the checkpoint, GGUF and artifact are kept (default: a "
                    "directory under the system's temp dir named after the shape)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="weight variants, of " + ", ".join(VARIANTS))
    ap.add_argument("--llama-repack", default="auto", choices=("auto", "on", "off"),
                    help="llama.cpp's weight repacking (auto: off on CPUs with AMX-INT8, where it crashes)")
    ap.add_argument("--shape", choices=peers_scale.SHAPE_NAMES, default=None,
                    help="a Llama 3 shape (bench/shapes.py: bf16 shards, vocabulary 128,256) in place of --hidden ... "
                         "--vocab; each variant is then prepared, measured and deleted in turn, f32 only where it fits")
    ap.add_argument("--keep", action="store_true", help="with --shape: keep each variant's artifact and GGUF (a "
                    "later run reuses them; with --rounds 0 this run only prepares them)")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--prepare", choices=("export", "gguf"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]
    if any(v not in VARIANTS for v in a.variants):
        ap.error(f"--variants: each of {', '.join(VARIANTS)}")
    a.variant = a.variants[0]

    missing = [m for m in ("llama_cpp", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"missing: {', '.join(missing)}. {INSTALL}", file=sys.stderr)
        sys.exit(2)
    try:
        import llama_cpp  # noqa: F401  (loads libllama: fails here when LLAMA_CPP_LIB_PATH points nowhere)
    except (OSError, RuntimeError) as e:
        print(f"llama-cpp-python is installed but its llama.cpp library did not load ({e}). {INSTALL}",
              file=sys.stderr)
        sys.exit(2)

    import tempfile
    if a.shape:
        peers_scale.apply_shape(a)
    shape = f"{a.shape}-" if a.shape else ""
    shape += f"h{a.hidden}-l{a.layers}-a{a.heads}-{a.kv_heads}-f{a.intermediate}-v{a.vocab}-c{a.context}-{a.weight_layout}"
    work = Path(a.work or Path(tempfile.gettempdir()) / f"tlaloc-peers-{shape}")
    if a.worker:
        (llama_worker if a.worker == "llama.cpp" else tlaloc_worker)(a, work)
        return
    if a.prepare:
        peers_scale.prepare_worker(a, work, a.prepare)
        return
    work.mkdir(parents=True, exist_ok=True)
    if a.shape:
        peers_scale.ensure_checkpoint(hf_config(a), work / "ck")
        a.variants = peers_scale.fitting_variants(a, hf_config(a))
    else:
        prepare(a, work)
    import jax
    import llama_cpp
    print(f"model: llama{' ' + a.shape if a.shape else ''}, hidden {a.hidden}, {a.layers} layers, "
          f"{a.heads}/{a.kv_heads} heads, vocab {a.vocab}, {'bf16 shards' if a.shape else 'f32'}; "
          f"{PROMPT_LEN}-token prompts, {NEW_TOKENS} greedy tokens, {a.threads} threads; llama-cpp-python "
          f"{llama_cpp.__version__}, jax {jax.__version__}, tlaloc-jax {a.weight_layout} layout; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; llama.cpp weight repacking "
          f"{'on' if llama_repack(a) else 'off'} (--llama-repack {a.llama_repack})", flush=True)
    if not a.shape:
        summarize(a, work, run_rounds(a, work, a.variants))
        return
    base, env = worker_command(a, work)
    results, prepared = [], {}
    for v in a.variants:       # one variant's files on disk at a time, unless --keep
        prepared[v] = peers_scale.prepare_variant(a, work, v, base, env)
        results += run_rounds(a, work, [v])
        if not a.keep:
            peers_scale.drop_variant(work, v)
    if not results:
        print("--rounds 0: prepared only", flush=True)
        return
    summarize(a, work, results)
    peers_scale.summarize_scale(a, work, results, prepared)


if __name__ == "__main__":
    main()
