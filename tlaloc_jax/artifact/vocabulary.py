"""Everything an artifact may say, each written once: the roles of a body's arguments and results, the kinds of
pools, entries and bounds, the dtypes, the weight quantization schemes, the sampler's columns with their neutral
values, and the width of a packed token mask. Str enums, so the JSON stays readable.

Standard library only (numpy and ml_dtypes are imported by `numpy_dtype` when it is called).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from .errors import ManifestError


# The platforms bodies are lowered for and served on.
PLATFORMS = ("cpu", "cuda")
# What a weight slot, pool, bound, input or output name may hold (some name the artifact's files).
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class Role(enum.StrEnum):
    """What an argument or result of a body holds (docs/glossary.md). A decoder entry's signature uses the roles
    up to STEP_TOKENS; a bounded program's uses WEIGHT and the roles after STEP_TOKENS."""

    # The integer step inputs.
    TOKEN_IDS = "TOKEN_IDS"
    POSITIONS = "POSITIONS"
    SEQ_LENS = "SEQ_LENS"
    BLOCK_TABLES = "BLOCK_TABLES"
    SLOT_MAPPING = "SLOT_MAPPING"
    WINDOW_BLOCK_TABLES = "WINDOW_BLOCK_TABLES"
    WINDOW_SLOT_MAPPING = "WINDOW_SLOT_MAPPING"
    STATE_SLOTS = "STATE_SLOTS"
    # A packed prefill's rows (docs/glossary.md): PACK_INDEX [B, T] i32, the index of each row position's token
    # (rows right-aligned, as an unpacked entry's TOKEN_IDS [B, T]) in the call's flat per-token inputs
    # (TOKEN_IDS, POSITIONS, SLOT_MAPPING, WINDOW_SLOT_MAPPING, all [1, N]); N where the row has no token.
    PACK_INDEX = "PACK_INDEX"
    # A pool (slot: the pool's name), donated: POOL_OUT is written over the POOL_IN of the same name.
    POOL_IN = "POOL_IN"
    POOL_OUT = "POOL_OUT"
    # A weight (slot: its name in the weight table).
    WEIGHT = "WEIGHT"
    # The sampler's per-row inputs (manifest `sampler`; tlaloc_jax/kernels/in_body_sampler.py): SAMPLING [B, P] f32 (the
    # SAMPLING_COLUMNS the manifest lists), RNG_SEED [B, 2] i32 (a 64-bit seed's low and high words), RNG_STEP [B]
    # i32 (tokens generated before the call: the random stream's counter), TOKEN_MASK [B, W] i32 (allowed
    # tokens, bit t % 32 of word t // 32; a verify entry's may be [B, T, W], one per position), LOGIT_BIAS_IDS
    # [B, NB] i32 (-1: empty) and LOGIT_BIAS [B, NB] f32,
    # TOKEN_HISTORY [B, C] i32 (the sequence's tokens by position, -1 past its end; C the entry's context).
    SAMPLING = "SAMPLING"
    RNG_SEED = "RNG_SEED"
    RNG_STEP = "RNG_STEP"
    TOKEN_MASK = "TOKEN_MASK"
    LOGIT_BIAS_IDS = "LOGIT_BIAS_IDS"
    LOGIT_BIAS = "LOGIT_BIAS"
    TOKEN_HISTORY = "TOKEN_HISTORY"
    # A scoring prefill's input (manifest `scorer`; tlaloc_jax/kernels/scoring.py): SCORE_TARGETS [B, T] i32, the token each
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
    # LoRA adapters (manifest `lora`; tlaloc_jax/lora.py): LORA_SLOTS [rows] i32, each row's adapter slot (0: none;
    # a mixed entry's decode rows, then its chunk's); per target projection and layer (slot "<target>.<layer>")
    # LORA_A [N + 1, R, I] and LORA_B [O, N + 1, R] (out-major, as projections), and LORA_SCALE [N + 1] f32: device buffers the runtime writes adapters into.
    LORA_SLOTS = "LORA_SLOTS"
    LORA_A = "LORA_A"
    LORA_B = "LORA_B"
    LORA_SCALE = "LORA_SCALE"
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
    # A verify entry's outputs, per position t of each row [B, T] (rows right-aligned, as a prefill's): the token
    # the row emits after position t when it accepts no draft past t (greedy: the argmax; sampled: a rejection
    # sampler's draw, kernels/rejection_sampler.py), the logprob [B, T] f32 of the token it emits at t, the N
    # largest logprobs [B, T, N] f32 and their ids [B, T, N] i32; and VERIFY_ACCEPTED [B] i32, how many of the
    # row's drafted tokens (TOKEN_IDS after its first) it accepts, a prefix.
    VERIFY_TOKENS = "VERIFY_TOKENS"
    VERIFY_ACCEPTED = "VERIFY_ACCEPTED"
    VERIFY_LOGPROB = "VERIFY_LOGPROB"
    VERIFY_TOP_LOGPROBS = "VERIFY_TOP_LOGPROBS"
    VERIFY_TOP_IDS = "VERIFY_TOP_IDS"
    # An MTP head's (tlaloc_jax/mtp_head.py), only in an artifact that has one: HIDDEN_STATES f32, a decoder entry's
    # output [B, T, E], each position's hidden state after the final norm, and an mtp entry's input [B, T, E] (the
    # decoder's, or its own to chain) and output [B, 1, E] (the head's at each row's last position).
    HIDDEN_STATES = "HIDDEN_STATES"
    # A bounded program's (slot: the author's input or output name, or the bound's name): an input of the
    # author's function, a bound's valid size (int32 [], or [B] per row beside a batch bound) and valid
    # positions (bool [N], or [B, N]), an output of the author's function.
    INPUT = "INPUT"
    VALID_LENGTH = "VALID_LENGTH"
    VALID_MASK = "VALID_MASK"
    OUTPUT = "OUTPUT"


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
    # Up to tokens_per_seq tokens per sequence, rows right-aligned. A packed prefill (one that takes PACK_INDEX)
    # computes only the rows' tokens, at most N of them side by side ([1, N]), and attends row by row.
    PREFILL = "prefill"
    PREFILL_SCORED = "prefill_scored"  # a prefill that also scores each position (manifest `scorer`)
    # Up to `steps` decode steps in one call: each step's token (argmax, or the in-body sampler's) is fed to the
    # next; a row stops on one of its STOP_IDS or after STEP_LIMIT tokens; returns STEP_TOKENS, not the logits.
    DECODE_STEPS = "decode_steps"
    # Copies state slots within every state pool (export/_copy_slots.py): the runtime's state snapshots for prefix
    # caching. Its batch is the copies one call makes; it takes no step inputs and no weights.
    COPY_SLOTS = "copy_slots"
    # One call of `batch` decode rows (one token each) and one prompt chunk of `tokens_per_seq` tokens: the token-wise
    # work of both on their rows together, so the running sequences' tokens ride along a prompt's chunk. The decode
    # rows' step inputs have the usual roles; the chunk's the same roles with slot CHUNK_GROUP; the sampler's and
    # the outputs' rows are the decode rows, then the chunk's.
    MIXED = "mixed"
    # Speculative decoding's check: each row's last token and up to tokens_per_seq - 1 drafted tokens after it, scored
    # in one call (export/_verify.py); takes the sampler's inputs (a manifest with a sampler) and returns the
    # VERIFY_* outputs and the pools, no logits and no sampler outputs.
    VERIFY = "verify"
    # An MTP head's step (tlaloc_jax/mtp_head.py): up to tokens_per_seq positions a row, right-aligned, token x_{t+1}
    # at position t with HIDDEN_STATES at t; writes its layer's pool and returns LOGITS and NEXT_TOKEN (the draft two
    # after each row's last position) and the head's HIDDEN_STATES there; the decoder's pools pass through.
    MTP = "mtp"


