"""The serving artifact's manifest schema: written by tlaloc_jax.export, read by the JAX-free runtime.

Standard library only (numpy and ml_dtypes are imported lazily, by `numpy_dtype`). A manifest is a tree of
frozen dataclasses; `Manifest.to_json()` writes it deterministically and `load_manifest()` reads and
validates an artifact directory. Everything an artifact may say is one typed vocabulary here: the roles of
an entry's inputs and outputs (`Role`), the kinds of pools (`PoolKind`) and of entries (`EntryKind`), and
the dtypes (`DTYPES`); str enums, so the JSON stays readable.

Changelog:
  tlaloc-serving-v2: a full-history KV pool (one buffer, layers stacked); decode and prefill entries.
    Roles KV_POOL_IN / KV_POOL_OUT.
  tlaloc-serving-v3: adds the windowed KV pool for sliding layers, a ring of pages per sequence
    (top-level `window`: the window and the ring size; pool "window_kv" with roles WINDOW_BLOCK_TABLES,
    WINDOW_SLOT_MAPPING, WINDOW_KV_POOL_IN / OUT).
  tlaloc-serving-v4: pools described generically: each has a `kind` (paged_kv, ring_kv, state_slots), a
    `capacity` (pages, or state slots), and a ring's `window` and `ring_pages`; every pool travels in role
    POOL_IN / POOL_OUT with the pool's name in `slot`, and the step inputs a kind needs are listed in
    POOL_KIND_INPUTS (state pools add STATE_SLOTS). sha256 of every weight file, tokenizer file and of jax's
    serialized `.exported` body (now recorded in each entry). `model.embedding_slot` names the weight whose
    rows are the vocabulary (checked at load). The feature a manifest uses no longer sets its version.
    v4 + sampler (optional, still tlaloc-serving-v4): top-level `sampler` (its SAMPLING columns, N top
    logprobs, NB logit-bias slots) and, in every entry, the sampler's inputs SAMPLING, RNG_SEED, RNG_STEP,
    TOKEN_MASK, LOGIT_BIAS_IDS, LOGIT_BIAS, TOKEN_HISTORY and outputs SAMPLED_TOKEN, TOKEN_LOGPROB,
    TOP_LOGPROBS, TOP_IDS (kernels/sampling.py). A manifest without them is served as before (the host
    samples from pulled logits); a runtime that predates them refuses the new roles by name.
    v4 + scorer (optional, still tlaloc-serving-v4): top-level `scorer` (N top logprobs per prompt position)
    and entries of kind prefill_scored: a prefill that also scores every position of the call against the
    token that follows it (input SCORE_TARGETS; outputs PROMPT_LOGPROB, PROMPT_RANK, PROMPT_TOP_LOGPROBS,
    PROMPT_TOP_IDS; kernels/scoring.py), for echo and prompt_logprobs. A manifest without them is served as
    before (such a prompt is read a token a call and scored on the host); a runtime that predates them refuses
    the new kind by name.
    v4 + quantized weights (optional, still tlaloc-serving-v4): a weight file may carry `quant` (WeightQuant:
    its QuantScheme, whether it holds the codes or the scales, the quantized weight's name, int4's group);
    checked at load (codes in the scheme's dtype, f32 scales of the matching shape, both halves present).
    A manifest without it has none; a runtime feeds the files by slot as before.
    v4 + mesh (optional, still tlaloc-serving-v4): top-level `mesh` (its axes' names and sizes) for an artifact
    whose bodies run on several devices (one SPMD body per entry, `mhlo.num_partitions` = the mesh's devices);
    each entry input and output, pool and weight may carry a `partition` (per dimension, the mesh axis it is
    split along, or null; absent or all null: whole on every device). A split weight is written as `shards`
    (one file per device, its shard, hashed) instead of `file`. A manifest without a mesh has none of these
    fields (its JSON is as before); a runtime that predates them refuses a split weight (it has no `file`).
    v4 + decode steps (optional, still tlaloc-serving-v4): entries of kind `decode_steps` with `steps` K (every
    entry now records `steps`, 1 when absent): K decode steps in one call, inputs STEP_LIMIT and STOP_IDS beside
    a decode entry's (the sampler's inputs included, RNG_STEP the first step's counter), output STEP_TOKENS
    [B, K] and the pools, no logits. Older manifests load unchanged; a runtime that predates the kind refuses it
    by name.
v2 and v3 manifests still load: `Manifest.from_json` upgrades them to the v4 model in memory (their
weights and tokenizer files carry no hashes; the loader says so).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import os
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = "tlaloc-serving.json"
SCHEMA_V2 = "tlaloc-serving-v2"
SCHEMA_V3 = "tlaloc-serving-v3"
SCHEMA_V4 = "tlaloc-serving-v4"
SUPPORTED_SCHEMAS = (SCHEMA_V2, SCHEMA_V3, SCHEMA_V4)
MAX_MANIFEST_BYTES = 64 << 20
_MAX_JSON_DEPTH = 32


class ManifestError(ValueError):
    """An artifact is refused at load; the message names the file, field or entry at fault."""


class Role(enum.StrEnum):
    """What an entry's input or output holds (docs/glossary.md)."""

    # The integer step inputs.
    TOKEN_IDS = "TOKEN_IDS"
    POSITIONS = "POSITIONS"
    SEQ_LENS = "SEQ_LENS"
    BLOCK_TABLES = "BLOCK_TABLES"
    SLOT_MAPPING = "SLOT_MAPPING"
    WINDOW_BLOCK_TABLES = "WINDOW_BLOCK_TABLES"
    WINDOW_SLOT_MAPPING = "WINDOW_SLOT_MAPPING"
    STATE_SLOTS = "STATE_SLOTS"
    # A pool (slot: the pool's name), donated: POOL_OUT is written over the POOL_IN of the same name.
    POOL_IN = "POOL_IN"
    POOL_OUT = "POOL_OUT"
    # A weight (slot: its name in the weight table).
    WEIGHT = "WEIGHT"
    # The sampler's per-row inputs (manifest `sampler`; kernels/sampling.py): SAMPLING [B, P] f32 (the
    # columns of Sampler.columns), RNG_SEED [B, 2] i32 (a 64-bit seed's low and high words), RNG_STEP [B]
    # i32 (tokens generated before the call: the random stream's counter), TOKEN_MASK [B, W] i32 (allowed
    # tokens, bit t % 32 of word t // 32), LOGIT_BIAS_IDS [B, NB] i32 (-1: empty) and LOGIT_BIAS [B, NB] f32,
    # TOKEN_HISTORY [B, C] i32 (the sequence's tokens by position, -1 past its end; C the entry's context).
    SAMPLING = "SAMPLING"
    RNG_SEED = "RNG_SEED"
    RNG_STEP = "RNG_STEP"
    TOKEN_MASK = "TOKEN_MASK"
    LOGIT_BIAS_IDS = "LOGIT_BIAS_IDS"
    LOGIT_BIAS = "LOGIT_BIAS"
    TOKEN_HISTORY = "TOKEN_HISTORY"
    # A scoring prefill's input (manifest `scorer`; kernels/scoring.py): SCORE_TARGETS [B, T] i32, the token each
    # position of the call is scored against (the next prompt token), -1 for none.
    SCORE_TARGETS = "SCORE_TARGETS"
    # A decode_steps entry's own inputs: STEP_LIMIT [B] i32 (the most tokens the row may produce in the call,
    # 0 for an empty row) and STOP_IDS [B, NS] i32 (ids that end the row once produced, -1: an empty slot).
    STEP_LIMIT = "STEP_LIMIT"
    STOP_IDS = "STOP_IDS"
    # A copy_slots entry's inputs: COPY_SRC [N] and COPY_DST [N] i32, slot src[i] copied to dst[i] in every state
    # pool (-1: no copy).
    COPY_SRC = "COPY_SRC"
    COPY_DST = "COPY_DST"
    # Outputs.
    LOGITS = "LOGITS"
    NEXT_TOKEN = "NEXT_TOKEN"
    # The sampler's outputs: the chosen token [B] i32, its logprob [B] f32 (log_softmax of the logits), the
    # N largest logprobs [B, N] f32 and their ids [B, N] i32.
    SAMPLED_TOKEN = "SAMPLED_TOKEN"
    TOKEN_LOGPROB = "TOKEN_LOGPROB"
    TOP_LOGPROBS = "TOP_LOGPROBS"
    TOP_IDS = "TOP_IDS"
    # A scoring prefill's outputs, per position of the call: the target's logprob [B, T] f32 and rank [B, T] i32
    # (1 + the tokens of larger logprob; both 0 where the target is -1), the N largest logprobs [B, T, N] f32 and
    # their ids [B, T, N] i32.
    PROMPT_LOGPROB = "PROMPT_LOGPROB"
    PROMPT_RANK = "PROMPT_RANK"
    PROMPT_TOP_LOGPROBS = "PROMPT_TOP_LOGPROBS"
    PROMPT_TOP_IDS = "PROMPT_TOP_IDS"
    # A decode_steps entry's tokens [B, K] i32: step i's token of each row, -1 once the row has stopped (its stop
    # id, its STEP_LIMIT) or for an empty row.
    STEP_TOKENS = "STEP_TOKENS"


