"""Request text to token ids on worker threads, so that the event loop keeps answering while a long prompt is
tokenized or a chat template rendered; and the character bound checked before any tokenizing.

`tokenizers.Tokenizer.encode` holds the GIL for the whole call (a 1 MiB prompt stops every Python thread
for seconds) while `encode_batch` releases it, so the workers call `encode_batch`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import os

from tokenizers.pre_tokenizers import ByteLevel

from ..tokenizer import TextTokenizer
from .errors import APIError

# NFC and NFKC compose at most four code points into one (U+1F87: alpha and three marks).
_MOST_COMPOSED = 4
_COMPOSING = {"NFC", "NFD", "NFKC", "NFKD"}
# Pre-tokenizers that keep every character (they only split), beside ByteLevel.
_KEEPING = {"ByteLevel", "Digits", "Punctuation"}


def _keeps_every_byte(pre_tokenizer: dict | None) -> bool:
    """Whether a pre-tokenizer is byte-level and drops nothing (a Split that removes its matches does)."""
    parts = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer and pre_tokenizer["type"] == "Sequence" \
        else [pre_tokenizer]
    return (any(p and p["type"] == "ByteLevel" for p in parts)
            and all(p["type"] in _KEEPING or (p["type"] == "Split" and p.get("behavior") != "Removed")
                    for p in parts))


def _composes_at_most(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    if normalizer["type"] == "Sequence":
        return all(_composes_at_most(n) for n in normalizer.get("normalizers", []))
    return normalizer["type"] in _COMPOSING


def max_prompt_chars(tokenizer: TextTokenizer, max_context: int) -> int | None:
    """The most characters a text of `max_context` tokens can hold, or None where the tokenizer gives no bound.

    A byte-level BPE (GPT-2's byte alphabet, all 256 bytes in the vocabulary: Llama 3, Qwen, the demo model)
    writes every byte of the text into some token, and no token stands for more text than its vocabulary
    string is long (one character per byte; a special token's string is its text), a character being at
    least one byte. A composing normalizer may shrink the text 4:1 first. Other tokenizers can drop text
    (a whitespace pre-tokenizer, special tokens that strip the spaces around them) and get no bound.
    """
    spec = json.loads(tokenizer.tok.to_str())
    vocab = tokenizer.tok.get_vocab(with_added_tokens=True)
    if (spec["model"]["type"] != "BPE" or not _keeps_every_byte(spec.get("pre_tokenizer"))
            or not _composes_at_most(spec.get("normalizer"))
            or any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", []))
            or not set(ByteLevel.alphabet()) <= vocab.keys()):
        return None
    return max_context * max(len(t) for t in vocab) * _MOST_COMPOSED


class PromptTokenizer:
    """Completions' prompts and chat messages -> token ids, on `workers` threads.

    max_chars: the longest text that could fit the context (None: no bound short of the body limit); a
    longer prompt is refused before it is tokenized.
    """

    def __init__(self, tokenizer: TextTokenizer, max_context: int, workers: int | None = None):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.max_chars = max_prompt_chars(tokenizer, max_context)
        self._pool = cf.ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1),
                                           thread_name_prefix="tlaloc-tokenize")

    def _check_length(self, text: str, param: str, what: str) -> None:
        """what: the text's description, with {} for its length in characters."""
        if self.max_chars is not None and len(text) > self.max_chars:
            raise APIError(400, f"{what.format(len(text))} is longer than the largest context ({self.max_context} "
                                f"tokens of at most {self.max_chars // self.max_context} characters each)",
                           param=param, code="context_length_exceeded")

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def _chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
              add_special_tokens: bool) -> list[int]:
        text = self.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        self._check_length(text, "messages", "the chat as its template renders it, {} characters,")
        return self._encode([text], add_special_tokens)[0]

    async def encode(self, texts: list[str], param: str = "prompt", add_special_tokens: bool = True
                     ) -> list[list[int]]:
        """Completions' text prompts (or /v1/embeddings' inputs: `param`) -> ids; add_special_tokens: those the
        tokenizer's post-processor adds (a BOS), vLLM's field of that name (default true for a prompt)."""
        for text in texts:
            self._check_length(text, param, param + " of {} characters")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, texts, add_special_tokens)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool,
                          tools: list[dict] | None = None, add_special_tokens: bool = False) -> list[int]:
        """Chat messages (and tools) -> the ids of the chat template's text (ChatTemplateError where it refuses
        them); add_special_tokens adds the post-processor's on top of those the template wrote (vLLM's default:
        false)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._chat, messages,
                                                                add_generation_prompt, tools, add_special_tokens)

    async def run(self, fn, *args):
        """fn(*args) on a worker thread (a grammar's compilation, a long decode)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
