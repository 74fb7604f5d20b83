"""llama.cpp beside bench/speculative.py: greedy generation on the same checkpoint, plain and with llama-cpp-python's
prompt lookup decoding (`Llama(..., draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))`), one sequence at a
time (its `Llama.generate` runs one sequence).

The checkpoint becomes a GGUF by bench/peers_gguf.py (F32, a stand-in vocabulary: both engines are fed token ids).
What llama-cpp-python's lookup does differently from serve/speculative.py's n-gram proposer:
  - it matches the last n tokens for n from max_ngram_size down to 1 (here 1 to --lookup-max) at their earliest
    occurrence in the context, where vLLM's `ngram` and this runtime take the latest (and n from prompt_lookup_min);
  - it scans the whole context with numpy windows every step, drafts wherever a match exists and never backs off;
  - its verify call is one llama_decode of the last token and the drafts with logits for every position
    (logits_all), and the host samples each position in turn (greedy here), truncating the KV cache at the first
    mismatch.
Needs llama-cpp-python and gguf (`pip install -e '.[peers]'`; bench/peers.py says how to use a built libllama).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_PEERS_LIB = Path(__file__).resolve().parent.parent / ".peers" / "build" / "bin"
if _PEERS_LIB.is_dir():
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(_PEERS_LIB))


def demo_gguf(checkpoint: Path, work: Path) -> Path:
    """The checkpoint as an F32 GGUF under work (written once)."""
    from bench.peers_gguf import write_gguf

    out = work / "demo-f32.gguf"
    if not out.exists():
        hf = json.loads((checkpoint / "config.json").read_text())
        write_gguf(checkpoint, hf, out.with_suffix(".tmp"))
        os.replace(out.with_suffix(".tmp"), out)
    return out


class LlamaCppLookup:
    """Greedy generation through llama-cpp-python's `Llama.generate`; lookup > 0: with prompt lookup decoding of that
    many drafted tokens from n-grams of at most lookup_max tokens."""

    def __init__(self, gguf: Path, *, context: int, threads: int, lookup: int = 0, lookup_max: int = 2):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(max_ngram_size=lookup_max, num_pred_tokens=lookup) if lookup else None
        self.llm = Llama(str(gguf), n_ctx=context, n_batch=context, n_threads=threads, n_threads_batch=threads,
                         draft_model=draft, verbose=False)
        self.eos = self.llm.token_eos()

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        """Each prompt alone: up to `new` greedy tokens, ending after the end-of-sequence id as the engine does."""
        out = []
        for p in prompts:
            self.llm.reset()           # no KV prefix kept from the previous prompt (llama-cpp-python reuses one)
            ids = []
            for tok in self.llm.generate(p, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                ids.append(int(tok))
                if len(ids) == new or tok == self.eos:
                    break
            out.append(ids)
        return out