class PoolKind(enum.StrEnum):
    """How a pool is indexed, and so what a sequence holds of it.

    paged_kv: pages of `block_size` positions; a sequence holds one page per block of its length.
    ring_kv: the same pages, but a sequence holds a ring of at most `ring_pages` of them (sliding layers:
        block b lives on ring page b % ring_pages).
    state_slots: one slot per live sequence, whatever its length (a recurrent layer's state).
    """

    PAGED_KV = "paged_kv"
    RING_KV = "ring_kv"
    STATE_SLOTS = "state_slots"


class EntryKind(enum.StrEnum):
    DECODE = "decode"      # one new token per sequence
    PREFILL = "prefill"    # up to tokens_per_seq tokens per sequence, rows right-aligned
    PREFILL_SCORED = "prefill_scored"  # a prefill that also scores each position (manifest `scorer`)
    # Up to `steps` decode steps in one call: each step's token (argmax, or the in-body sampler's) is fed to the
    # next; a row stops on one of its STOP_IDS or after STEP_LIMIT tokens; returns STEP_TOKENS, not the logits.
    DECODE_STEPS = "decode_steps"
    # Copies state slots within every state pool (export/_copy_slots.py): the runtime's state snapshots for prefix
    # caching. Its batch is the copies one call makes; it takes no step inputs and no weights.
    COPY_SLOTS = "copy_slots"


# The integer inputs of a call, by role, and the field of tlaloc_jax.paging.build_step_inputs (and of the
# decoder's StepInputs) each one is.
STEP_FIELDS: dict[Role, str] = {
    Role.TOKEN_IDS: "token_ids", Role.POSITIONS: "positions", Role.SEQ_LENS: "seq_lens",
    Role.BLOCK_TABLES: "block_tables", Role.SLOT_MAPPING: "slot_mapping",
    Role.WINDOW_BLOCK_TABLES: "window_block_tables", Role.WINDOW_SLOT_MAPPING: "window_slot_mapping",
    Role.STATE_SLOTS: "state_slots",
}
# Every entry takes these; each kind of pool it holds adds its own.
BASE_STEP_INPUTS = (Role.TOKEN_IDS, Role.POSITIONS, Role.SEQ_LENS)
POOL_KIND_INPUTS: dict[PoolKind, tuple[Role, ...]] = {
    PoolKind.PAGED_KV: (Role.BLOCK_TABLES, Role.SLOT_MAPPING),
    PoolKind.RING_KV: (Role.WINDOW_BLOCK_TABLES, Role.WINDOW_SLOT_MAPPING),
    PoolKind.STATE_SLOTS: (Role.STATE_SLOTS,),
}
# The sampler's inputs and outputs, in signature order (after the step inputs; its outputs after NEXT_TOKEN).
SAMPLER_INPUTS = (Role.SAMPLING, Role.RNG_SEED, Role.RNG_STEP, Role.TOKEN_MASK, Role.LOGIT_BIAS_IDS, Role.LOGIT_BIAS,
                  Role.TOKEN_HISTORY)
SAMPLER_OUTPUTS = (Role.SAMPLED_TOKEN, Role.TOKEN_LOGPROB, Role.TOP_LOGPROBS, Role.TOP_IDS)
# A scoring prefill's input and outputs, in signature order (after the sampler's).
SCORER_INPUTS = (Role.SCORE_TARGETS,)
SCORER_OUTPUTS = (Role.PROMPT_LOGPROB, Role.PROMPT_RANK, Role.PROMPT_TOP_LOGPROBS, Role.PROMPT_TOP_IDS)
# The columns of SAMPLING a runtime knows how to fill, each with its neutral value (kernels/sampling.py).
SAMPLING_COLUMNS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "top_logprobs")
# A decode_steps entry's inputs beyond a decode entry's (after the sampler's, before the pools), and its outputs.
DECODE_STEPS_INPUTS = (Role.STEP_LIMIT, Role.STOP_IDS)
DECODE_STEPS_OUTPUTS = (Role.STEP_TOKENS,)
# A copy_slots entry's inputs, before its state pools.
COPY_INPUTS = (Role.COPY_SRC, Role.COPY_DST)
INPUT_ROLES = (frozenset(STEP_FIELDS) | {Role.POOL_IN, Role.WEIGHT} | frozenset(SAMPLER_INPUTS)
               | frozenset(SCORER_INPUTS) | frozenset(DECODE_STEPS_INPUTS) | frozenset(COPY_INPUTS))
OUTPUT_ROLES = (frozenset({Role.LOGITS, Role.NEXT_TOKEN, Role.POOL_OUT}) | frozenset(SAMPLER_OUTPUTS)
                | frozenset(SCORER_OUTPUTS) | frozenset(DECODE_STEPS_OUTPUTS))


@dataclass(frozen=True)
class DType:
    name: str        # as numpy / ml_dtypes spell it, and the manifest
    itemsize: int
    mlir: str        # as StableHLO spells it


# The one dtype table of the project: what an artifact may hold, and how each side names it.
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float32", 4, "f32"), DType("bfloat16", 2, "bf16"), DType("float16", 2, "f16"),
    DType("float8_e4m3fn", 1, "f8E4M3FN"), DType("int32", 4, "i32"), DType("int8", 1, "i8"),
    DType("uint8", 1, "ui8"), DType("bool", 1, "i1"))}
MLIR_DTYPES = {d.mlir: d.name for d in DTYPES.values()}