class BoundKind(enum.StrEnum):
    """A bounded program's bound. batch: rows; calls batched into one body each take some rows, so every input
    and output has this axis. length: a size per call (per row when the program also has a batch bound)."""

    BATCH = "batch"
    LENGTH = "length"


# The integer inputs of a call, by role, and the field of tlaloc_jax.serve.core.paging.build_step_inputs (and of the
# decoder's StepInputs) each one is.
STEP_FIELDS: dict[Role, str] = {
    Role.TOKEN_IDS: "token_ids", Role.POSITIONS: "positions", Role.SEQ_LENS: "seq_lens",
    Role.BLOCK_TABLES: "block_tables", Role.SLOT_MAPPING: "slot_mapping",
    Role.WINDOW_BLOCK_TABLES: "window_block_tables", Role.WINDOW_SLOT_MAPPING: "window_slot_mapping",
    Role.STATE_SLOTS: "state_slots", Role.PACK_INDEX: "pack_index",
}
# A packed prefill's flat per-token inputs ([1, N]); its other step inputs are per row.
PACKED_TOKEN_INPUTS = (Role.TOKEN_IDS, Role.POSITIONS, Role.SLOT_MAPPING, Role.WINDOW_SLOT_MAPPING)
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
SAMPLER_DTYPES = {Role.SAMPLING: "float32", Role.LOGIT_BIAS: "float32", Role.TOKEN_LOGPROB: "float32",
                  Role.TOP_LOGPROBS: "float32"}      # the others are int32
