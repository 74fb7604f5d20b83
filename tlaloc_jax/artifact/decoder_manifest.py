"""The decoder's artifact schema (tlaloc-serving): written by tlaloc_jax.stage, read by the JAX-free runtime.

A manifest is a tree of frozen dataclasses; `Manifest.to_json()` writes it deterministically, `Manifest.from_json`
reads it (upgrading v2 and v3 in memory: upgrade.py), and serving_load.load_manifest checks it and the files it
lists.

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
    TOP_LOGPROBS, TOP_IDS (tlaloc_jax/kernels/in_body_sampler.py). A manifest without them is served as before
    (the host samples from pulled logits); a runtime that predates them refuses the new roles by name.
    v4 + scorer (optional, still tlaloc-serving-v4): top-level `scorer` (N top logprobs per prompt position)
    and entries of kind prefill_scored: a prefill that also scores every position of the call against the
    token that follows it (input SCORE_TARGETS; outputs PROMPT_LOGPROB, PROMPT_RANK, PROMPT_TOP_LOGPROBS,
    PROMPT_TOP_IDS; tlaloc_jax/kernels/scoring.py), for echo and prompt_logprobs. A manifest without them is served as
    before (such a prompt is read a token a call and scored on the host); a runtime that predates them refuses
    the new kind by name.
    v4 + quantized weights (optional, still tlaloc-serving-v4): a weight file may carry `quant` (WeightQuant:
    its QuantScheme, whether it holds the codes or the scales, the quantized weight's name, int4's group, and
    `out_major` when the codes are stored [..., O, I] as the per-layer layout's are; absent: false);
    checked at load (codes in the scheme's dtype, f32 scales of the matching shape, both halves present).
    A manifest without it has none; a runtime feeds the files by slot as before.
    v4 + decode steps (optional, still tlaloc-serving-v4): entries of kind `decode_steps` with `steps` K (every
    entry now records `steps`, 1 when absent): K decode steps in one call, inputs STEP_LIMIT and STOP_IDS beside
    a decode entry's (the sampler's inputs included, RNG_STEP the first step's counter), output STEP_TOKENS
    [B, K] and the pools, no logits. Older manifests load unchanged; a runtime that predates the kind refuses it
    by name.
    v4 + mesh (optional, still tlaloc-serving-v4): top-level `mesh` (its axes' names and sizes) for an artifact
    whose bodies run on several devices (one SPMD body per entry, `mhlo.num_partitions` = the mesh's devices);
    each entry input and output, pool and weight may carry a `partition` (per dimension, the mesh axis it is
    split along, or null; absent or all null: whole on every device). A split weight is written as `shards`
    (one file per device, its block, hashed) instead of `file`. A manifest without a mesh has none of these
    fields (its JSON is as before); a runtime that predates them refuses a split weight (it has no `file`).
    v5 + lora (optional, still tlaloc-serving-v5): top-level `lora` (max_loras, max_rank, dtype, targets) and, in
    every entry, LORA_SLOTS (each row's adapter slot) and per target LORA_A and LORA_B, then one LORA_SCALE,
    after the weights: buffers the runtime allocates zeroed and writes adapters into. A manifest without it has
    no such field (its JSON is as before); a runtime that predates it refuses the roles by name.
    v4 + native kernels (optional, still tlaloc-serving-v4): `versions.custom_calls` names the C kernels
    (kernels/) the bodies call as typed FFI custom calls; a runtime builds and registers each before it
    compiles, and refuses the artifact by the kernel's name when it cannot. A manifest without them has no such
    field; a runtime that predates it fails the first body's compile at load, naming the custom call.
  tlaloc-serving-v5: an entry needs only its portable bytecode (`serialized`, `.mlirbc`: what the runtime
    compiles and reads @main's signature from) beside its record in the manifest; `programs/*.json` (a copy of
    each entry's signature) is gone. The textual StableHLO (`body`, `.mlir`) and jax's serialization
    (`exported`, `.exported`) are written only when the export asks for them (for debugging and re-tracing), and
    then listed with their sha256; the runtime opens neither.
    v5 + verify (optional, still tlaloc-serving-v5): entries of kind `verify` (speculative decoding, export
    --speculative-tokens K): a prefill's step inputs for rows of K + 1 tokens (the last token and K drafts), the
    sampler's inputs when the manifest has a sampler (verify entries without them accept greedily only), outputs
    VERIFY_TOKENS, VERIFY_ACCEPTED, VERIFY_LOGPROB, VERIFY_TOP_LOGPROBS, VERIFY_TOP_IDS and the pools, no logits.
    A manifest without them is as before; a runtime that predates the kind refuses it by name.
    v5 + verify masks per position (optional, still tlaloc-serving-v5): a verify entry's TOKEN_MASK may be
    [B, T, W], position t's mask (a grammar's after the row's drafts through t), so rows under a grammar draft. A
    verify entry with TOKEN_MASK [B, W] (one mask a row) still serves: its grammar rows do not draft. A runtime
    that predates it refuses the shape, naming TOKEN_MASK and the sampler's [B, W].
    v5 + decode at the top context (no field, still tlaloc-serving-v5): decode, decode_steps and verify entries
    may sit at the context ladder's largest point alone (export --decode-contexts top, the default with the native
    decode attention); a runtime picks the smallest entry that holds a call, as it always has, so any runtime
    serves it.
v2, v3 and v4 manifests still load: `Manifest.from_json` upgrades v2 and v3 to the model in memory (their
weights and tokenizer files carry no hashes; the loader says so). Their `.mlir`, `.exported` and `programs/`
files are not opened either: every body is checked from its `.mlirbc`.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from .codec import build, parse, to_json
from .errors import ManifestError
from .mesh import Mesh
from .records import Partition, TensorSig, TokenizerFile, Versions, WeightFile
from .upgrade import SCHEMA_V2, SCHEMA_V3, upgrade_v2_v3
from .vocabulary import EntryKind, PoolKind, Role, nbytes

MANIFEST_NAME = "tlaloc-serving.json"
SCHEMA_V4 = "tlaloc-serving-v4"
SCHEMA_V5 = "tlaloc-serving-v5"
SUPPORTED_SCHEMAS = (SCHEMA_V2, SCHEMA_V3, SCHEMA_V4, SCHEMA_V5)
MAX_MANIFEST_BYTES = 64 << 20


@dataclass(frozen=True)
class Entry:
    """One compiled program: a decode or prefill call of `batch` sequences in a `context`-position bucket."""

    name: str
    kind: EntryKind
    batch: int
    context: int
    tokens_per_seq: int
    serialized: str                # bodies/<sha256>.mlirbc, portable StableHLO bytecode: what the runtime compiles
    serialized_sha256: str         # (and reads @main from, checked against inputs, outputs and donations at load)
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    donations: tuple[tuple[int, int], ...]   # (output index, input index it is written over)
    kept_inputs: tuple[int, ...]             # jax.export's module_kept_var_idx: all of them, checked at export
    steps: int = 1                 # decode steps per call: K for a decode_steps entry, else 1
    # Files the runtime never opens: the textual StableHLO and jax's serialization (v4 always; v5 when the export
    # asks for them: --mlir, --exported), and programs/<name>.json (v2-v4).
    body: str = ""                 # bodies/<sha256>.mlir
    body_sha256: str = ""
    exported: str = ""             # bodies/<sha256>.exported (for jax callers: tests, benches, re-tracing)
    exported_sha256: str = ""
    program: str = ""

    @property
    def rows(self) -> int:
        """The rows of its logits and sampler: a mixed entry's decode rows and its chunk's, else its batch."""
        return self.batch + 1 if self.kind == EntryKind.MIXED else self.batch

    @functools.cached_property
    def packed_tokens(self) -> int:
        """A packed prefill's N, the most tokens of its rows one call computes (its flat inputs [1, N]); else 0."""
        if not any(sig.role == Role.PACK_INDEX for sig in self.inputs):
            return 0
        return self.inputs[self.input_index(Role.TOKEN_IDS)].shape[1]

    def holds(self, batch: int, context: int, tokens: int, total: int = 0) -> bool:
        """Whether one call holds `batch` rows of up to `tokens` tokens reaching `context` positions (a packed
        prefill: `total` tokens in all)."""
        return (self.batch >= batch and self.context >= context and self.tokens_per_seq >= tokens
                and (not self.packed_tokens or self.packed_tokens >= total))

    @property
    def positions(self) -> int:
        """The positions one call computes: batch x tokens (a mixed entry: its decode rows and its chunk; a packed
        prefill: N)."""
        if self.kind == EntryKind.MIXED:
            return self.batch + self.tokens_per_seq
        return self.packed_tokens or self.batch * self.tokens_per_seq

    @property
    def size_key(self) -> tuple[int, int, int]:
        """Smallest first: by context, then the positions a call computes, then batch; a runtime picks the first
        entry of a kind that holds its rows."""
        return self.context, self.positions, self.batch

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
class SamplerShape:
    """The sampler every entry runs after the step (tlaloc_jax/kernels/in_body_sampler.py): the SAMPLING columns in
    order, the N top logprobs it returns, the NB logit-bias slots it takes, the W words of its token mask."""

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


