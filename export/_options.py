"""What `stage` is told beyond the step, the weights and the pools, in four small groups: the ladders of entries,
the pools' capacity, the features added to the entries, and what the manifest says of the model. `SplitStep`
gives a step as its hidden states and its head, which prompt scoring needs."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tlaloc_jax import artifact as af

from ._entries import ExportError


# Tokens per sequence of a prefill call by default: short prompts arriving together are read side by side, each
# padded to at most 31 positions, and a call of 8 such rows (256 positions) is bound by arithmetic on CPU.
DEFAULT_PREFILL_CHUNK = 32
# A prompt read alone: one-row calls of this many tokens (a 32-token row leaves a CPU call half idle).
DEFAULT_PREFILL_LONG_CHUNK = 128
# Decode batches up to the sequences a server runs at once (a step of 8 sequences is one call, not two of 4);
# prefill batches stop at 8: a call of 8 chunks of 32 computes 256 positions, twice a long chunk's call (the running
# sequences wait for it).
DEFAULT_BATCH_LADDER = (1, 2, 4, 8, 16, 32)
DEFAULT_PREFILL_MAX_BATCH = 8
# The paged pools hold, by default, this many sequences of the largest context at most (more run, with
# preemption, when they are shorter).
DEFAULT_POOL_SEQUENCES = 16


@dataclass(frozen=True)
class Ladders:
    """The entries' buckets: one decode and one prefill entry per (batch, context) point.

    batch, context: the batch sizes and the context buckets (positions, multiples of the block size).
    prefill_chunk: tokens per sequence of a prefill call, at most the entry's context (0 or None: the whole
    context); a runtime reads longer prompts in several calls.
    prefill_max_batch: the largest batch of the prefill entries (None: the largest batch, at most
    DEFAULT_PREFILL_MAX_BATCH).
    prefill_long_chunk: tokens of one more one-row prefill entry per context (capped by the context), for a prompt
    read while no other is; 0 or None: none, nor where it is not longer than prefill_chunk or batch 1 is not on
    the batch ladder."""

    batch: Sequence[int] = DEFAULT_BATCH_LADDER
    context: Sequence[int] = (64, 256, 1024)
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK
    prefill_max_batch: int | None = None
    prefill_long_chunk: int | None = DEFAULT_PREFILL_LONG_CHUNK


@dataclass(frozen=True)
class Capacity:
    """The pools' size: block_size positions per page, and the capacity of each pool kind (None: the default).

    paged_kv: pages of the paged pools (default: the largest batch at the largest context, at most
        DEFAULT_POOL_SEQUENCES of them).
    ring_kv: pages of the ring pools (default: a ring for each sequence the paged pools hold).
    state_slots: slots of the state pools (default: as many sequences as the paged pools hold at the largest
        context, at least the largest batch, plus up to 4 spare slots for the state snapshots prefix caching
        keeps)."""

    block_size: int = 16
    paged_kv: int | None = None
    ring_kv: int | None = None
    state_slots: int | None = None


@dataclass(frozen=True)
class Sampler:
    """The sampler staged in every entry (tlaloc_jax/kernels/in_body_sampler.py): temperature, top-k, top-p, min-p,
    presence / frequency / repetition penalties, logit bias and a token mask applied in the body, a counter-based random
    stream per row, and the logprobs an OpenAI response reports.

    top_logprobs: N, the largest logprobs each entry returns (with their ids) when a row asks; OpenAI allows
        up to 20. logit_bias: NB, the logit-bias entries a row may carry."""

    top_logprobs: int = 20
    logit_bias: int = 64

    def shape(self, vocab: int) -> af.SamplerShape:
        if self.top_logprobs < 0 or self.logit_bias < 0:
            raise ExportError(f"Sampler(top_logprobs={self.top_logprobs}, logit_bias={self.logit_bias}): both must "
                              "be >= 0")
        return af.SamplerShape(columns=af.SAMPLING_COLUMNS, top_logprobs=min(self.top_logprobs, vocab),
                               logit_bias=self.logit_bias, mask_words=af.mask_words(vocab))


@dataclass(frozen=True)
class Features:
    """What the entries do beyond the step.

    sampler: a `Sampler()` samples in every entry, so that the runtime pulls a token per row, never the logits
        (about a second more compile time per entry on a 2-core CPU); None: the runtime samples on the host.
    prompt_logprobs: N adds a scoring prefill entry beside each prefill entry, returning for every position of
        the call the next token's logprob and rank and the N largest logprobs (echo, prompt_logprobs); the step
        must be a `SplitStep`. None: such a prompt is read a token a call and scored on the host.
    decode_steps: K > 1 adds a decode_steps entry beside each decode entry: up to K decode steps in one call
        (export/_decode_steps.py); the runtime uses it while every sequence is decoding.
    mixed: adds mixed entries, one call of the running sequences' decode rows and one prompt chunk (EntryKind.MIXED):
        the step is then also called with a tuple of two StepInputs (the decode rows', the chunk's) and returns
        the logits of both groups' rows in order; tlaloc_jax.decoder.forward does.
    packed: the prefill entries of several rows are packed prefills (Role.PACK_INDEX): the step is then also called
        with StepInputs whose pack_index is set (its rows' tokens side by side, [1, N]) and returns the logits of
        each row's last token; tlaloc_jax.decoder.forward does.
    flat: the only entries are packed prefills, one per context and token bucket (export/_entries.py
        flat_entries): decode rows and prompt chunks run side by side in them, as vLLM lays a step's tokens out flat
        (the step must run packed calls, as with packed).
    speculative_tokens: K > 0 adds a verify entry per decode point (batch, context): each row's last token and up
        to K drafted tokens scored in one call, returning the greedy token after each position and how many drafts
        it confirms (export/_verify.py), for speculative decoding; the step must be a `SplitStep`, one with
        state_positions where the model has state pools. 0: none (the artifact is as without it).
    decode_top_context: the decode, decode_steps and verify entries only at the context ladder's largest context,
        for a step whose one-token rows cost what their own keys do whatever the bucket (the native decode
        attention); a runtime picks the smallest entry that holds a call, so shorter rows run there too."""

    sampler: Sampler | None = None
    prompt_logprobs: int | None = None
    decode_steps: int = 1
    mixed: bool = False
    packed: bool = False
    flat: bool = False
    speculative_tokens: int = 0
    decode_top_context: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """What the manifest says of the model besides its vocabulary (read off the step's logits).

    tokenizer_dir: a directory whose tokenizer files (tokenizer.json, tokenizer_config.json, chat template,
        generation_config.json) are copied into the artifact. embedding_slot: the weight whose rows are the
        vocabulary, checked against it at load. eos_token_ids: the ids that end a sequence. refused_tokens:
        (id, config key) pairs a request may not hold. layers ... kv_dtype: informative (0 or "": unknown; the
        dtypes default to the weights' and the first pool's). attention_block: the key block the bodies were
        traced with (informative, in the manifest's versions)."""

    name: str = "model"
    model_type: str = "authored"
    tokenizer_dir: str | os.PathLike | None = None
    embedding_slot: str = ""
    eos_token_ids: Sequence[int] = ()
    refused_tokens: Sequence[tuple[int, str]] = ()
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    hidden: int = 0
    weight_dtype: str = ""
    kv_dtype: str = ""
    attention_block: int = 0


@dataclass(frozen=True)
class SplitStep:
    """A step function given as its two halves, so that prompt scoring (Features.prompt_logprobs) runs the model's
    own layers and head rather than a second declaration of them.

    hidden(weights, pools, inputs) -> (hidden [B, T, E], pools): the step up to its output head, every token of
        the call.
    head(weights, x [R, E]) -> logits [R, V]: the output head.
    last: the step itself when the model has a cheaper form than head(hidden[:, -1]) (the built-in decoder norms
        only the last token); None: that composition.
    state_positions: hidden writes each state pool's state after every token into the buffer a verify call adds
        to its pools (tlaloc_jax.pools.per_position), which speculative decoding needs of a model with state pools
        to keep the state after the last accepted draft. Calling a SplitStep is the step.
    verify: the halves a verify entry runs (the built-in decoder's: the decode entries' kernels, export/_verify.py);
        None: these."""

    hidden: Callable
    head: Callable
    last: Callable | None = None
    state_positions: bool = False
    verify: "SplitStep | None" = None

    def __call__(self, weights, pools, inputs):
        if self.last is not None:
            return self.last(weights, pools, inputs)
        result = self.hidden(weights, pools, inputs)
        if not (isinstance(result, tuple) and len(result) == 2) or getattr(result[0], "ndim", 0) != 3:
            raise ExportError("a SplitStep's hidden function must return (hidden [B, T, E], pools)")
        return self.head(weights, result[0][:, -1]), result[1]


@dataclass(frozen=True)
class Options:
    ladders: Ladders = field(default_factory=Ladders)
    capacity: Capacity = field(default_factory=Capacity)
    features: Features = field(default_factory=Features)
    model: ModelInfo = field(default_factory=ModelInfo)
