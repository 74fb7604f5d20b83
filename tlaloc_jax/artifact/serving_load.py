"""Loading a decoder artifact: the manifest's cross-checks, one function a section, then the files it lists."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from .bounded_manifest import BOUNDED_NAME
from .decoder_manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, SCHEMA_V4, SCHEMA_V5, Entry, Manifest, Pool
from .errors import ManifestError
from .files import checked_file, read_manifest_file, sha256_file, verify_body, verify_listed_files
from .mesh import check_mesh
from .records import TensorSig, WeightFile, check_platform, check_tokenizer_hashes, check_weight_table
from .vocabulary import (BASE_STEP_INPUTS, CHUNK_GROUP, DECODE_STEPS_INPUTS, DECODE_STEPS_OUTPUTS, INPUT_ROLES,
                         LORA_ADAPTERS, LORA_INPUTS, NAME, OUTPUT_ROLES,
                         PACKED_TOKEN_INPUTS, POOL_KIND_INPUTS, SAMPLER_DTYPES, SAMPLER_INPUTS, SAMPLER_OUTPUTS, SAMPLING_COLUMNS,
                         SCORER_DTYPES, SCORER_INPUTS, SCORER_OUTPUTS, STEP_FIELDS, VERIFY_DTYPES, VERIFY_OUTPUTS,
                         EntryKind, PoolKind, Role,
                         dtype_info, mask_words)


def load_manifest(artifact_dir: str | os.PathLike, *, verify_files: bool = True, verify_weights: bool = True,
                  digests: Callable[[Path], str] = sha256_file) -> Manifest:
    """Read and validate an artifact directory's manifest.

    verify_files: check every file the runtime opens (each body's bytecode, the weights, the tokenizer files:
    inside the artifact, present, the right size, and its sha256 where the manifest has one) and each body's @main
    against its entry. The debugging files an export may list beside a body (.mlir, .exported) are not opened. verify_weights False skips
    hashing the weight files (their sizes are still checked): for very large artifacts whose weights are
    trusted (`--trust-weights`). digests: a file's sha256 (FileDigests.sha256 remembers those of unchanged files).
    """
    root = Path(artifact_dir)
    m = Manifest.from_json(read_manifest_file(
        root, MANIFEST_NAME, MAX_MANIFEST_BYTES, BOUNDED_NAME,
        f"a bounded program ({BOUNDED_NAME}), not a decoder; load it with tlaloc_jax.serve.BoundedProgram "
        "(python -m tlaloc_jax.serve --embedding-artifact DIR serves an embedding program)",
        f"export it first: python -m tlaloc_jax.export {root} OUT_DIR, then serve OUT_DIR"))
    check_manifest(m)
    if verify_files:
        for e in m.entries:
            verify_body(root, e, e.inputs, e.outputs, e.donations, f"entry {e.name!r}", devices=m.devices,
                        digests=digests)
        verify_listed_files(root, m.weights, m.tokenizer_files, verify_weights, digests)
    return m


def artifact_file(root: str | os.PathLike, manifest: Manifest, name: str) -> Path | None:
    """A tokenizer file the manifest lists, checked like every other file (None when it lists none by that
    name). The runtime opens no other file of an artifact directory."""
    for t in manifest.tokenizer_files:
        if t.file == name:
            return checked_file(Path(root), t.file, t.sha256 or None, "tokenizer file")
    return None


def check_manifest(m: Manifest) -> None:
    """Checks that need no files: ladders, pools, weight sizes, roles, donations, hashes a v4 must carry, the mesh
    and every partition."""
    hashed = m.schema if m.schema in (SCHEMA_V4, SCHEMA_V5) else None     # v4 on: every file carries its sha256
    _check_buckets(m)
    pools = _check_pools(m)
    slots = check_weight_table(m.weights, hashed)
    if hashed:
        check_tokenizer_hashes(m.tokenizer_files, hashed)
    if m.model.embedding_slot:
        w = slots.get(m.model.embedding_slot)
        if w is None or not w.shape or w.shape[0] != m.model.vocab:
            raise ManifestError(f"model.vocab is {m.model.vocab}, but the embedding "
                                f"{m.model.embedding_slot!r} has {list(w.shape) if w else 'no weight'} rows")
    _check_sampler_scorer(m)
    _check_lora(m)
    step_roles = set(BASE_STEP_INPUTS)
    for kind in m.pool_kinds:
        step_roles.update(POOL_KIND_INPUTS[kind])
    for e in m.entries:
        if m.schema == SCHEMA_V4 and not e.exported:
            raise ManifestError(f"entry {e.name!r} records no exported body ({SCHEMA_V4})")
        if e.kind == EntryKind.COPY_SLOTS:
            _check_copy_entry(m, e)
        else:
            _check_entry(m, e, pools, slots, step_roles)
    check_mesh(m, slots, pools)


def _check_copy_entry(m: Manifest, e: Entry) -> None:
    """A copy_slots entry: COPY_SRC and COPY_DST [batch] int32, then every state pool in and out, donated."""
    what = f"entry {e.name!r}"
    _positive(e.batch, f"{what} batch")
    state = [p for p in m.pools if p.kind == PoolKind.STATE_SLOTS]
    if not state:
        raise ManifestError(f"{what} copies state slots, but the manifest has no state pool")
    want_in = [TensorSig(Role.COPY_SRC, "int32", (e.batch,)), TensorSig(Role.COPY_DST, "int32", (e.batch,))]
    want_in += [TensorSig(Role.POOL_IN, p.dtype, p.shape, p.name, p.partition) for p in state]
    want_out = [TensorSig(Role.POOL_OUT, p.dtype, p.shape, p.name, p.partition) for p in state]
    donations = tuple((i, i + 2) for i in range(len(state)))
    if (list(e.inputs), list(e.outputs), tuple(e.donations)) != (want_in, want_out, donations):
        raise ManifestError(f"{what} is not a copy_slots entry of batch {e.batch}: it takes "
                            f"{[s.label for s in e.inputs]} and returns {[s.label for s in e.outputs]} (donations "
                            f"{list(e.donations)}); one takes COPY_SRC, COPY_DST and the state pools "
                            f"{[p.name for p in state]}, donated to its outputs")
    if tuple(e.kept_inputs) != tuple(range(len(e.inputs))):
        raise ManifestError(f"{what}: its body dropped inputs (kept {list(e.kept_inputs)})")


def _positive(value: int, what: str) -> None:
    if value <= 0:
        raise ManifestError(f"{what} must be positive, got {value}")


def _check_buckets(m: Manifest) -> None:
    _positive(m.block_size, "block_size")
    _positive(m.model.vocab, "model.vocab")
    for name, ladder in (("batch_ladder", m.buckets.batch_ladder), ("context_ladder", m.buckets.context_ladder)):
        if not ladder:
            raise ManifestError(f"buckets.{name} is empty")
        for v in ladder:
            _positive(v, f"buckets.{name} value")
    if not m.entries:
        raise ManifestError("the manifest has no entries")
    check_platform(m.versions)


def _check_pools(m: Manifest) -> dict[str, Pool]:
    """Each pool's shape holds its capacity on its slot axis (pages of block_size for the KV kinds); pools of one
    kind share their capacity and ring. -> {name: pool}."""
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
    return pools


def _check_sampler_scorer(m: Manifest) -> None:
    if m.sampler is not None:
        unknown = [c for c in m.sampler.columns if c not in SAMPLING_COLUMNS]
        if unknown:
            raise ManifestError(f"sampler.columns {unknown} are not columns this runtime fills "
                                f"({', '.join(SAMPLING_COLUMNS)})")
        if m.sampler.top_logprobs < 0 or m.sampler.logit_bias < 0:
            raise ManifestError("sampler.top_logprobs and sampler.logit_bias must be >= 0")
        if m.sampler.mask_words != mask_words(m.model.vocab):
            raise ManifestError(f"sampler.mask_words is {m.sampler.mask_words}; a mask over {m.model.vocab} tokens "
                                f"has {mask_words(m.model.vocab)}")
    if m.scorer is not None and not 0 <= m.scorer.top_logprobs <= m.model.vocab:
        raise ManifestError(f"scorer.top_logprobs {m.scorer.top_logprobs} must be in [0, {m.model.vocab}]")
    if m.scorer is not None and not any(e.kind == EntryKind.PREFILL_SCORED for e in m.entries):
        raise ManifestError(f"the manifest has a scorer but no {EntryKind.PREFILL_SCORED} entry")


def _check_sampler_sig(m: Manifest, e: Entry, sig: TensorSig, what: str) -> None:
    if m.sampler is None:
        raise ManifestError(f"{what} has {sig.role}, but the manifest has no sampler")
    want = (SAMPLER_DTYPES.get(sig.role, "int32"), m.sampler.shapes(e.rows, e.context)[sig.role])
    if e.kind == EntryKind.VERIFY and sig.role == Role.TOKEN_MASK and len(sig.shape) == 3:
        # A mask per drafted position; a verify entry staged with one mask a row takes [B, W].
        want = (want[0], (e.batch, e.tokens_per_seq, m.sampler.mask_words))
    if (sig.dtype, tuple(sig.shape)) != want:
        raise ManifestError(f"{what} {sig.role} is {sig.dtype}{list(sig.shape)}, the sampler's is "
                            f"{want[0]}{list(want[1])}")


def _check_scorer_sig(m: Manifest, e: Entry, sig: TensorSig, what: str) -> None:
    if e.kind != EntryKind.PREFILL_SCORED or m.scorer is None:
        raise ManifestError(f"{what} has {sig.role}, which only a {EntryKind.PREFILL_SCORED} entry of a manifest "
                            "with a scorer has")
    want = (SCORER_DTYPES.get(sig.role, "int32"), m.scorer.shapes(e.batch, e.tokens_per_seq)[sig.role])
    if (sig.dtype, tuple(sig.shape)) != want:
        raise ManifestError(f"{what} {sig.role} is {sig.dtype}{list(sig.shape)}, the scorer's is "
                            f"{want[0]}{list(want[1])}")


def _check_verify_sig(m: Manifest, e: Entry, sig: TensorSig, what: str) -> None:
    if e.kind != EntryKind.VERIFY:
        raise ManifestError(f"{what} has {sig.role}, which only a verify entry returns")
    B, T = e.batch, e.tokens_per_seq
    want = {Role.VERIFY_ACCEPTED: (B,), Role.VERIFY_TOKENS: (B, T), Role.VERIFY_LOGPROB: (B, T)}.get(sig.role)
    dtype = VERIFY_DTYPES.get(sig.role, "int32")
    ok = sig.dtype == dtype and (tuple(sig.shape) == want if want else
                                 len(sig.shape) == 3 and tuple(sig.shape[:2]) == (B, T))
    if not ok:
        raise ManifestError(f"{what} {sig.role} is {sig.dtype}{list(sig.shape)}; a verify entry of batch {B} and "
                            f"{T} tokens per row returns {dtype}{list(want) if want else [B, T, 'N']}")


def _check_hidden_sig(m: Manifest, e: Entry, sig: TensorSig, what: str) -> None:
    """HIDDEN_STATES (an artifact with an MTP head): a decode, prefill or verify entry returns [B, T, E]; an mtp entry
    takes [B, T, E] and returns [B, 1, E]."""
    B, T, E = e.batch, e.tokens_per_seq, m.model.hidden
    returned = any(sig is o for o in e.outputs)
    if e.kind == EntryKind.MTP:
        want = (B, 1, E) if returned else (B, T, E)
    elif returned and e.kind in (EntryKind.DECODE, EntryKind.PREFILL, EntryKind.VERIFY) and not e.packed_tokens:
        want = (B, T, E)
    else:
        raise ManifestError(f"{what} has {sig.role}, which an mtp entry takes and returns and the decode, prefill and "
                            "verify entries of an artifact with an MTP head return")
    if (sig.dtype, tuple(sig.shape)) != ("float32", want):
        raise ManifestError(f"{what} {sig.role} is {sig.dtype}{list(sig.shape)}, not float32{list(want)}")


def _check_steps_sig(m: Manifest, e: Entry, sig: TensorSig, what: str) -> None:
    if e.kind != EntryKind.DECODE_STEPS:
        raise ManifestError(f"{what} has {sig.role}, which only a decode_steps entry takes")
    want = {Role.STEP_LIMIT: (e.batch,), Role.STEP_TOKENS: (e.batch, e.steps)}.get(sig.role)
    ok = sig.dtype == "int32" and (tuple(sig.shape) == want if want else
                                   len(sig.shape) == 2 and sig.shape[0] == e.batch)
    if not ok:
        raise ManifestError(f"{what} {sig.role} is {sig.dtype}{list(sig.shape)}; a decode_steps entry of batch "
                            f"{e.batch} and {e.steps} steps takes int32{list(want) if want else [e.batch, 'NS']}")


def _check_lora(m: Manifest) -> None:
    """The adapter slots' record: at least one slot of rank >= 1, a float dtype, named targets of positive widths,
    one device."""
    if m.lora is None:
        return
    lo = m.lora
    if lo.max_loras < 1 or lo.max_rank < 1:
        raise ManifestError(f"lora.max_loras {lo.max_loras} and lora.max_rank {lo.max_rank} must be >= 1")
    if lo.dtype not in ("float32", "bfloat16", "float16"):
        raise ManifestError(f"lora.dtype {lo.dtype!r} is not a float dtype (float32, bfloat16, float16)")
    names = [t.name for t in lo.targets]
    if not names or len(set(names)) != len(names) or not all(NAME.match(n) for n in names):
        raise ManifestError(f"lora.targets {names} must be one or more distinct names")
    for t in lo.targets:
        if min(t.layers, t.inputs, t.outputs) < 1:
            raise ManifestError(f"lora target {t.name!r} has layers {t.layers}, inputs {t.inputs}, outputs "
                                f"{t.outputs}; each must be >= 1")
        ids = t.model_layers
        if ids and (len(ids) != t.layers or list(ids) != sorted(set(ids)) or ids[0] < 0):
            raise ManifestError(f"lora target {t.name!r} has model_layers {list(ids)}; it must name its {t.layers} "
                                "layers once each, ascending")
    if m.mesh is not None:
        raise ManifestError("lora adapters are served on one device; the manifest has a mesh")


def _check_lora_sig(m: Manifest, e: Entry, sig: TensorSig, what: str) -> None:
    if m.lora is None or e.kind == EntryKind.COPY_SLOTS:
        raise ManifestError(f"{what} has {sig.role}, but the manifest has no lora record")
    if sig.role == Role.LORA_SLOTS:
        want = ("int32", (e.rows,))
    else:
        shapes = {(role, slot): shape for role, slot, shape in m.lora.buffers()}
        if (sig.role, sig.slot) not in shapes:
            raise ManifestError(f"{what} has {sig.label}, which names no layer of a lora target "
                                f"({', '.join(f'{t.name}.0-{t.layers - 1}' for t in m.lora.targets)})")
        want = ("float32" if sig.role == Role.LORA_SCALE else m.lora.dtype, shapes[(sig.role, sig.slot)])
    if (sig.dtype, tuple(sig.shape)) != want:
        raise ManifestError(f"{what} {sig.label} is {sig.dtype}{list(sig.shape)}, the lora record's is "
                            f"{want[0]}{list(want[1])}")


def _check_lora_whole(m: Manifest, e: Entry, what: str) -> None:
    """With a lora record, an entry takes LORA_SLOTS, LORA_SCALE and each target's each layer's LORA_A and LORA_B,
    once each."""
    if m.lora is None:
        return
    have = [(sig.role, sig.slot) for sig in e.inputs if sig.role in LORA_INPUTS or sig.role in LORA_ADAPTERS]
    want = [(Role.LORA_SLOTS, "")] + [(role, slot) for role, slot, _ in m.lora.buffers()]
    if sorted(have) != sorted(want):
        missing, extra = (sorted(f"{r} {s}".strip() for r, s in pairs)
                          for pairs in (set(want) - set(have), set(have) - set(want)))
        raise ManifestError(f"{what} takes the lora inputs wrongly (missing {missing}, extra or repeated "
                            f"{extra or 'none'}); the lora record needs each once")


# The role groups whose signatures are checked against the manifest's top-level records.
_GROUP_CHECKS = ((frozenset(SAMPLER_INPUTS) | frozenset(SAMPLER_OUTPUTS), _check_sampler_sig),
                 (frozenset(SCORER_INPUTS) | frozenset(SCORER_OUTPUTS), _check_scorer_sig),
                 (frozenset(LORA_INPUTS) | frozenset(LORA_ADAPTERS), _check_lora_sig),
                 (frozenset(DECODE_STEPS_INPUTS) | frozenset(DECODE_STEPS_OUTPUTS), _check_steps_sig),
                 (frozenset(VERIFY_OUTPUTS), _check_verify_sig), (frozenset({Role.HIDDEN_STATES}), _check_hidden_sig))


def _check_entry(m: Manifest, e: Entry, pools: dict[str, Pool], slots: dict[str, WeightFile],
                 step_roles: set[Role]) -> None:
    """An entry's place on the ladders, its signature by role, and its donations."""
    what = f"entry {e.name!r}"
    _positive(e.batch, f"{what} batch")
    _positive(e.tokens_per_seq, f"{what} tokens_per_seq")
    if e.context not in m.buckets.context_ladder or e.batch not in m.buckets.batch_ladder:
        raise ManifestError(f"{what} (batch {e.batch}, context {e.context}) is not on the ladders")
    if e.context % m.block_size:
        raise ManifestError(f"{what} context {e.context} is not a multiple of the block size {m.block_size}")
    seen_roles, pools_in, step_groups = _check_inputs(m, e, pools, slots, step_roles, what)
    if e.packed_tokens:
        n = e.packed_tokens
        flat = [sig for sig in e.inputs if sig.role in PACKED_TOKEN_INPUTS]
        if not 0 < n <= e.batch * e.tokens_per_seq or any(tuple(sig.shape) != (1, n) for sig in flat):
            raise ManifestError(f"{what} is a packed prefill whose per-token inputs are "
                                f"{[list(sig.shape) for sig in flat]}: they are [1, N] with N at most its "
                                f"{e.batch} rows of {e.tokens_per_seq} tokens")
    groups = ("", CHUNK_GROUP) if e.kind == EntryKind.MIXED else ("",)
    if set(step_groups) - set(groups):
        raise ManifestError(f"{what} has step inputs of groups {sorted(step_groups)}; a {e.kind} entry's are "
                            f"{list(groups)}")
    for group in groups:
        missing = step_roles - step_groups.get(group, set())
        if missing:
            raise ManifestError(f"{what} lacks the step inputs {sorted(missing)} its pools need"
                                + (f" (group {group!r})" if group else ""))
    roles_out, pools_out = _check_outputs(m, e, what)
    _check_groups_whole(m, e, seen_roles | roles_out, what)
    _check_lora_whole(m, e, what)
    if pools_in != set(pools) or pools_out != set(pools):
        raise ManifestError(f"{what} takes pools {sorted(pools_in)} and returns {sorted(pools_out)}; "
                            f"the manifest has {sorted(pools)}")
    if e.kind not in (EntryKind.DECODE_STEPS, EntryKind.VERIFY):
        logits = e.outputs[e.output_index(Role.LOGITS)]
        if tuple(logits.shape) != (e.rows, m.model.vocab):
            raise ManifestError(f"{what} returns logits of shape {list(logits.shape)}, the model's vocabulary is "
                                f"{m.model.vocab} ({e.rows} rows)")
    _check_donations(e, pools, what)