def dtype_info(name: str, what: str = "dtype") -> DType:
    if name not in DTYPES:
        raise ManifestError(f"{what} has unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    return DTYPES[name]


def numpy_dtype(name: str):
    """The numpy dtype of a manifest dtype name (bfloat16 and float8 through ml_dtypes)."""
    import numpy as np
    dtype_info(name)
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def nbytes(dtype: str, shape: tuple[int, ...], what: str = "tensor") -> int:
    n = dtype_info(dtype, what).itemsize
    for d in shape:
        n *= d
    return n


# A partition: per dimension of an array, the mesh axis it is split along, or None (docs/multi-device.md).
Partition = tuple[str | None, ...]


@dataclass(frozen=True)
class TensorSig:
    """One input or output of an entry. `slot` names the weight for role WEIGHT, the pool for pool roles.
    `partition` (with a mesh): how the body takes it split over the devices; () whole on each."""

    role: Role
    dtype: str
    shape: tuple[int, ...]
    slot: str = ""
    partition: Partition = ()

    @property
    def label(self) -> str:
        return f"{self.role}{' ' + self.slot if self.slot else ''}"


@dataclass(frozen=True)
class Entry:
    """One compiled program: a decode or prefill call of `batch` sequences in a `context`-position bucket."""

    name: str
    kind: EntryKind
    batch: int
    context: int
    tokens_per_seq: int
    body: str                      # bodies/<sha256>.mlir, textual StableHLO (its @main is checked at load)
    body_sha256: str
    serialized: str                # bodies/<sha256>.mlirbc, portable StableHLO bytecode: what the runtime compiles
    serialized_sha256: str
    program: str                   # programs/<name>.json
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    donations: tuple[tuple[int, int], ...]   # (output index, input index it is written over)
    kept_inputs: tuple[int, ...]             # jax.export's module_kept_var_idx: all of them, checked at export
    exported: str = ""             # bodies/<sha256>.exported, jax.export's serialization (v4; for jax callers)
    exported_sha256: str = ""
    steps: int = 1                 # decode steps per call: K for a decode_steps entry, else 1

    def input_index(self, role: Role, slot: str = "") -> int:
        for i, sig in enumerate(self.inputs):
            if sig.role == role and (not slot or sig.slot == slot):
                return i
        raise ManifestError(f"entry {self.name!r} has no input with role {role}{' ' + slot if slot else ''}")

    def output_index(self, role: Role, slot: str = "") -> int:
        for i, sig in enumerate(self.outputs):
            if sig.role == role and (not slot or sig.slot == slot):
                return i
        raise ManifestError(f"entry {self.name!r} has no output with role {role}{' ' + slot if slot else ''}")


class QuantScheme(enum.StrEnum):
    """How a quantized weight's codes stand for its values (kernels/quantized_matmul.py): int8 and fp8 (e4m3fn)
    codes [..., I, O] with f32 scales per output channel [..., O]; int4 codes two a byte (int8 [..., I / 2, O])
    with f32 scales per group of `group` input channels [..., I / group, O]."""

    INT8 = "int8"
    FP8 = "fp8"
    INT4 = "int4"


class QuantPart(enum.StrEnum):
    CODES = "codes"
    SCALES = "scales"


# The dtype of each scheme's codes (scales are float32), and int4's group sizes.
QUANT_CODE_DTYPES = {QuantScheme.INT8: "int8", QuantScheme.FP8: "float8_e4m3fn", QuantScheme.INT4: "int8"}
QUANT_GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class WeightQuant:
    """A weight file that is half of a quantized weight: its codes or its scales. `weight` names the quantized
    weight (the codes' and the scales' slots are `weight`.codes and `weight`.scales)."""

    scheme: QuantScheme
    part: QuantPart
    weight: str
    group: int = 0                 # int4: input channels per scale; 0 otherwise


@dataclass(frozen=True)
class WeightShard:
    """One device's part of a split weight: device d's d-th block along the split axis, raw like a weight file."""

    file: str
    nbytes: int
    sha256: str = ""


@dataclass(frozen=True)
class WeightFile:
    slot: str
    dtype: str
    shape: tuple[int, ...]         # the whole weight's
    nbytes: int
    file: str = ""                 # weights/NNNN_<slot>.bin, raw little-endian, no header ("" for a split weight)
    sha256: str = ""               # v4; "" in v2/v3 artifacts
    quant: WeightQuant | None = None   # v4, optional: part of a quantized weight (None: a plain one)
    partition: Partition = ()      # v4 + mesh: split over the devices, in `shards`, one per device, in order
    shards: tuple[WeightShard, ...] = ()


@dataclass(frozen=True)
class Pool:
    """A device-resident pool: its layers stacked, donated to every entry that takes it.

    shape: paged_kv and ring_kv [L', 2, P, S, K, D] with P = capacity pages of S = block_size positions;
    state_slots any shape with capacity slots on axis `slot_axis`. Pools of one kind share an index
    space (one block table, or one state slot per sequence), so they have one capacity.
    """

    name: str
    kind: PoolKind
    dtype: str
    shape: tuple[int, ...]
    capacity: int                  # pages (paged_kv, ring_kv) or slots (state_slots)
    layers: tuple[int, ...] = ()   # the model layers it holds, in stack order (informative)
    slot_axis: int = 2             # the axis of shape that capacity indexes
    window: int = 0                # ring_kv: the sliding window, in positions
    ring_pages: int = 0            # ring_kv: pages of a sequence's ring
    partition: Partition = ()      # v4 + mesh: split over the devices (KV pools over their KV heads)

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape, f"pool {self.name!r}")


@dataclass(frozen=True)
class TokenizerFile:
    file: str
    sha256: str = ""               # v4; "" in v2/v3 artifacts


@dataclass(frozen=True)
class ModelShape:
    """What the runtime needs of the model (name, vocabulary, stop ids) and what describes it to a reader."""

    name: str
    model_type: str                # an HF family, or "authored" (tlaloc_jax.stage)
    vocab: int
    weight_dtype: str
    kv_dtype: str = ""
    eos_token_ids: tuple[int, ...] = ()
    embedding_slot: str = ""       # the weight whose rows are the vocabulary (v4), checked at load
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    hidden: int = 0


@dataclass(frozen=True)
class Buckets:
    batch_ladder: tuple[int, ...]
    context_ladder: tuple[int, ...]
    prefill_max_batch: int
    prefill_chunk: int             # 0: a prefill entry takes its whole context per call


@dataclass(frozen=True)
class RefusedToken:
    token_id: int
    config_key: str


@dataclass(frozen=True)
class Sampler:
    """The sampler every entry runs after the step (kernels/sampling.py): the SAMPLING columns in order, the
    N top logprobs it returns, the NB logit-bias slots it takes, the W words of its token mask."""

    columns: tuple[str, ...]
    top_logprobs: int
    logit_bias: int
    mask_words: int

    def shapes(self, batch: int, context: int) -> dict[Role, tuple[int, ...]]:
        """Each sampler role's shape in an entry of `batch` rows and `context` positions."""
        return {Role.SAMPLING: (batch, len(self.columns)), Role.RNG_SEED: (batch, 2), Role.RNG_STEP: (batch,),
                Role.TOKEN_MASK: (batch, self.mask_words), Role.LOGIT_BIAS_IDS: (batch, self.logit_bias),
                Role.LOGIT_BIAS: (batch, self.logit_bias), Role.TOKEN_HISTORY: (batch, context),
                Role.SAMPLED_TOKEN: (batch,), Role.TOKEN_LOGPROB: (batch,),
                Role.TOP_LOGPROBS: (batch, self.top_logprobs), Role.TOP_IDS: (batch, self.top_logprobs)}


SAMPLER_DTYPES = {Role.SAMPLING: "float32", Role.LOGIT_BIAS: "float32", Role.TOKEN_LOGPROB: "float32",
                  Role.TOP_LOGPROBS: "float32"}      # the others are int32


@dataclass(frozen=True)
class Scorer:
    """What the scoring prefill entries (kind prefill_scored) return per position: the N top logprobs."""

    top_logprobs: int

    def shapes(self, batch: int, tokens: int) -> dict[Role, tuple[int, ...]]:
        """Each scorer role's shape in an entry of `batch` rows of `tokens` tokens."""
        return {Role.SCORE_TARGETS: (batch, tokens), Role.PROMPT_LOGPROB: (batch, tokens),
                Role.PROMPT_RANK: (batch, tokens), Role.PROMPT_TOP_LOGPROBS: (batch, tokens, self.top_logprobs),
                Role.PROMPT_TOP_IDS: (batch, tokens, self.top_logprobs)}


SCORER_DTYPES = {Role.PROMPT_LOGPROB: "float32", Role.PROMPT_TOP_LOGPROBS: "float32"}     # the others are int32


