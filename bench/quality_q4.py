"""python -m bench.quality_q4: how close the 4-bit forms of one checkpoint stay to its f32 model, tlaloc-jax's int4
and uint4 artifacts (groups of 32) next to llama.cpp's Q4_0 (blocks of 32) of the same weights.

Each system scores the same text teacher-forced (every position's next-token distribution): tlaloc-jax's artifacts
through the runtime's prompt logprobs (tlaloc_jax.tools.quality.score_windows), llama.cpp's GGUFs (bench/peers.py's
writer: projections F32 or Q4_0, embedding, norms and head F32) through one llama_decode a window with logits at
every position. The f32 model is the f32 artifact; llama.cpp's own F32 GGUF is scored too, as the check that both
systems compute the same model (its top-1 agreement with the f32 artifact should be all but complete).

Reported per form: perplexity of the text, and top-1 agreement with the f32 model (the share of positions where the
form's most likely next token is the f32 model's). Default checkpoint: the embedded demo model (trained, so the text
is predictable and the agreement means something), the text a held-out standard-library file it was not trained on.

Needs the peers extra (llama-cpp-python, gguf) and llama.cpp's library (LLAMA_CPP_LIB_PATH), as bench/peers.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_PEERS_LIB = Path(__file__).resolve().parent.parent / ".peers" / "build" / "bin"
if _PEERS_LIB.is_dir():
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(_PEERS_LIB))

import numpy as np  # noqa: E402

from bench.peers import INSTALL, write_gguf  # noqa: E402

TLALOC_FORMS = {"f32": ("none", 0), "int4 g32": ("int4", 32), "uint4 g32": ("uint4", 32)}
LLAMA_FORMS = {"llama.cpp F32": "F32", "llama.cpp Q4_0": "Q4_0"}


def untied_copy(src: Path, out: Path) -> dict:
    """src as a checkpoint with an explicit lm_head (the GGUF writer reads one) and no tokenizer change; -> its config."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, out)
    hf = json.loads((out / "config.json").read_text())
    t = load_file(str(out / "model.safetensors"))
    if "lm_head.weight" not in t:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
        hf["tie_word_embeddings"] = False
        save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(hf, indent=2))
    return hf


class LlamaCppScorer:
    """Teacher-forced scoring through llama.cpp's C API: one llama_decode of a window, logits at every position."""

    def __init__(self, gguf_path: Path, window: int, threads: int):
        import llama_cpp as L
        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = False         # no weight repacking: its AMX buffer crashes (bench/peers.py, llama_repack)
        self.model = L.llama_model_load_from_file(str(gguf_path).encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf_path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = window
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = 0          # an f32 KV cache, as the artifacts'
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(window, 0, 1)
        self.window = window

    def score(self, ids: list[int]) -> tuple[list[float], list[int]]:
        """-> (logprob of each of ids[1:], the argmax after each of ids[:-1]), window by window as score_windows."""
        logprobs, top1 = [], []
        for start in range(0, max(len(ids) - 1, 1), self.window):
            w = ids[start:start + self.window]
            self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
            bt = self.batch
            for i, tok in enumerate(w):
                bt.token[i], bt.pos[i], bt.n_seq_id[i], bt.logits[i] = tok, i, 1, 1
                bt.seq_id[i][0] = 0
            bt.n_tokens = len(w)
            if self.L.llama_decode(self.ctx, bt) != 0:
                raise SystemExit("llama_decode failed")
            for i in range(len(w) - 1):
                lg = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))
                lg = lg.astype(np.float64)
                lse = lg.max() + np.log(np.exp(lg - lg.max()).sum())
                logprobs.append(float(lg[w[i + 1]] - lse))
                top1.append(int(lg.argmax()))
        return logprobs, top1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quality_q4", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help="a Llama checkpoint (default: the demo model)")
    ap.add_argument("--held-out", default="difflib.py", help="the standard-library file to score (default difflib.py)")
    ap.add_argument("--tokens", type=int, default=480, help="tokens of the text to score (default 480)")
    ap.add_argument("--work", type=Path, default=None,
                    help="a new directory for the artifacts and GGUFs (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import importlib.util
    if any(importlib.util.find_spec(m) is None for m in ("llama_cpp", "gguf")):
        print(INSTALL, file=sys.stderr)
        return 2

    from tlaloc_jax.checkpoint import DEMO_MODEL
    from tlaloc_jax.export import export_checkpoint
    from tlaloc_jax.serve.engine import Engine
    from tlaloc_jax.tools.quality import held_out_text, score_windows, text_ids_for

    if args.work is not None and args.work.exists() and any(args.work.iterdir()):
        print(f"--work {args.work} is not empty: name a new directory", file=sys.stderr)
        return 2
    args.work = args.work or Path(tempfile.mkdtemp(prefix="tlaloc-quality-q4-"))
    ck = args.work / "ck"
    hf = untied_copy(args.checkpoint or DEMO_MODEL, ck)
    context = hf["max_position_embeddings"]
    for name, (quant, group) in TLALOC_FORMS.items():
        export_checkpoint(ck, args.work / f"art-{quant}", batch_ladder=(1,), context_ladder=(context,), progress=False,
                          weight_quant=quant, quant_group=group or 128, prompt_logprobs=1)
    path, text = held_out_text(args.held_out)
    ids = text_ids_for(str(args.work / "art-none"), text, args.tokens)
    scored = {}
    for name, (quant, _) in TLALOC_FORMS.items():
        with Engine.load(args.work / f"art-{quant}", progress=False) as engine:
            s = score_windows(engine, ids, context)
        scored[f"tlaloc-jax {name}"] = (s.logprobs, s.top1)
    for name, projections in LLAMA_FORMS.items():
        gguf_file = args.work / f"model-{projections}.gguf"
        write_gguf(ck, hf, gguf_file, projections)
        scored[name] = LlamaCppScorer(gguf_file, context, args.threads).score(ids)
    ref_lp, ref_top1 = scored["tlaloc-jax f32"]
    rows = []
    for name, (lp, top1) in scored.items():
        agree = sum(int(a == b) for a, b in zip(top1, ref_top1))
        rows.append(dict(form=name, perplexity=float(np.exp(-np.mean(lp))), top1_agree=agree, positions=len(ref_top1),
                         mean_abs_logprob_delta=float(np.mean(np.abs(np.subtract(lp, ref_lp))))))
    if args.json:
        print(json.dumps(dict(text=str(path), tokens=len(ids), rows=rows), indent=1))
        return 0
    print(f"{len(ids)} tokens of {path}, teacher-forced; the f32 model is the tlaloc-jax f32 artifact")
    print(f"{'form':>22} | perplexity | top-1 agreement with f32 | mean |logprob - f32's|")
    for r in rows:
        print(f"{r['form']:>22} | {r['perplexity']:10.4f} | {r['top1_agree']:4d}/{r['positions']} "
              f"({100 * r['top1_agree'] / r['positions']:5.1f}%)      | {r['mean_abs_logprob_delta']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