def _check_group_sig(m: Manifest, e: Entry, sig: TensorSig, what: str) -> bool:
    """Checks `sig` against its group's record when its role is in one (-> True)."""
    for roles, check in _GROUP_CHECKS:
        if sig.role in roles:
            check(m, e, sig, what)
            return True
    return False


def _check_inputs(m: Manifest, e: Entry, pools: dict[str, Pool], slots: dict[str, WeightFile],
                  step_roles: set[Role], what: str) -> tuple[set[Role], set[str], dict[str, set[Role]]]:
    """-> (the roles of its groups it takes, the pools it takes, the step roles it takes by row group)."""
    seen_roles, seen_pools, step_groups = set(), set(), {}
    for sig in e.inputs:
        if sig.role not in INPUT_ROLES:
            raise ManifestError(f"{what} input has role {sig.role}, which is not an input role")
        dtype_info(sig.dtype, f"{what} input {sig.label}")
        if sig.role == Role.PACK_INDEX:
            if e.kind != EntryKind.PREFILL or sig.slot:
                raise ManifestError(f"{what} takes {sig.role}, which only a prefill entry's rows take")
            if tuple(sig.shape) != (e.batch, e.tokens_per_seq):
                raise ManifestError(f"{what} takes {sig.role} of shape {list(sig.shape)}; its rows are "
                                    f"[{e.batch}, {e.tokens_per_seq}]")
        elif sig.role in STEP_FIELDS:
            if sig.role not in step_roles:
                raise ManifestError(f"{what} takes {sig.role}, which none of the artifact's pools needs")
            step_groups.setdefault(sig.slot, set()).add(sig.role)
        elif _check_group_sig(m, e, sig, what):
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
            seen_pools.add(sig.slot)
    return seen_roles, seen_pools, step_groups