@dataclass(frozen=True)
class Versions:
    """What produced the bodies; a runtime checks them against its plugin."""

    jax: str
    jaxlib: str
    calling_convention: int
    platform: str
    attention_block: int = 0


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int


@dataclass(frozen=True)
class Mesh:
    """The devices a multi-device artifact runs on (v4 + mesh): one SPMD body per entry, every array either whole
    on each device or split along the mesh axes its partition names, device d holding block d."""

    axes: tuple[MeshAxis, ...]

    @property
    def devices(self) -> int:
        n = 1
        for a in self.axes:
            n *= a.size
        return n

    def shards(self, partition: Partition) -> int:
        """How many blocks an array of this partition is cut into (1: whole on every device)."""
        sizes = {a.name: a.size for a in self.axes}
        n = 1
        for name in partition:
            n *= sizes[name] if name else 1
        return n

    def shard_shape(self, shape: tuple[int, ...], partition: Partition) -> tuple[int, ...]:
        """One device's block of an array of `shape` split as `partition` says."""
        sizes = {a.name: a.size for a in self.axes}
        return tuple(d // sizes[name] if name else d for d, name in zip(shape, partition or (None,) * len(shape)))


@dataclass(frozen=True)
class Manifest:
    schema: str
    model: ModelShape
    block_size: int
    pools: tuple[Pool, ...]
    buckets: Buckets
    entries: tuple[Entry, ...]
    weights: tuple[WeightFile, ...]
    versions: Versions
    refused_tokens: tuple[RefusedToken, ...] = ()
    tokenizer_files: tuple[TokenizerFile, ...] = ()
    sampler: Sampler | None = None     # v4 + sampler: every entry samples in its body
    scorer: Scorer | None = None       # v4 + scorer: prefill_scored entries score each prompt position
    mesh: Mesh | None = None           # v4 + mesh: the entries run on mesh.devices devices

    @property
    def devices(self) -> int:
        """The devices the artifact runs on (1 without a mesh)."""
        return self.mesh.devices if self.mesh else 1

    def pool(self, name: str) -> Pool | None:
        return next((p for p in self.pools if p.name == name), None)

    def pools_of(self, kind: PoolKind) -> tuple[Pool, ...]:
        return tuple(p for p in self.pools if p.kind == kind)

    @property
    def pool_kinds(self) -> tuple[PoolKind, ...]:
        """The kinds of the artifact's pools, in PoolKind order."""
        return tuple(k for k in PoolKind if self.pools_of(k))

    def capacity(self, kind: PoolKind) -> int:
        return self.pools_of(kind)[0].capacity

    @property
    def ring(self) -> Pool | None:
        """The first ring_kv pool (its window and ring size are the runtime's), or None."""
        rings = self.pools_of(PoolKind.RING_KV)
        return rings[0] if rings else None

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise ManifestError(f"no entry named {name!r}")

    def to_json(self) -> str:
        return json.dumps(_drop_unset(dataclasses.asdict(self)), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str | bytes) -> "Manifest":
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ManifestError(f"{MANIFEST_NAME} is not UTF-8 text: {e}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{MANIFEST_NAME} is not valid JSON: {e}") from None
        except RecursionError:
            raise ManifestError(f"{MANIFEST_NAME} nests deeper than any manifest") from None
        if not isinstance(raw, dict):
            raise ManifestError(f"{MANIFEST_NAME} must hold a JSON object")
        _check_depth(raw, _MAX_JSON_DEPTH)
        schema = raw.get("schema")
        if schema not in SUPPORTED_SCHEMAS:
            raise ManifestError(f"unknown manifest schema version {schema!r} (this runtime reads "
                                f"{', '.join(SUPPORTED_SCHEMAS)})")
        if schema in (SCHEMA_V2, SCHEMA_V3):
            raw = _upgrade_v2_v3(raw)
        return _build(Manifest, raw, "manifest")


# Fields a one-device manifest leaves out of its JSON when unset, so that it reads as it did before meshes.
_MESH_FIELDS = ("mesh", "partition", "shards")


def record_json(record: Any) -> Any:
    """A manifest record (a dataclass) as JSON-ready values, leaving out the mesh fields it does not set."""
    return _drop_unset(dataclasses.asdict(record))


def _drop_unset(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _drop_unset(v) for k, v in node.items() if not (k in _MESH_FIELDS and not v)}
    if isinstance(node, (list, tuple)):
        return [_drop_unset(v) for v in node]
    return node


def _check_depth(node: Any, limit: int) -> None:
    stack = [(node, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            raise ManifestError(f"{MANIFEST_NAME} nests deeper than any manifest ({limit} levels)")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


_V3_POOL_ROLES = {"KV_POOL_IN": Role.POOL_IN, "WINDOW_KV_POOL_IN": Role.POOL_IN,
                  "KV_POOL_OUT": Role.POOL_OUT, "WINDOW_KV_POOL_OUT": Role.POOL_OUT}


def _upgrade_v2_v3(raw: dict) -> dict:
    """A v2 or v3 manifest as the v4 model reads it: pools get their kind and capacity, pool roles become
    POOL_IN / POOL_OUT, tokenizer files carry an empty hash. The schema string is kept."""
    raw = dict(raw)
    window = raw.pop("window", None) or {}
    if not isinstance(window, dict):
        raise ManifestError("manifest.window must be an object")
    pools = []
    for i, p in enumerate(raw.get("pools") or []):
        if not isinstance(p, dict):
            raise ManifestError(f"manifest.pools[{i}] must be an object")
        ring = p.get("in_role") == "WINDOW_KV_POOL_IN"
        if ring and not window:
            raise ManifestError(f"schema {raw.get('schema')} pool {p.get('name')!r} is windowed, but the manifest "
                                "has no window")
        pools.append({"name": p.get("name"), "kind": PoolKind.RING_KV if ring else PoolKind.PAGED_KV,
                      "dtype": p.get("dtype"), "shape": p.get("shape"), "capacity": p.get("num_blocks"),
                      "layers": p.get("layers", []), "slot_axis": 2,
                      "window": window.get("window", 0) if ring else 0,
                      "ring_pages": window.get("ring_pages", 0) if ring else 0})
    if raw.get("schema") == SCHEMA_V3 and not any(p["kind"] == PoolKind.RING_KV for p in pools):
        raise ManifestError(f"schema {SCHEMA_V3} needs a windowed pool (window_kv)")
    raw["pools"] = pools
    entries = []
    for e in raw.get("entries") or []:
        if isinstance(e, dict):
            e = dict(e)
            for key in ("inputs", "outputs"):
                e[key] = [dict(s, role=_V3_POOL_ROLES.get(s.get("role"), s.get("role"))) if isinstance(s, dict)
                          else s for s in (e.get(key) or [])]
        entries.append(e)
    raw["entries"] = entries
    raw["tokenizer_files"] = [{"file": f, "sha256": ""} for f in raw.get("tokenizer_files") or []]
    return raw


def _build(cls, raw: Any, where: str):
    """Build dataclass `cls` from parsed JSON, naming any missing or mistyped field by its path."""
    if dataclasses.is_dataclass(cls):
        if not isinstance(raw, dict):
            raise ManifestError(f"{where} must be an object")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in raw:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise ManifestError(f"missing field {where}.{f.name}")
            kwargs[f.name] = _build(_field_types(cls)[f.name], raw[f.name], f"{where}.{f.name}")
        return cls(**kwargs)
    if type(cls) is types.UnionType:       # X | None
        if raw is None:
            return None
        return _build(next(a for a in cls.__args__ if a is not type(None)), raw, where)
    if getattr(cls, "__origin__", None) is tuple:
        if not isinstance(raw, list):
            raise ManifestError(f"{where} must be a list")
        args = cls.__args__
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], x, f"{where}[{i}]") for i, x in enumerate(raw))
        if len(raw) != len(args):
            raise ManifestError(f"{where} must have {len(args)} items")
        return tuple(_build(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, raw)))
    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        try:
            return cls(raw)
        except ValueError:
            raise ManifestError(f"{where} is {raw!r}, not a known {cls.__name__} "
                                f"({', '.join(m.value for m in cls)})") from None
    if cls is int and not (isinstance(raw, int) and not isinstance(raw, bool)):
        raise ManifestError(f"{where} must be an integer, got {raw!r}")
    if cls is str and not isinstance(raw, str):
        raise ManifestError(f"{where} must be a string, got {raw!r}")
    return raw


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    """A manifest dataclass's field types, resolved once (this module's, and tlaloc_jax.bounded_manifest's, which
    builds its schema with `_build` too)."""
    import typing
    return typing.get_type_hints(cls)