@dataclass(frozen=True)
class ScorerShape:
    """What the scoring prefill entries (kind prefill_scored) return per position: the N top logprobs."""

    top_logprobs: int

    def shapes(self, batch: int, tokens: int) -> dict[Role, tuple[int, ...]]:
        """Each scorer role's shape in an entry of `batch` rows of `tokens` tokens."""
        return {Role.SCORE_TARGETS: (batch, tokens), Role.PROMPT_LOGPROB: (batch, tokens),
                Role.PROMPT_RANK: (batch, tokens), Role.PROMPT_TOP_LOGPROBS: (batch, tokens, self.top_logprobs),
                Role.PROMPT_TOP_IDS: (batch, tokens, self.top_logprobs)}


@dataclass(frozen=True)
class LoraTarget:
    """One projection that takes adapters: its name (q_proj, ...), how many layers' buffers it has, its input and
    output widths, and the model layers those buffers hold in order (empty: layers 0..layers-1; a hybrid's
    attention or linear-attention projections are in some layers only)."""

    name: str
    layers: int
    inputs: int
    outputs: int
    model_layers: tuple[int, ...] = ()

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The model layer each of its buffers holds."""
        return self.model_layers or tuple(range(self.layers))


@dataclass(frozen=True)
class LoraShape:
    """The adapter slots every entry takes (tlaloc_jax/lora.py): max_loras slots (slot 0, all zeros, is "no
    adapter"), adapters of rank at most max_rank, in `dtype`, on `targets`."""

    max_loras: int
    max_rank: int
    dtype: str
    targets: tuple[LoraTarget, ...]

    def shapes(self, target: LoraTarget) -> dict[Role, tuple[int, ...]]:
        """LORA_A and LORA_B's shapes for one layer of `target` (out-major, as the per-layer projections), and
        LORA_SCALE's."""
        n = self.max_loras + 1
        return {Role.LORA_A: (n, self.max_rank, target.inputs), Role.LORA_B: (target.outputs, n, self.max_rank),
                Role.LORA_SCALE: (n,)}

    def buffers(self) -> list[tuple[Role, str, tuple[int, ...]]]:
        """(role, slot, shape) of every adapter buffer an entry takes: LORA_A and LORA_B of each target's each layer
        (slot "<target>.<layer>"), then LORA_SCALE."""
        out = [(role, f"{t.name}.{layer}", self.shapes(t)[role]) for t in self.targets for layer in range(t.layers)
               for role in (Role.LORA_A, Role.LORA_B)]
        return out + [(Role.LORA_SCALE, "", (self.max_loras + 1,))]

    def target(self, name: str) -> LoraTarget | None:
        return next((t for t in self.targets if t.name == name), None)


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
    sampler: SamplerShape | None = None     # v4 + sampler: every entry samples in its body
    scorer: ScorerShape | None = None       # v4 + scorer: prefill_scored entries score each prompt position
    mesh: Mesh | None = None                # v4 + mesh: the entries run on mesh.devices devices
    lora: LoraShape | None = None           # v5 + lora: every entry takes adapter slots

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

    @property
    def flat(self) -> bool:
        """Whether every call is a packed prefill (no decode entries: `--entries flat`)."""
        return not any(e.kind == EntryKind.DECODE for e in self.entries)

    @property
    def max_batch(self) -> int:
        """The most sequences one call decodes: the largest decode entry's batch (flat: the largest packed call's)."""
        return max(e.batch for e in self.entries if e.kind == (EntryKind.PREFILL if self.flat else EntryKind.DECODE))

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise ManifestError(f"no entry named {name!r}")

    def to_json(self) -> str:
        return to_json(self)

    @property
    def identity(self) -> str:
        """The sha256 of the manifest text this was read from (of `to_json()` when built in memory): what names
        the artifact's programs and weights, as the root of the prefix cache's hash chains."""
        digest = self.__dict__.get("_identity")
        if digest is None:
            digest = hashlib.sha256(self.to_json().encode()).hexdigest()
            object.__setattr__(self, "_identity", digest)
        return digest

    @staticmethod
    def from_json(text: str | bytes) -> "Manifest":
        raw = parse(text, MANIFEST_NAME)
        schema = raw.get("schema")
        if schema not in SUPPORTED_SCHEMAS:
            raise ManifestError(f"unknown manifest schema version {schema!r} (this runtime reads "
                                f"{', '.join(SUPPORTED_SCHEMAS)})")
        if schema in (SCHEMA_V2, SCHEMA_V3):
            raw = upgrade_v2_v3(raw)
        m = build(Manifest, raw, "manifest")
        object.__setattr__(m, "_identity", hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest())
        return m