def _check_outputs(m: Manifest, e: Entry, what: str) -> tuple[set[Role], set[str]]:
    """-> (the roles of its groups it returns, the pools it returns)."""
    seen_roles, seen_pools = set(), set()
    for sig in e.outputs:
        if sig.role not in OUTPUT_ROLES:
            raise ManifestError(f"{what} output has role {sig.role}, which is not an output role")
        if sig.role == Role.POOL_OUT:
            seen_pools.add(sig.slot)
        elif _check_group_sig(m, e, sig, what):
            seen_roles.add(sig.role)
    return seen_roles, seen_pools


def _check_groups_whole(m: Manifest, e: Entry, seen_roles: set[Role], what: str) -> None:
    """An entry has all of a group's roles or none: the decode_steps kind's, the sampler's (every entry of a
    manifest with a sampler), the scorer's (every prefill_scored entry)."""
    stepped = e.kind == EntryKind.DECODE_STEPS
    steps_roles = set(DECODE_STEPS_INPUTS) | set(DECODE_STEPS_OUTPUTS)
    if stepped and not steps_roles <= seen_roles:
        raise ManifestError(f"{what} lacks the decode_steps roles {sorted(steps_roles - seen_roles)}")
    if (e.steps > 1) != stepped or (stepped and e.tokens_per_seq != 1):
        raise ManifestError(f"{what} is a {e.kind} entry of {e.steps} steps and {e.tokens_per_seq} tokens per "
                            "sequence (a decode_steps entry runs K > 1 steps of one token; the others one step)")
    if e.kind == EntryKind.VERIFY:
        if not set(VERIFY_OUTPUTS) <= seen_roles or e.tokens_per_seq < 2:
            raise ManifestError(f"{what} is a verify entry of {e.tokens_per_seq} tokens per row returning "
                                f"{sorted(seen_roles)}; one returns {list(VERIFY_OUTPUTS)} for 2 or more tokens a row")
        taken = set(SAMPLER_INPUTS) & seen_roles
        if taken and taken != set(SAMPLER_INPUTS):
            raise ManifestError(f"{what} takes the sampler's roles {sorted(taken)} but not "
                                f"{sorted(set(SAMPLER_INPUTS) - taken)}; a verify entry takes all of them or none")
        return                  # none: greedy acceptance only
    if e.kind == EntryKind.MTP:
        if Role.HIDDEN_STATES not in seen_roles:
            raise ManifestError(f"{what} is an mtp entry without HIDDEN_STATES, the hidden states its head reads")
        return                  # its drafts are greedy: no sampler
    # A decode_steps entry samples in its body but returns only the tokens: it takes the sampler's inputs.
    sampler_roles = set(SAMPLER_INPUTS) | (set() if stepped else set(SAMPLER_OUTPUTS))
    if m.sampler is not None and not sampler_roles <= seen_roles:
        raise ManifestError(f"{what} lacks the sampler's roles {sorted(sampler_roles - seen_roles)} (the manifest "
                            "has a sampler)")
    scorer_roles = set(SCORER_INPUTS) | set(SCORER_OUTPUTS)
    if e.kind == EntryKind.PREFILL_SCORED and not scorer_roles <= seen_roles:
        raise ManifestError(f"{what} lacks the scorer's roles {sorted(scorer_roles - seen_roles)} (a "
                            f"{EntryKind.PREFILL_SCORED} entry scores every position)")


def _check_donations(e: Entry, pools: dict[str, Pool], what: str) -> None:
    """Every pool is donated to itself, and nothing else is donated; every input is kept."""
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