# -- the bodies' @main, read from textual StableHLO ------------------------------------------------

_MAIN = re.compile(r"func\.func public @main\((.*?)\)\s*->\s*\((.*?)\)\s*\{", re.S)
# An argument's attributes may hold braces one level deep (a mesh body's sdy.sharding: [{}, {"tp"}]).
_ARG = re.compile(r"%arg\d+: tensor<([^>]*)>(\s*\{(?:[^{}]|\{[^{}]*\})*\})?")
_ALIAS = re.compile(r"tf\.aliasing_output = (\d+)")
_RESULT = re.compile(r"tensor<([^>]*)>(\s*\{(?:[^{}]|\{[^{}]*\})*\})?")
# A Shardy sharding (what jax.export writes for a mesh body): per dimension {} or {"axis"}.
_SDY = re.compile(r"sdy\.sharding = #sdy\.sharding<@\w+, \[((?:[^\[\]])*)\]")
_PARTITIONS = re.compile(r"mhlo\.num_partitions = (\d+)")


@dataclass(frozen=True)
class MainSignature:
    """@main of a body: each argument's (dtype, shape, aliased output or None), each result's (dtype, shape); the
    devices it is partitioned for and each argument's and result's partition (() when whole on each)."""

    args: tuple[tuple[str, tuple[int, ...], int | None], ...]
    results: tuple[tuple[str, tuple[int, ...]], ...]
    partitions: int = 1
    arg_partitions: tuple[Partition, ...] = ()
    result_partitions: tuple[Partition, ...] = ()


def _partition(attrs: str) -> Partition:
    """The partition of an argument or result from its attributes (a dimension split along several axes reads as
    the names joined by ",", which no manifest names)."""
    m = _SDY.search(attrs or "")
    if not m:
        return ()
    dims = tuple(",".join(re.findall(r'"([^"]+)"', d)) or None for d in re.findall(r"\{([^{}]*)\}", m.group(1)))
    return dims if any(dims) else ()


def _parse_tensor(t: str) -> tuple[str, tuple[int, ...]]:
    parts = t.split("x")
    try:
        shape = tuple(int(p) for p in parts[:-1])
    except ValueError:
        shape = (-1,)                       # a dynamic dimension: never equals a manifest shape
    return MLIR_DTYPES.get(parts[-1], parts[-1]), shape


def main_signature(mlir_text: str, what: str = "body") -> MainSignature:
    m = _MAIN.search(mlir_text)
    if not m:
        raise ManifestError(f"{what} has no public @main")
    args, arg_parts = [], []
    for tensor, attrs in _ARG.findall(m.group(1)):
        alias = _ALIAS.search(attrs or "")
        args.append((*_parse_tensor(tensor), int(alias.group(1)) if alias else None))
        arg_parts.append(_partition(attrs))
    found = _RESULT.findall(m.group(2))
    partitions = _PARTITIONS.search(mlir_text[:m.start()])
    return MainSignature(tuple(args), tuple(_parse_tensor(r) for r, _ in found),
                         int(partitions.group(1)) if partitions else 1, tuple(arg_parts),
                         tuple(_partition(a) for _, a in found))


def signature_mismatch(inputs: tuple[TensorSig, ...], outputs: tuple[TensorSig, ...],
                       donations: tuple[tuple[int, int], ...], sig: MainSignature, devices: int = 1) -> str | None:
    """Why a body's @main does not take and return `inputs` and `outputs` with the pools aliased as `donations`
    say, partitioned for `devices` devices and each split as its partition says (None when it does)."""
    if len(sig.args) != len(inputs):
        return f"its @main takes {len(sig.args)} arguments, the manifest lists {len(inputs)} inputs"
    if sig.partitions != devices:
        return f"it is partitioned for {sig.partitions} devices, the manifest's mesh has {devices}"
    aliases = {i: o for o, i in donations}
    for i, ((dtype, shape, alias), want) in enumerate(zip(sig.args, inputs)):
        if (dtype, shape) != (want.dtype, tuple(want.shape)):
            return (f"argument {i} ({want.label}) is {dtype}{list(shape)} in the body, the manifest says "
                    f"{want.dtype}{list(want.shape)}")
        if alias != aliases.get(i):
            return f"argument {i} ({want.label}) is aliased to output {alias} in the body, the manifest says " \
                   f"{aliases.get(i)}"
        if devices > 1 and _split(sig.arg_partitions[i]) != _split(want.partition):
            return (f"argument {i} ({want.label}) is split {list(sig.arg_partitions[i])} in the body, the manifest "
                    f"says {list(want.partition)}")
    if len(sig.results) != len(outputs):
        return f"its @main returns {len(sig.results)} results, the manifest lists {len(outputs)} outputs"
    for i, ((dtype, shape), want) in enumerate(zip(sig.results, outputs)):
        if (dtype, shape) != (want.dtype, tuple(want.shape)):
            return (f"result {i} ({want.label}) is {dtype}{list(shape)} in the body, the manifest says "
                    f"{want.dtype}{list(want.shape)}")
        if devices > 1 and _split(sig.result_partitions[i]) != _split(want.partition):
            return (f"result {i} ({want.label}) is split {list(sig.result_partitions[i])} in the body, the manifest "
                    f"says {list(want.partition)}")
    return None


def _split(partition: Partition) -> Partition:
    """A partition with whole arrays read alike: () and all None are both ()."""
    return tuple(partition) if any(partition) else ()


# -- files ---------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_inside(root: Path, rel: str, what: str) -> Path:
    """The path `rel` inside artifact directory `root`; refuses absolute paths, '..' and symlinks out."""
    if not rel or os.path.isabs(rel) or Path(rel).drive:
        raise ManifestError(f"{what} path {rel!r} is not relative to the artifact directory")
    if ".." in Path(rel).parts:
        raise ManifestError(f"{what} path {rel!r} leaves the artifact directory")
    root = root.resolve()
    path = (root / rel).resolve()
    if root != path and root not in path.parents:
        raise ManifestError(f"{what} path {rel!r} leaves the artifact directory")
    return path


def _checked_file(root: Path, rel: str, digest: str | None, what: str) -> Path:
    """A file the manifest lists: inside the artifact, present, and (digest given) with that sha256."""
    p = resolve_inside(root, rel, what)
    if not p.is_file():
        raise ManifestError(f"{what} {rel!r} does not exist")
    if digest is not None:
        got = sha256_file(p)
        if got != digest:
            raise ManifestError(f"{what} {rel!r} has sha256 {got}, the manifest says {digest}")
    return p


def artifact_file(root: str | os.PathLike, manifest: Manifest, name: str) -> Path | None:
    """A tokenizer file the manifest lists, checked like every other file (None when it lists none by that
    name). The runtime opens no other file of an artifact directory."""
    for t in manifest.tokenizer_files:
        if t.file == name:
            return _checked_file(Path(root), t.file, t.sha256 or None, "tokenizer file")
    return None


