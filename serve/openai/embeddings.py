"""/v1/embeddings: an embedding program (a bounded program whose manifest names an embedding task) served by the
HTTP server beside its decoder, in OpenAI's shapes.

A request's inputs (text, or token ids) are checked (serve/openai/protocol.py EmbeddingRequest), text is tokenized with
the embedding artifact's own tokenizer on worker threads (prompts.py, its character bound checked first),
each input's ids are checked against the program's largest bucket and vocabulary, and all of them run in one
`BoundedProgram.run_many` on the program's own thread (a BoundedProgram has one caller at a time): inputs of one
request share bodies as the program's batch bound allows. Requests are not batched with each other.

The answer: {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}, each
embedding a list of floats, or with encoding_format "base64" its float32 little-endian bytes in base64 (what the
openai client asks for by default, and decodes); usage counts the inputs' tokens.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures as cf
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tlaloc_jax import artifact as af
from tlaloc_jax.artifact import bounded_manifest as bm

from ..bounded_program import BoundedProgram
from ..tokenizer import read_listed
from .errors import APIError
from .prompts import PromptTokenizer
from .protocol import EmbeddingRequest


@dataclass(frozen=True)
class EmbeddingTokenizer:
    """An embedding artifact's tokenizer.json: what PromptTokenizer reads of a tokenizer (`tok`)."""

    tok: object


def load_embedding_tokenizer(root: str | Path, manifest: bm.BoundedManifest) -> EmbeddingTokenizer | None:
    """The tokenizer the exporter copied into the artifact (checked like every file), or None when it has none.
    Its padding and truncation are turned off: an input is its own length, and one too long is refused, never cut."""
    from tokenizers import Tokenizer
    text = read_listed(Path(root), manifest, "tokenizer.json")
    if text is None:
        return None
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:   # noqa: BLE001 - tokenizers raises its own Exception type for a corrupt file
        raise af.ManifestError(f"tokenizer file 'tokenizer.json' does not load: {e}") from None
    tok.no_padding()
    tok.no_truncation()
    return EmbeddingTokenizer(tok)


def embedding_task(m: bm.BoundedManifest) -> bm.EmbeddingTask:
    if m.embedding is None:
        raise af.ManifestError(f"bounded program {m.name!r} names no embedding task (stage_bounded(..., "
                               "embedding=EmbeddingTask(tokens, output, vocab))): it cannot serve /v1/embeddings")
    return m.embedding


class Embeddings:
    """The /v1/embeddings endpoint over one BoundedProgram with an embedding task."""

    def __init__(self, program: BoundedProgram, tokenizer: EmbeddingTokenizer | None, model_name: str | None = None):
        m = program.manifest
        self.task = embedding_task(m)
        self.program = program
        self.model_name = model_name or m.name
        tokens = m.input(self.task.tokens)
        self.max_tokens = m.bound(tokens.axes[-1]).max
        self.rows = m.batch is not None
        self.dimensions = m.output(self.task.output).shape[-1]
        self.prompt_tokenizer = PromptTokenizer(tokenizer, self.max_tokens) if tokenizer is not None else None
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="tlaloc-embed")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist or serves no embeddings; this server's embedding "
                                f"model is '{self.model_name}'.", param="model", code="model_not_found")

    def _check_ids(self, inputs: list[list[int]]) -> None:
        for i, ids in enumerate(inputs):
            where = "the input" if len(inputs) == 1 else f"input {i}"
            if not ids:
                raise APIError(400, f"{where} tokenizes to no tokens", param="input", code="empty_prompt")
            if len(ids) > self.max_tokens:
                raise APIError(400, f"{where} has {len(ids)} tokens, more than the model's largest context "
                                    f"{self.max_tokens}", param="input", code="context_length_exceeded")
            bad = next((t for t in ids if not 0 <= t < self.task.vocab), None)
            if bad is not None:
                raise APIError(400, f"{where} holds token id {bad}, outside the vocabulary (0 to {self.task.vocab - 1})",
                               param="input", code="out_of_vocabulary")

    async def answer(self, req: EmbeddingRequest) -> dict:
        """A checked request -> the OpenAI answer; APIError 400 for an input it refuses."""
        self.check_model(req.model)
        if req.dimensions is not None and req.dimensions != self.dimensions:
            raise APIError(400, f"'dimensions' = {req.dimensions}: this model's embeddings have {self.dimensions} "
                                "dimensions and are not truncated", param="dimensions", code="unsupported_parameter")
        kind, inputs = req.input
        if kind == "text":
            if self.prompt_tokenizer is None:
                raise APIError(400, "this embedding model has no tokenizer: send the input as token ids",
                               param="input", code="invalid_type")
            inputs = await self.prompt_tokenizer.encode(inputs, "input")
        self._check_ids(inputs)
        calls = [{self.task.tokens: np.asarray([ids] if self.rows else ids, np.int32)} for ids in inputs]
        outs = await asyncio.get_running_loop().run_in_executor(self._worker, self.program.run_many, calls)
        b64 = req.encoding_format == "base64"
        data = []
        for i, out in enumerate(outs):
            vector = np.asarray(out[self.task.output], np.float32).reshape(-1)
            data.append({"object": "embedding", "index": i,
                         "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") if b64
                         else vector.tolist()})
        tokens = sum(len(ids) for ids in inputs)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def model_card(self, created: int) -> dict:
        return {"id": self.model_name, "object": "model", "created": created, "owned_by": "tlaloc-jax",
                "root": self.model_name, "max_model_len": self.max_tokens}

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self.prompt_tokenizer is not None:
            self.prompt_tokenizer.close()