# A scoring prefill's input and outputs, in signature order (after the sampler's).
SCORER_INPUTS = (Role.SCORE_TARGETS,)
SCORER_OUTPUTS = (Role.PROMPT_LOGPROB, Role.PROMPT_RANK, Role.PROMPT_TOP_LOGPROBS, Role.PROMPT_TOP_IDS)
SCORER_DTYPES = {Role.PROMPT_LOGPROB: "float32", Role.PROMPT_TOP_LOGPROBS: "float32"}     # the others are int32
# A decode_steps entry's inputs beyond a decode entry's (after the sampler's, before the pools), and its outputs.
DECODE_STEPS_INPUTS = (Role.STEP_LIMIT, Role.STOP_IDS)
DECODE_STEPS_OUTPUTS = (Role.STEP_TOKENS,)
# A verify entry's outputs, in signature order (before the pools).
VERIFY_OUTPUTS = (Role.VERIFY_TOKENS, Role.VERIFY_ACCEPTED, Role.VERIFY_LOGPROB, Role.VERIFY_TOP_LOGPROBS,
                  Role.VERIFY_TOP_IDS)
VERIFY_DTYPES = {Role.VERIFY_LOGPROB: "float32", Role.VERIFY_TOP_LOGPROBS: "float32"}     # the others are int32
# The slot naming the prompt chunk's step inputs in a mixed entry.
CHUNK_GROUP = "chunk"
# A copy_slots entry's inputs, before its state pools.
COPY_INPUTS = (Role.COPY_SRC, Role.COPY_DST)
# A LoRA artifact's per-row input (after the decode_steps inputs) and the adapter buffers (after the weights).
LORA_INPUTS = (Role.LORA_SLOTS,)
LORA_ADAPTERS = (Role.LORA_A, Role.LORA_B, Role.LORA_SCALE)
# What a decoder entry may take and return.
INPUT_ROLES = (frozenset(STEP_FIELDS) | {Role.POOL_IN, Role.WEIGHT} | frozenset(SAMPLER_INPUTS)
               | frozenset(SCORER_INPUTS) | frozenset(DECODE_STEPS_INPUTS) | frozenset(COPY_INPUTS)
               | frozenset(LORA_INPUTS) | frozenset(LORA_ADAPTERS) | {Role.HIDDEN_STATES})
OUTPUT_ROLES = (frozenset({Role.LOGITS, Role.NEXT_TOKEN, Role.POOL_OUT, Role.HIDDEN_STATES})
                | frozenset(SAMPLER_OUTPUTS) | frozenset(SCORER_OUTPUTS) | frozenset(DECODE_STEPS_OUTPUTS) | frozenset(VERIFY_OUTPUTS))

# The columns of SAMPLING a runtime knows how to fill, in order, each with its neutral value: the value at which
# the sampler's step is the identity (temperature 0: greedy; top_p 1, top_k 0, min_p 0: keep every token; the
# penalties 0, 0, 1: off; top_logprobs 0: none wanted, any positive value computes all N of TOP_LOGPROBS).
SAMPLING_NEUTRAL: dict[str, float] = {
    "temperature": 0.0, "top_p": 1.0, "top_k": 0.0, "min_p": 0.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "repetition_penalty": 1.0, "top_logprobs": 0.0}
SAMPLING_COLUMNS = tuple(SAMPLING_NEUTRAL)


def mask_words(vocab: int) -> int:
    """W: the int32 words of a packed TOKEN_MASK row over `vocab` tokens (token t is bit t % 32 of word t // 32)."""
    return -(-vocab // 32)


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


class QuantScheme(enum.StrEnum):
    """How a quantized weight's codes stand for its values (tlaloc_jax/kernels/quantized_matmul.py): int8 and fp8 (e4m3fn)
    codes [..., I, O] with f32 scales per output channel [..., O]; int4 codes two a byte (int8 [..., I / 2, O])
    with f32 scales per group of `group` input channels [..., I / group, O]; uint4 the same with unsigned codes
    0..15 and a zero point per scale (int8 [..., I / group, O], 0..15): value = (code - zero) * scale."""

    INT8 = "int8"
    FP8 = "fp8"
    INT4 = "int4"
    UINT4 = "uint4"


class QuantPart(enum.StrEnum):
    CODES = "codes"
    SCALES = "scales"
    ZEROS = "zeros"


# The dtype of each scheme's codes (scales are float32, zero points int8), the parts each scheme has, the schemes
# packed two codes a byte with a scale per group of input channels, and their group sizes.
QUANT_CODE_DTYPES = {QuantScheme.INT8: "int8", QuantScheme.FP8: "float8_e4m3fn", QuantScheme.INT4: "int8",
                     QuantScheme.UINT4: "int8"}
QUANT_PART_DTYPES = {QuantPart.SCALES: "float32", QuantPart.ZEROS: "int8"}
QUANT_PARTS = {scheme: (QuantPart.CODES, QuantPart.SCALES, QuantPart.ZEROS) if scheme == QuantScheme.UINT4
               else (QuantPart.CODES, QuantPart.SCALES) for scheme in QuantScheme}
GROUPED_SCHEMES = frozenset({QuantScheme.INT4, QuantScheme.UINT4})
QUANT_GROUPS = (32, 64, 128)