def _validate_quant(weights: tuple[WeightFile, ...]) -> None:
    """Each quantized weight has its codes in its scheme's dtype and its f32 scales, of matching shapes."""
    parts: dict[str, dict[QuantPart, WeightFile]] = {}
    for w in weights:
        q = w.quant
        if q is None:
            continue
        what = f"weight {w.slot!r} ({q.scheme} {q.part} of {q.weight!r})"
        if w.slot != f"{q.weight}.{q.part}":
            raise ManifestError(f"{what}: its slot should be {q.weight}.{q.part}")
        if (q.group in QUANT_GROUPS) != (q.scheme == QuantScheme.INT4):
            raise ManifestError(f"{what}: group {q.group} is not " + (f"one of {QUANT_GROUPS}" if q.scheme ==
                                QuantScheme.INT4 else "0 (only int4 has groups)"))
        want = QUANT_CODE_DTYPES[q.scheme] if q.part == QuantPart.CODES else "float32"
        if w.dtype != want:
            raise ManifestError(f"{what} has dtype {w.dtype}; {q.scheme} {q.part} are {want}")
        if len(w.shape) < (2 if q.part == QuantPart.CODES else 1):
            raise ManifestError(f"{what} has shape {list(w.shape)}, too few axes")
        seen = parts.setdefault(q.weight, {})
        if q.part in seen or (seen and next(iter(seen.values())).quant.scheme != q.scheme):
            raise ManifestError(f"{what}: the quantized weight has two {q.part} or two schemes")
        seen[q.part] = w
    for name, seen in parts.items():
        if set(seen) != set(QuantPart):
            missing = next(p for p in QuantPart if p not in seen)
            raise ManifestError(f"quantized weight {name!r} has no {missing} file")
        codes, scales, q = seen[QuantPart.CODES], seen[QuantPart.SCALES], seen[QuantPart.CODES].quant
        *lead, rows, cols = codes.shape
        want = (*lead, rows * 2 // q.group, cols) if q.scheme == QuantScheme.INT4 else (*lead, cols)
        if q.scheme == QuantScheme.INT4 and (rows * 2) % q.group:
            raise ManifestError(f"quantized weight {name!r}: int4 groups of {q.group} do not tile {rows * 2} inputs")
        if tuple(scales.shape) != tuple(want):
            raise ManifestError(f"quantized weight {name!r}: codes {list(codes.shape)} need scales {list(want)}, "
                                f"got {list(scales.shape)}")


def load_manifest(artifact_dir: str | os.PathLike, *, verify_files: bool = True,
                  verify_weights: bool = True) -> Manifest:
    """Read and validate an artifact directory's manifest.

    verify_files: check every file the manifest lists (inside the artifact, present, the right size, and its
    sha256 where the manifest has one) and each body's @main against its entry. verify_weights False skips
    hashing the weight files (their sizes are still checked): for very large artifacts whose weights are
    trusted (`--trust-weights`).
    """
    root = Path(artifact_dir)
    path = root / MANIFEST_NAME
    if not path.is_file():
        from .bounded_manifest import BOUNDED_NAME
        if (root / BOUNDED_NAME).is_file():
            raise ManifestError(f"no {MANIFEST_NAME} in the artifact directory: it holds a bounded program "
                                f"({BOUNDED_NAME}), not a decoder; load it with tlaloc_jax.serve.BoundedProgram "
                                "(python -m tlaloc_jax.serve --embedding-artifact DIR serves an embedding program)")
        raise ManifestError(f"no {MANIFEST_NAME} in the artifact directory")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{MANIFEST_NAME} is {path.stat().st_size} bytes, more than any manifest "
                            f"({MAX_MANIFEST_BYTES})")
    m = Manifest.from_json(path.read_bytes())
    _check_consistency(m)
    if verify_files:
        for e in m.entries:
            body = _checked_file(root, e.body, e.body_sha256, f"entry {e.name!r} body")
            _checked_file(root, e.serialized, e.serialized_sha256, f"entry {e.name!r} serialized body")
            if e.exported:
                _checked_file(root, e.exported, e.exported_sha256, f"entry {e.name!r} exported body")
            _checked_file(root, e.program, None, f"entry {e.name!r} program")
            why = signature_mismatch(e.inputs, e.outputs, e.donations,
                                     main_signature(body.read_text(encoding="utf-8", errors="replace"),
                                                    f"entry {e.name!r} body"), m.devices)
            if why:
                raise ManifestError(f"entry {e.name!r} body {e.body!r} does not match the manifest: {why}")
        for w in m.weights:
            for file, size, digest in ([(s.file, s.nbytes, s.sha256) for s in w.shards] or
                                       [(w.file, w.nbytes, w.sha256)]):
                got = _checked_file(root, file, None, f"weight {w.slot!r} file").stat().st_size
                if got != size:
                    raise ManifestError(f"weight {w.slot!r} file {file!r} has {got} bytes, the manifest says {size}")
                if verify_weights and digest:
                    _checked_file(root, file, digest, f"weight {w.slot!r} file")
        for t in m.tokenizer_files:
            _checked_file(root, t.file, t.sha256 or None, "tokenizer file")
    return m


# -- cross-field checks -------------------------------------------------------------------------------------


def _check_sampler_sig(m: Manifest, e: Entry, sig: TensorSig, what: str) -> None:
    if m.sampler is None:
        raise ManifestError(f"{what} has {sig.role}, but the manifest has no sampler")
    want = (SAMPLER_DTYPES.get(sig.role, "int32"), m.sampler.shapes(e.batch, e.context)[sig.role])
    if (sig.dtype, tuple(sig.shape)) != want:
        raise ManifestError(f"{what} {sig.role} is {sig.dtype}{list(sig.shape)}, the sampler's is {want[0]}{list(want[1])}")


def _check_scorer_sig(m: Manifest, e: Entry, sig: TensorSig, what: str) -> None:
    if e.kind != EntryKind.PREFILL_SCORED or m.scorer is None:
        raise ManifestError(f"{what} has {sig.role}, which only a {EntryKind.PREFILL_SCORED} entry of a manifest "
                            "with a scorer has")
    want = (SCORER_DTYPES.get(sig.role, "int32"), m.scorer.shapes(e.batch, e.tokens_per_seq)[sig.role])
    if (sig.dtype, tuple(sig.shape)) != want:
        raise ManifestError(f"{what} {sig.role} is {sig.dtype}{list(sig.shape)}, the scorer's is "
                            f"{want[0]}{list(want[1])}")
def _check_steps_sig(e: Entry, sig: TensorSig, what: str) -> None:
    if e.kind != EntryKind.DECODE_STEPS:
        raise ManifestError(f"{what} has {sig.role}, which only a decode_steps entry takes")
    want = {Role.STEP_LIMIT: (e.batch,), Role.STEP_TOKENS: (e.batch, e.steps)}.get(sig.role)
    ok = sig.dtype == "int32" and (tuple(sig.shape) == want if want else
                                   len(sig.shape) == 2 and sig.shape[0] == e.batch)
    if not ok:
        raise ManifestError(f"{what} {sig.role} is {sig.dtype}{list(sig.shape)}; a decode_steps entry of batch "
                            f"{e.batch} and {e.steps} steps takes int32{list(want) if want else [e.batch, 'NS']}")


def _check_partition(m: Manifest, partition: Partition, shape: tuple[int, ...], what: str) -> None:
    if not any(partition):
        return
    if m.mesh is None:
        raise ManifestError(f"{what} is split {list(partition)}, but the manifest has no mesh")
    sizes = {a.name: a.size for a in m.mesh.axes}
    if len(partition) != len(shape):
        raise ManifestError(f"{what}: partition {list(partition)} does not give each of its {len(shape)} dimensions")
    named = [n for n in partition if n]
    for d, name in zip(shape, partition):
        if name is None:
            continue
        if name not in sizes:
            raise ManifestError(f"{what} is split along {name!r}, which is not a mesh axis ({', '.join(sizes)})")
        if d % sizes[name]:
            raise ManifestError(f"{what}: dimension {d} does not split into {sizes[name]} blocks along {name!r}")
    if len(set(named)) != len(named):
        raise ManifestError(f"{what} is split twice along one mesh axis: {list(partition)}")


def _check_mesh(m: Manifest, slots: dict[str, WeightFile], pools: dict[str, Pool]) -> None:
    """The mesh (one axis: what this runtime serves) and every partition against it: each split dimension names
    a mesh axis and divides evenly; weights and pools are taken by every entry as the manifest splits them; step
    inputs and results other than pools are whole on every device; a split weight has one shard file per block,
    a whole one its file."""
    if m.mesh is not None:
        axes = [a.name for a in m.mesh.axes]
        if len(axes) != 1:
            raise ManifestError(f"mesh has axes {axes}: this runtime serves a mesh of one axis (tensor parallelism)")
        _positive(m.mesh.axes[0].size, f"mesh axis {axes[0]!r} size")
    for p in m.pools:
        _check_partition(m, p.partition, p.shape, f"pool {p.name!r}")
    for w in m.weights:
        what = f"weight {w.slot!r}"
        _check_partition(m, w.partition, w.shape, what)
        if any(w.partition):
            blocks = m.mesh.shards(w.partition)
            if w.file or len(w.shards) != blocks:
                raise ManifestError(f"{what} is split into {blocks} blocks: it needs {blocks} shard files and no "
                                    f"whole file (it has {len(w.shards)}{' and ' + repr(w.file) if w.file else ''})")
            for s in w.shards:
                if s.nbytes * blocks != w.nbytes:
                    raise ManifestError(f"{what} shard {s.file!r} has {s.nbytes} bytes, 1/{blocks} of {w.nbytes}")
                if m.schema == SCHEMA_V4 and not s.sha256:
                    raise ManifestError(f"{what} shard {s.file!r} has no sha256 ({SCHEMA_V4} hashes every file)")
        elif w.shards or not w.file:
            raise ManifestError(f"{what} is whole on every device: it needs one file and no shards")
    for e in m.entries:
        for sig in (*e.inputs, *e.outputs):
            what = f"entry {e.name!r} {sig.label}"
            _check_partition(m, sig.partition, sig.shape, what)
            if sig.role == Role.WEIGHT:
                want = slots[sig.slot].partition
            elif sig.role in (Role.POOL_IN, Role.POOL_OUT):
                want = pools[sig.slot].partition
            else:
                want = ()
            if _split(sig.partition) != _split(want):
                raise ManifestError(f"{what} is split {list(sig.partition)}; the manifest keeps it "
                                    f"{list(want) if any(want) else 'whole'}")


def _check_copy_entry(m: Manifest, e: Entry, what: str) -> None:
    """A copy_slots entry: COPY_SRC and COPY_DST [batch] int32, then every state pool in and out, donated."""
    _positive(e.batch, f"{what} batch")
    state = [p for p in m.pools if p.kind == PoolKind.STATE_SLOTS]
    want_in = [TensorSig(Role.COPY_SRC, "int32", (e.batch,)), TensorSig(Role.COPY_DST, "int32", (e.batch,))]
    want_in += [TensorSig(Role.POOL_IN, p.dtype, p.shape, p.name, p.partition) for p in state]
    want_out = [TensorSig(Role.POOL_OUT, p.dtype, p.shape, p.name, p.partition) for p in state]
    donations = tuple((i, i + 2) for i in range(len(state)))
    if not state:
        raise ManifestError(f"{what} copies state slots, but the manifest has no state pool")
    if (list(e.inputs), list(e.outputs), tuple(e.donations)) != (want_in, want_out, donations):
        raise ManifestError(f"{what} is not a copy_slots entry of batch {e.batch}: it takes "
                            f"{[s.label for s in e.inputs]} and returns {[s.label for s in e.outputs]} (donations "
                            f"{list(e.donations)}); one takes COPY_SRC, COPY_DST and the state pools {[p.name for p in state]}, "
                            "donated to its outputs")
    if tuple(e.kept_inputs) != tuple(range(len(e.inputs))):
        raise ManifestError(f"{what}: its body dropped inputs (kept {list(e.kept_inputs)})")


def _positive(value: int, what: str) -> None:
    if value <= 0:
        raise ManifestError(f"{what} must be positive, got {value}")


def _check_consistency(m: Manifest) -> None:
    """Checks that need no files: ladders, pools, weight sizes, roles, donations, hashes a v4 must carry."""
    v4 = m.schema == SCHEMA_V4
    _positive(m.block_size, "block_size")
    _positive(m.model.vocab, "model.vocab")
    for name, ladder in (("batch_ladder", m.buckets.batch_ladder), ("context_ladder", m.buckets.context_ladder)):
        if not ladder:
            raise ManifestError(f"buckets.{name} is empty")
        for v in ladder:
            _positive(v, f"buckets.{name} value")
    if not m.entries:
        raise ManifestError("the manifest has no entries")
    if m.versions.platform not in ("cpu", "cuda"):
        raise ManifestError(f"versions.platform {m.versions.platform!r} is not served (cpu, cuda)")

    pools = {}
    for p in m.pools:
        what = f"pool {p.name!r}"
        if p.name in pools:
            raise ManifestError(f"{what} is declared twice")
        dtype_info(p.dtype, what)
        for d in p.shape:
            _positive(d, f"{what} dimension")
        _positive(p.capacity, f"{what} capacity")
        if not 0 <= p.slot_axis < len(p.shape) or p.shape[p.slot_axis] != p.capacity:
            raise ManifestError(f"{what} shape {list(p.shape)} has no axis {p.slot_axis} of its capacity {p.capacity}")
        if p.kind in (PoolKind.PAGED_KV, PoolKind.RING_KV) and (len(p.shape) != 6 or p.shape[3] != m.block_size):
            raise ManifestError(f"{what} shape {list(p.shape)} is not [L, 2, pages, {m.block_size}, K, D]")
        if p.kind == PoolKind.RING_KV:
            _positive(p.window, f"{what} window")
            if not 0 < p.ring_pages <= p.capacity:
                raise ManifestError(f"{what} ring of {p.ring_pages} pages does not fit its {p.capacity} pages")
        pools[p.name] = p
    for kind in m.pool_kinds:
        same = m.pools_of(kind)
        if len({p.capacity for p in same}) > 1 or (kind == PoolKind.RING_KV and
                                                  len({(p.window, p.ring_pages) for p in same}) > 1):
            raise ManifestError(f"pools {[p.name for p in same]} of kind {kind} share an index space but differ "
                                "in capacity or ring")

    slots = {}
    for w in m.weights:
        if w.nbytes != nbytes(w.dtype, w.shape, f"weight {w.slot!r}"):
            raise ManifestError(f"weight {w.slot!r}: nbytes {w.nbytes} does not match dtype {w.dtype} "
                                f"and shape {list(w.shape)}")
        if v4 and not w.sha256 and not w.shards:
            raise ManifestError(f"weight {w.slot!r} has no sha256 ({SCHEMA_V4} hashes every file)")
        slots[w.slot] = w
    _validate_quant(m.weights)
    if v4:
        for t in m.tokenizer_files:
            if not t.sha256:
                raise ManifestError(f"tokenizer file {t.file!r} has no sha256 ({SCHEMA_V4} hashes every file)")
    if m.model.embedding_slot:
        w = slots.get(m.model.embedding_slot)
        if w is None or not w.shape or w.shape[0] != m.model.vocab:
            raise ManifestError(f"model.vocab is {m.model.vocab}, but the embedding "
                                f"{m.model.embedding_slot!r} has {list(w.shape) if w else 'no weight'} rows")

    step_roles = set(BASE_STEP_INPUTS)
    for kind in m.pool_kinds:
        step_roles.update(POOL_KIND_INPUTS[kind])
    if m.sampler is not None:
        unknown = [c for c in m.sampler.columns if c not in SAMPLING_COLUMNS]
        if unknown:
            raise ManifestError(f"sampler.columns {unknown} are not columns this runtime fills "
                                f"({', '.join(SAMPLING_COLUMNS)})")
        if m.sampler.top_logprobs < 0 or m.sampler.logit_bias < 0:
            raise ManifestError("sampler.top_logprobs and sampler.logit_bias must be >= 0")
        if m.sampler.mask_words != (m.model.vocab + 31) // 32:
            raise ManifestError(f"sampler.mask_words is {m.sampler.mask_words}; a mask over {m.model.vocab} tokens "
                                f"has {(m.model.vocab + 31) // 32}")
    if m.scorer is not None and not 0 <= m.scorer.top_logprobs <= m.model.vocab:
        raise ManifestError(f"scorer.top_logprobs {m.scorer.top_logprobs} must be in [0, {m.model.vocab}]")
    if m.scorer is not None and not any(e.kind == EntryKind.PREFILL_SCORED for e in m.entries):
        raise ManifestError(f"the manifest has a scorer but no {EntryKind.PREFILL_SCORED} entry")
    for e in m.entries:
        what = f"entry {e.name!r}"
        if v4 and not e.exported:
            raise ManifestError(f"{what} records no exported body ({SCHEMA_V4})")
        if e.kind == EntryKind.COPY_SLOTS:
            _check_copy_entry(m, e, what)
            continue
        _positive(e.batch, f"{what} batch")
        _positive(e.tokens_per_seq, f"{what} tokens_per_seq")
        if e.context not in m.buckets.context_ladder or e.batch not in m.buckets.batch_ladder:
            raise ManifestError(f"{what} (batch {e.batch}, context {e.context}) is not on the ladders")
        if e.context % m.block_size:
            raise ManifestError(f"{what} context {e.context} is not a multiple of the block size {m.block_size}")
        seen_pools_in, seen_pools_out, seen_roles = set(), set(), set()
        for sig in e.inputs:
            if sig.role not in INPUT_ROLES:
                raise ManifestError(f"{what} input has role {sig.role}, which is not an input role")
            dtype_info(sig.dtype, f"{what} input {sig.label}")
            if sig.role in STEP_FIELDS:
                if sig.role not in step_roles:
                    raise ManifestError(f"{what} takes {sig.role}, which none of the artifact's pools needs")
                seen_roles.add(sig.role)
            elif sig.role in SAMPLER_INPUTS:
                _check_sampler_sig(m, e, sig, what)
                seen_roles.add(sig.role)
            elif sig.role in SCORER_INPUTS:
                _check_scorer_sig(m, e, sig, what)
                seen_roles.add(sig.role)
            elif sig.role in DECODE_STEPS_INPUTS:
                _check_steps_sig(e, sig, what)
                seen_roles.add(sig.role)
            elif sig.role == Role.WEIGHT:
                w = slots.get(sig.slot)
                if w is None:
                    raise ManifestError(f"{what} takes weight {sig.slot!r}, which the weight table lacks")
                if (w.dtype, tuple(w.shape)) != (sig.dtype, tuple(sig.shape)):
                    raise ManifestError(f"{what} takes weight {sig.slot!r} as {sig.dtype}{list(sig.shape)}, "
                                        f"the weight table has {w.dtype}{list(w.shape)}")
            else:
                p = pools.get(sig.slot)
                if p is None or (sig.dtype, tuple(sig.shape)) != (p.dtype, tuple(p.shape)):
                    raise ManifestError(f"{what} input {sig.label} {sig.dtype}{list(sig.shape)} differs from the "
                                        f"manifest's pool {p.name if p else None!r}")
                seen_pools_in.add(sig.slot)
        missing = step_roles - seen_roles
        if missing:
            raise ManifestError(f"{what} lacks the step inputs {sorted(missing)} its pools need")
        for sig in e.outputs:
            if sig.role not in OUTPUT_ROLES:
                raise ManifestError(f"{what} output has role {sig.role}, which is not an output role")
            if sig.role == Role.POOL_OUT:
                seen_pools_out.add(sig.slot)
            elif sig.role in SAMPLER_OUTPUTS:
                _check_sampler_sig(m, e, sig, what)
                seen_roles.add(sig.role)
            elif sig.role in SCORER_OUTPUTS:
                _check_scorer_sig(m, e, sig, what)
                seen_roles.add(sig.role)
            elif sig.role in DECODE_STEPS_OUTPUTS:
                _check_steps_sig(e, sig, what)
                seen_roles.add(sig.role)
        multi = e.kind == EntryKind.DECODE_STEPS
        steps_roles = set(DECODE_STEPS_INPUTS) | set(DECODE_STEPS_OUTPUTS)
        if multi and not steps_roles <= seen_roles:
            raise ManifestError(f"{what} lacks the decode_steps roles {sorted(steps_roles - seen_roles)}")
        if (e.steps > 1) != multi or (multi and e.tokens_per_seq != 1):
            raise ManifestError(f"{what} is a {e.kind} entry of {e.steps} steps and {e.tokens_per_seq} tokens per "
                                "sequence (a decode_steps entry runs K > 1 steps of one token; the others one step)")
        # A decode_steps entry samples in its body but returns only the tokens: it takes the sampler's inputs.
        sampler_roles = set(SAMPLER_INPUTS) | (set() if multi else set(SAMPLER_OUTPUTS))
        if m.sampler is not None and not sampler_roles <= seen_roles:
            raise ManifestError(f"{what} lacks the sampler's roles {sorted(sampler_roles - seen_roles)} (the manifest "
                                "has a sampler)")
        scorer_roles = set(SCORER_INPUTS) | set(SCORER_OUTPUTS)
        if e.kind == EntryKind.PREFILL_SCORED and not scorer_roles <= seen_roles:
            raise ManifestError(f"{what} lacks the scorer's roles {sorted(scorer_roles - seen_roles)} (a "
                                f"{EntryKind.PREFILL_SCORED} entry scores every position)")
        if seen_pools_in != set(pools) or seen_pools_out != set(pools):
            raise ManifestError(f"{what} takes pools {sorted(seen_pools_in)} and returns {sorted(seen_pools_out)}; "
                                f"the manifest has {sorted(pools)}")
        logits = e.outputs[e.output_index(Role.STEP_TOKENS if multi else Role.LOGITS)]
        if not multi and tuple(logits.shape) != (e.batch, m.model.vocab):
            raise ManifestError(f"{what} returns logits of shape {list(logits.shape)}, the model's vocabulary is "
                                f"{m.model.vocab} (batch {e.batch})")
        donated = set()
        for out_i, in_i in e.donations:
            if not (0 <= out_i < len(e.outputs) and 0 <= in_i < len(e.inputs)):
                raise ManifestError(f"{what} donation ({out_i}, {in_i}) is out of range")
            o, i = e.outputs[out_i], e.inputs[in_i]
            if (o.role, i.role) != (Role.POOL_OUT, Role.POOL_IN) or o.slot != i.slot or \
                    (o.dtype, tuple(o.shape)) != (i.dtype, tuple(i.shape)):
                raise ManifestError(f"{what} donates input {in_i} ({i.label}) to output {out_i} ({o.label}): "
                                    "only a pool to itself")
            donated.add(i.slot)
        if donated != set(pools):
            raise ManifestError(f"{what} donates pools {sorted(donated)}, not all of {sorted(pools)}")
        if tuple(e.kept_inputs) != tuple(range(len(e.inputs))):
            raise ManifestError(f"{what}: its body dropped inputs (kept {list(e.kept_inputs)})")
    _check_mesh(m, slots, pools)
