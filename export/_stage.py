"""tlaloc_jax.stage: a step function authored in JAX -> a serving artifact the JAX-free runtime serves.

    manifest = tlaloc_jax.stage(step, weights, {"kv": PagedKV(layers=4, kv_heads=2, head_dim=32)}, "artifact/",
                                batch_ladder=(1, 4), context_ladder=(128, 512), prefill_chunk=64)

`step(weights, pools, inputs) -> (logits [B, V] f32, pools)` is one call of the model: `weights` is the
pytree given here, `pools` a dict of the declared pools' arrays, `inputs` a `StepInputs` holding the integer
roles those pools need. `stage` exports it with `jax.export` once per (kind, batch, context) point of the
ladders, each body taking its pools donated, and writes the bodies, the weights (raw, one file a leaf,
hashed), the tokenizer files and a manifest (tlaloc-serving-v4) that says everything by role and pool
kind. The built-in Hugging Face decoder is staged by the same function (`export_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import export as jax_export

from tlaloc_jax import manifest as mf
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import sampling as sampling_kernel
from tlaloc_jax.kernels import scoring as scoring_kernel
from tlaloc_jax.paging import ring_pages_for

from ._entries import PLATFORM_CUSTOM_CALLS, EntrySpec, ExportError, check_body, plan_entries
from ._copy_slots import copy_slots_fn, copy_slots_signature
from ._mesh import abstract_mesh, mesh_size, partition_of, pool_split_axis, sharded
from ._multistep import decode_steps_fn, decode_steps_signature
from ._pools import PagedKV, PoolSpec, RingKV, StateSlots
from ._quant import quant_records

Role = mf.Role
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
_SLOT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _ladder(values: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(sorted(set(int(v) for v in values)))
    if not out or out[0] <= 0:
        raise ExportError(f"{what} must hold positive integers, got {list(values)}")
    return out


def _write(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _key_name(k) -> str | None:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def flatten_weights(weights: Any) -> tuple[dict[str, np.ndarray], Any]:
    """A weights pytree (a dict of named arrays, nested dicts, a flax.nnx State) -> ({slot name: array}, treedef).

    Slot names join the path's keys with "." (an nnx Variable's trailing `.value` dropped); they name the
    artifact's weight files, so they keep to letters, digits, "_", "." and "-"."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(weights)
    out: dict[str, np.ndarray] = {}
    for path, leaf in leaves:
        keys = list(path)
        if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
            keys = keys[:-1]
        name = ".".join(_key_name(k) for k in keys) or "weight"
        if not _SLOT_NAME.match(name):
            raise ExportError(f"weight {name!r}: a slot name keeps to letters, digits, '_', '.' and '-'")
        if name in out:
            raise ExportError(f"two weights flatten to the slot name {name!r}")
        arr = np.asarray(leaf)
        if arr.dtype.name not in mf.DTYPES:
            raise ExportError(f"weight {name!r} has dtype {arr.dtype.name}, which an artifact cannot hold "
                              f"(known: {', '.join(mf.DTYPES)})")
        out[name] = arr
    if not out:
        raise ExportError("the weights pytree has no arrays")
    return out, treedef


@dataclasses.dataclass(frozen=True)
class Sampler:
    """The sampler `stage` appends to every entry (kernels/sampling.py): temperature, top-k, top-p, min-p,
    presence / frequency / repetition penalties, logit bias and a token mask applied in the body, a counter-based
    random stream per row, and the logprobs an OpenAI response reports.

    top_logprobs: N, the largest logprobs each entry returns (with their ids) when a row asks; OpenAI allows
        up to 20. logit_bias: NB, the logit-bias entries a row may carry."""

    top_logprobs: int = 20
    logit_bias: int = 64

    def manifest(self, vocab: int) -> mf.Sampler:
        if self.top_logprobs < 0 or self.logit_bias < 0:
            raise ExportError(f"Sampler(top_logprobs={self.top_logprobs}, logit_bias={self.logit_bias}): both must "
                              "be >= 0")
        return mf.Sampler(columns=mf.SAMPLING_COLUMNS, top_logprobs=min(self.top_logprobs, vocab),
                          logit_bias=self.logit_bias, mask_words=sampling_kernel.mask_words(vocab))


@dataclasses.dataclass(frozen=True)
class PromptScorer:
    """Scoring prefill entries `stage` adds beside the plain ones (kind prefill_scored, one per prefill entry): the
    same call, which also returns, for every position, the logprob and rank of the token that follows it and the
    N largest logprobs (kernels/scoring.py), for echo and prompt_logprobs. A request that asks for none runs the
    plain entries and never pays for the T x V logits; the runtime compiles the scoring ones on first use.

    hidden(weights, pools, inputs) -> (hidden [B, T, E], pools): the step up to its output head, for every token
        of the call (the step's own layers: one forward pass serves the next token and the scores).
    head(weights, x [R, E]) -> logits [R, V]: the output head; head(hidden[:, -1]) is the step's logits.
    top_logprobs: N, the largest logprobs returned per position (vLLM allows prompt_logprobs up to 20)."""

    hidden: Callable
    head: Callable
    top_logprobs: int = 20

    def manifest(self, vocab: int) -> mf.Scorer:
        if self.top_logprobs < 0:
            raise ExportError(f"PromptScorer(top_logprobs={self.top_logprobs}) must be >= 0")
        return mf.Scorer(top_logprobs=min(self.top_logprobs, vocab))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The resolved pools: manifest Pools in declaration order, and the ring size (0 without a ring)."""

    pools: tuple[mf.Pool, ...]
    ring_pages: int

    @property
    def kinds(self) -> tuple[mf.PoolKind, ...]:
        return tuple(k for k in mf.PoolKind if any(p.kind == k for p in self.pools))


def _resolve_pools(specs: Mapping[str, PoolSpec], *, block_size: int, contexts: tuple[int, ...], max_batch: int,
                   chunk: int, num_blocks: int | None, ring_blocks: int | None, state_slots: int | None) -> _Layout:
    """Size each declared pool: pages for paged and ring pools, slots for state pools."""
    if not specs:
        raise ExportError("declare at least one pool (PagedKV, RingKV or StateSlots)")
    pages_per_seq = contexts[-1] // block_size
    full_pages = int(num_blocks or max_batch * pages_per_seq)
    if full_pages < pages_per_seq:
        raise ExportError(f"num_blocks {full_pages} cannot hold one sequence of the largest context "
                          f"({pages_per_seq} pages)")
    sequences = max(max_batch, full_pages // pages_per_seq)
    rings = {(s.window, s.ring_pages) for s in specs.values() if isinstance(s, RingKV)}
    if len(rings) > 1:
        raise ExportError(f"ring pools share one ring per sequence; they declare windows and rings {sorted(rings)}")
    ring = 0
    if rings:
        window, declared = rings.pop()
        if window <= 0:
            raise ExportError(f"a ring pool needs a positive window, got {window}")
        ring = int(declared or ring_pages_for(window, chunk or contexts[-1], block_size, pages_per_seq))
        ring_blocks = int(ring_blocks or min(full_pages, sequences * ring))
        if ring_blocks < ring:
            raise ExportError(f"ring_blocks {ring_blocks} cannot hold one ring of {ring} pages")
    # Beside a slot for each sequence, as many spare ones for the runtime's state snapshots (prefix caching).
    slots = int(state_slots or sequences + max_batch)
    if slots < 1:
        raise ExportError(f"state_slots must be positive, got {slots}")
    pools = []
    for name, spec in specs.items():
        if not isinstance(spec, (PagedKV, RingKV, StateSlots)):
            raise ExportError(f"pool {name!r} is a {type(spec).__name__}; declare PagedKV, RingKV or StateSlots")
        if not _SLOT_NAME.match(name):
            raise ExportError(f"pool name {name!r} keeps to letters, digits, '_', '.' and '-'")
        if spec.dtype not in mf.DTYPES:
            raise ExportError(f"pool {name!r} has dtype {spec.dtype!r} (known: {', '.join(mf.DTYPES)})")
        if isinstance(spec, RingKV):
            spec = dataclasses.replace(spec, ring_pages=ring)
        capacity = {mf.PoolKind.PAGED_KV: full_pages, mf.PoolKind.RING_KV: ring_blocks,
                    mf.PoolKind.STATE_SLOTS: slots}[spec.kind]
        pools.append(spec.to_pool(name, capacity, block_size))
    return _Layout(tuple(pools), ring)


def entry_signature(spec: EntrySpec, layout: _Layout, block_size: int, vocab: int,
                    weights: Mapping[str, np.ndarray], sampler: mf.Sampler | None = None,
                    scorer: mf.Scorer | None = None, weight_parts: Mapping[str, mf.Partition] | None = None
                    ) -> tuple[list[mf.TensorSig], list[mf.TensorSig], tuple[tuple[int, int], ...]]:
    """(inputs, outputs, donations) of an entry: the step inputs its pools need, the sampler's inputs, (a scoring
    prefill) the scorer's, the pools, the weights (on a mesh, each weight split as weight_parts says, each pool as
    its own partition; everything else whole)."""
    B, T, M = spec.batch, spec.tokens_per_seq, spec.context // block_size
    shapes = {Role.TOKEN_IDS: (B, T), Role.POSITIONS: (B, T), Role.SEQ_LENS: (B,), Role.BLOCK_TABLES: (B, M),
              Role.SLOT_MAPPING: (B, T), Role.WINDOW_BLOCK_TABLES: (B, M), Role.WINDOW_SLOT_MAPPING: (B, T),
              Role.STATE_SLOTS: (B,)}
    roles = set(mf.BASE_STEP_INPUTS)
    for kind in layout.kinds:
        roles.update(mf.POOL_KIND_INPUTS[kind])
    inputs = [mf.TensorSig(role, "int32", shapes[role]) for role in mf.STEP_FIELDS if role in roles]
    outputs = [mf.TensorSig(Role.LOGITS, "float32", (B, vocab)), mf.TensorSig(Role.NEXT_TOKEN, "int32", (B,))]
    if sampler is not None:
        shapes = sampler.shapes(B, spec.context)
        inputs += [mf.TensorSig(r, mf.SAMPLER_DTYPES.get(r, "int32"), shapes[r]) for r in mf.SAMPLER_INPUTS]
        outputs += [mf.TensorSig(r, mf.SAMPLER_DTYPES.get(r, "int32"), shapes[r]) for r in mf.SAMPLER_OUTPUTS]
    if spec.kind == mf.EntryKind.PREFILL_SCORED:
        shapes = scorer.shapes(B, T)
        inputs += [mf.TensorSig(r, "int32", shapes[r]) for r in mf.SCORER_INPUTS]
        outputs += [mf.TensorSig(r, mf.SCORER_DTYPES.get(r, "int32"), shapes[r]) for r in mf.SCORER_OUTPUTS]
    donations = []
    for p in layout.pools:
        donations.append((len(outputs), len(inputs)))
        inputs.append(mf.TensorSig(Role.POOL_IN, p.dtype, p.shape, p.name, p.partition))
        outputs.append(mf.TensorSig(Role.POOL_OUT, p.dtype, p.shape, p.name, p.partition))
    parts = weight_parts or {}
    inputs += [mf.TensorSig(Role.WEIGHT, w.dtype.name, tuple(w.shape), slot, parts.get(slot, ()))
               for slot, w in weights.items()]
    return inputs, outputs, tuple(donations)


def _entry_fn(step: Callable, treedef, inputs: list[mf.TensorSig], outputs: list[mf.TensorSig], ring_pages: int,
              scorer: PromptScorer | None = None):
    """The entry's function over its positional arguments, in signature order (a scoring prefill, one that takes
    SCORE_TARGETS, runs `scorer` in place of `step`)."""
    def entry(*args):
        fields, pools, leaves, sampler, targets = {}, {}, [], {}, None
        for sig, a in zip(inputs, args):
            if sig.role in mf.STEP_FIELDS:
                fields[mf.STEP_FIELDS[sig.role]] = a
            elif sig.role in mf.SAMPLER_INPUTS:
                sampler[sig.role] = a
            elif sig.role == Role.SCORE_TARGETS:
                targets = a
            elif sig.role == Role.POOL_IN:
                pools[sig.slot] = a
            else:
                leaves.append(a)
        if ring_pages:
            # The step sees a sequence's ring, not the bucket-wide table the runtime fills.
            fields["window_block_tables"] = fields["window_block_tables"][:, :ring_pages]
        weights = jax.tree_util.tree_unflatten(treedef, leaves)
        if targets is not None:
            result = scorer.hidden(weights, pools, StepInputs(**fields))
            if not (isinstance(result, tuple) and len(result) == 2) or getattr(result[0], "ndim", 0) != 3:
                raise ExportError("the scorer's hidden function must return (hidden [B, T, E], pools)")
            hidden = result[0]
            result = (scorer.head(weights, hidden[:, -1]), result[1])
        else:
            result = step(weights, pools, StepInputs(**fields))
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ExportError("the step function must return (logits, pools)")
        logits, new_pools = result
        if not isinstance(new_pools, Mapping) or set(new_pools) != set(pools):
            got = sorted(new_pools) if isinstance(new_pools, Mapping) else type(new_pools).__name__
            raise ExportError(f"the step function returned pools {got}; it was given {sorted(pools)}")
        for name, buf in new_pools.items():
            if (buf.shape, buf.dtype) != (pools[name].shape, pools[name].dtype):
                raise ExportError(f"the step function returned pool {name!r} as {buf.dtype}{list(buf.shape)}, it "
                                  f"was given {pools[name].dtype}{list(pools[name].shape)}")
        logits = logits.astype(jnp.float32)
        # The argmax rides along so a greedy caller need not pull the whole logits vector each step.
        results = {(Role.LOGITS, ""): logits,
                   (Role.NEXT_TOKEN, ""): jnp.argmax(logits, axis=-1).astype(jnp.int32)}
        if sampler:
            # The sampler runs on every entry, after the step: the host pulls a token per row (and its logprobs),
            # never the logits, whatever the row's sampling parameters.
            top_n = next(o.shape[1] for o in outputs if o.role == Role.TOP_LOGPROBS)
            chosen = sampling_kernel.sample_tokens(logits, *(sampler[r] for r in mf.SAMPLER_INPUTS),
                                                   fields["seq_lens"], top_n=top_n)
            results.update({(role, ""): value for role, value in zip(mf.SAMPLER_OUTPUTS, chosen)})
        if targets is not None:
            top_n = next(o.shape[2] for o in outputs if o.role == Role.PROMPT_TOP_LOGPROBS)
            scores = scoring_kernel.score_positions(hidden, targets, lambda x: scorer.head(weights, x), top_n=top_n)
            results.update({(role, ""): value for role, value in zip(mf.SCORER_OUTPUTS, scores)})
        results.update({(Role.POOL_OUT, name): buf for name, buf in new_pools.items()})
        return tuple(results[(o.role, o.slot)] for o in outputs)
    return entry


def _avals(sigs: Sequence[mf.TensorSig]):
    return [jax.ShapeDtypeStruct(s.shape, jnp.dtype(mf.numpy_dtype(s.dtype))) for s in sigs]


def _vocab(step: Callable, treedef, spec: EntrySpec, layout: _Layout, block_size: int,
           weights: Mapping[str, np.ndarray], mesh=None, weight_parts=None) -> int:
    """The vocabulary: the last axis of the step's logits, read off an abstract evaluation of one entry (on the
    mesh, when there is one)."""
    inputs, outputs, _ = entry_signature(spec, layout, block_size, 1, weights, weight_parts=weight_parts)
    fn, avals = _entry_fn(step, treedef, inputs, outputs, layout.ring_pages), _avals(inputs)
    if mesh is not None:
        fn, avals, _ = sharded(fn, inputs, outputs, mesh)
    shape = jax.eval_shape(fn, *avals)[0].shape
    if len(shape) != 2 or shape[0] != spec.batch:
        raise ExportError(f"the step function returned logits of shape {list(shape)}; expected [B, V] with "
                          f"B = {spec.batch}")
    return int(shape[1])


def export_entry(step: Callable, treedef, spec: EntrySpec, inputs, outputs, donations, *, ring_pages: int,
                 platform: str, scorer: PromptScorer | None = None, block_size: int = 0,
                 mesh=None) -> jax_export.Exported:
    """jax.export one entry with its pools donated; checks the body against its signature. mesh: the AbstractMesh
    the entry runs on (under shard_map, each argument split as its signature's partition says); None: one device.

    jax.export drops arguments the function never reads. A weight or pool dropped that way is a mistake and
    is refused (check_body); a step input the model has no use for (a recurrent model needs no SEQ_LENS)
    is kept in the body instead, so that every entry takes what its pools' kinds say."""
    if spec.kind == mf.EntryKind.DECODE_STEPS:
        fn = decode_steps_fn(step, treedef, inputs, outputs, steps=spec.steps, block_size=block_size,
                             ring_pages=ring_pages)
    else:
        fn = _entry_fn(step, treedef, inputs, outputs, ring_pages, scorer)

    avals, out_shardings = _avals(inputs), None
    if mesh is not None:
        fn, avals, out_shardings = sharded(fn, inputs, outputs, mesh)

    def export(keep_unused: bool) -> jax_export.Exported:
        return export_fn(fn, avals, platform=platform, donate=tuple(i for _, i in donations),
                         keep_unused=keep_unused, out_shardings=out_shardings)

    exp = export(keep_unused=False)
    dropped = set(range(len(inputs))) - set(exp.module_kept_var_idx)
    if dropped and all(inputs[i].role in mf.STEP_FIELDS for i in dropped):
        exp = export(keep_unused=True)
    check_body(spec.name, exp, inputs, outputs, donations, platform, mesh_size(mesh))
    return exp


def export_fn(fn: Callable, avals, *, platform: str, donate: tuple[int, ...] = (),
              keep_unused: bool = False, out_shardings=None) -> jax_export.Exported:
    """jax.export `fn` jitted (arguments `donate` donated) at `avals`, for one platform.

    jax.export refuses custom calls it gives no compatibility guarantee for; the platform's own ones
    (PLATFORM_CUSTOM_CALLS: a Triton kernel on cuda) are let through here, and check_custom_calls refuses
    the rest by name. The Triton IR such a kernel carries is outside StableHLO's compatibility guarantees: a
    plugin of another jax release than the exporting one (versions.jax in the manifest) may not read it."""
    # A mesh's results carry their shardings (out_shardings): jax then writes each donated pool's alias.
    jitted = jax.jit(fn, donate_argnums=donate, keep_unused=keep_unused,
                     **({"out_shardings": out_shardings} if out_shardings is not None else {}))
    disabled = [jax_export.DisabledSafetyCheck.custom_call(t) for t in sorted(PLATFORM_CUSTOM_CALLS.get(platform, ()))]
    # Source locations would put this checkout's file paths into the body; an artifact must not depend on them.
    limit = jax.config.jax_traceback_in_locations_limit
    jax.config.update("jax_traceback_in_locations_limit", 0)
    try:
        return jax_export.export(jitted, platforms=[platform], disabled_checks=disabled)(*avals)
    finally:
        jax.config.update("jax_traceback_in_locations_limit", limit)


@dataclasses.dataclass(frozen=True)
class BodyFiles:
    """The three files of one exported body, named by the textual body's sha256 (field names as mf.Entry's)."""

    body: str
    body_sha256: str
    serialized: str
    serialized_sha256: str
    exported: str
    exported_sha256: str


def write_body(out: Path, exp: jax_export.Exported) -> BodyFiles:
    """Write an exported body: its textual StableHLO, the portable bytecode the runtime compiles, and jax's own
    serialization."""
    text = exp.mlir_module().encode()
    digest = hashlib.sha256(text).hexdigest()
    body = f"bodies/{digest}.mlir"
    _write(out / body, text)
    serialized = f"bodies/{digest}.mlirbc"
    exported = f"bodies/{digest}.exported"
    return BodyFiles(body=body, body_sha256=digest, serialized=serialized,
                     serialized_sha256=_write(out / serialized, exp.mlir_module_serialized),
                     exported=exported, exported_sha256=_write(out / exported, exp.serialize()))


def write_weights(out: Path, flat: Mapping[str, np.ndarray], bar,
                  quant: Mapping[str, mf.WeightQuant] | None = None,
                  parts: Mapping[str, mf.Partition] | None = None, devices: int = 1) -> tuple[mf.WeightFile, ...]:
    """One raw file per weight (host order, checked little-endian by the caller), hashed; `bar` ticks per file.
    quant: the slots that are halves of quantized weights (export/_quant.py's quant_records). parts: a weight split
    over the devices (its partition names a dimension) is written as one file per device, its block along that
    dimension, so that each device reads its shard alone."""
    quant, parts = quant or {}, parts or {}
    files = []
    for i, (slot, w) in enumerate(flat.items()):
        bar.set_postfix_str(slot)
        partition = parts.get(slot, ())
        common = dict(slot=slot, dtype=w.dtype.name, shape=tuple(w.shape), nbytes=w.nbytes, quant=quant.get(slot))
        if any(partition):
            axis = next(d for d, name in enumerate(partition) if name)
            shards = []
            for d, block in enumerate(np.split(np.asarray(w), devices, axis=axis)):
                rel = f"weights/{i:04d}_{slot}.shard{d}of{devices}.bin"
                data = np.ascontiguousarray(block).tobytes()
                shards.append(mf.WeightShard(file=rel, nbytes=len(data), sha256=_write(out / rel, data)))
            files.append(mf.WeightFile(**common, partition=partition, shards=tuple(shards)))
        else:
            rel = f"weights/{i:04d}_{slot}.bin"
            files.append(mf.WeightFile(**common, file=rel, sha256=_write(out / rel, np.ascontiguousarray(w).tobytes())))
        bar.update()
    return tuple(files)


def copy_tokenizer(out: Path, tokenizer_dir) -> tuple[mf.TokenizerFile, ...]:
    """The tokenizer files of `tokenizer_dir` (those of TOKENIZER_FILES it has), copied into the artifact, hashed."""
    if tokenizer_dir is None:
        return ()
    files = []
    for fname in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / fname
        if src.is_file():
            shutil.copyfile(src, out / fname)
            files.append(mf.TokenizerFile(fname, mf.sha256_file(out / fname)))
    return tuple(files)


def _write_program(out: Path, entry: mf.Entry) -> None:
    """programs/<entry>.json: the entry's inputs and outputs with their roles."""
    _write(out / entry.program, (json.dumps({"entry": entry.name, "inputs": [mf.record_json(s) for s in entry.inputs],
                                             "outputs": [mf.record_json(s) for s in entry.outputs]},
                                            indent=1, sort_keys=True) + "\n").encode())


def _copy_slots_entry(out: Path, layout: _Layout, batch: int, platform: str, mesh=None) -> mf.Entry:
    """The entry that copies state slots (the runtime's state snapshots for prefix caching), `batch` pairs a call;
    on a mesh, each device copies within its blocks of the state pools."""
    name = f"copy_slots_n{batch}"
    inputs, outputs, donations = copy_slots_signature(layout.pools, batch)
    fn, avals, out_shardings = copy_slots_fn(layout.pools), _avals(inputs), None
    if mesh is not None:
        fn, avals, out_shardings = sharded(fn, inputs, outputs, mesh)
    exp = export_fn(fn, avals, platform=platform, donate=tuple(i for _, i in donations), out_shardings=out_shardings)
    check_body(name, exp, inputs, outputs, donations, platform, mesh_size(mesh))
    entry = mf.Entry(name=name, kind=mf.EntryKind.COPY_SLOTS, batch=batch, context=0, tokens_per_seq=0,
                     **dataclasses.asdict(write_body(out, exp)), program=f"programs/{name}.json",
                     inputs=tuple(inputs), outputs=tuple(outputs), donations=donations,
                     kept_inputs=tuple(exp.module_kept_var_idx))
    _write_program(out, entry)
    return entry


def stage(step: Callable, weights: Any, pools: Mapping[str, PoolSpec], out_dir, *,
          batch_ladder: Sequence[int] = (1, 2, 4), context_ladder: Sequence[int] = (64, 256, 1024),
          prefill_chunk: int | None = None, prefill_max_batch: int | None = None, block_size: int = 16,
          num_blocks: int | None = None, ring_blocks: int | None = None, state_slots: int | None = None,
          platform: str = "cpu", name: str = "model", model_type: str = "authored",
          eos_token_ids: Sequence[int] = (), refused_tokens: Sequence[tuple[int, str]] = (),
          tokenizer_dir=None, embedding_slot: str = "", describe: Mapping[str, int] | None = None,
          attention_block: int = 0, progress: bool = True, sampler: Sampler | None = None,
          prompt_logprobs: PromptScorer | None = None, decode_steps: int = 1, mesh=None,
          weight_split_axes: Mapping[str, int | None] | None = None) -> mf.Manifest:
    """Write the serving artifact of `step` to `out_dir` (empty or absent) and return its manifest.

    step(weights, pools, inputs) -> (logits [B, V], pools): one call, traced once per entry; it must return
        every pool it was given, same shape and dtype (written in place: the pools are donated).
    weights: a pytree of arrays (a dict of named arrays, or a flax.nnx State); `step` gets the same structure.
    pools: {name: PagedKV | RingKV | StateSlots}.
    batch_ladder, context_ladder: one decode and one prefill entry per (batch, context) point; prefill batches
        capped by prefill_max_batch, tokens per prefill call by prefill_chunk (None: the whole context).
    block_size: positions per page. num_blocks: pages of the paged pools (default: the largest batch at the
        largest context); ring_blocks: pages of the ring pools; state_slots: slots of the state pools (default:
        as many sequences as the paged pools hold at the largest context, at least the largest batch, plus the
        largest batch again: spare slots for the state snapshots prefix caching keeps).
    tokenizer_dir: a directory whose tokenizer files (tokenizer.json, tokenizer_config.json, chat template,
        generation_config.json) are copied into the artifact. embedding_slot: the weight whose rows are the
        vocabulary, checked against it at load. describe: informative model sizes for the manifest (layers,
        heads, kv_heads, head_dim, hidden).
    sampler: a `Sampler()` appends the sampler to every entry (temperature, top-k, top-p, min-p, penalties, logit
        bias, a token mask, logprobs: kernels/sampling.py), so that the runtime pulls a token per row, never the
        logits. None (the default here; `python -m tlaloc_jax.export` stages one unless --no-sampler) stages the
        step alone: the runtime then samples on the host from pulled logits. The sampler adds about a second of
        compile time per entry on a 2-core CPU.
    prompt_logprobs: a `PromptScorer` adds a scoring prefill entry beside each prefill entry (echo and
        prompt_logprobs read a prompt in chunks and score it in the body); None: such a prompt is read a token
        a call and scored on the host.
    decode_steps: K > 1 adds a decode_steps entry beside each decode entry: up to K decode steps in one call,
        each step's token (argmax, or the sampler's) fed to the next, a row stopping on its stop ids or a
        step limit (export/_multistep.py); the runtime uses it while every sequence is decoding.
    mesh: N (or a 1-D jax Mesh / AbstractMesh) stages every entry for N devices (tensor parallelism,
        docs/multi-device.md): `step` runs under jax.shard_map on each device's shards and all-reduces where its
        shards meet (lax.psum over the mesh axis). weight_split_axes: {slot: the axis of that weight split over
        the devices, or None}; unlisted weights are whole on every device. KV pools split over their KV heads,
        state pools over their `shard_axis`. None: one device.
    The export needs no accelerator and loads no PJRT plugin; the same inputs give the same bytes.
    """
    batches = _ladder(batch_ladder, "batch ladder")
    contexts = _ladder(context_ladder, "context ladder")
    if block_size <= 0:
        raise ExportError(f"block size must be positive, got {block_size}")
    for c in contexts:
        if c % block_size:
            raise ExportError(f"context {c} is not a multiple of the block size {block_size}")
    prefill_max_batch = batches[-1] if prefill_max_batch is None else int(prefill_max_batch)
    if prefill_max_batch < batches[0]:
        raise ExportError(f"prefill_max_batch {prefill_max_batch} is below the smallest batch {batches[0]}: "
                          "no prefill entry would be written")
    chunk = int(prefill_chunk or 0)
    if chunk < 0:
        raise ExportError(f"prefill chunk must be positive, got {chunk}")
    if platform not in ("cpu", "cuda"):
        raise ExportError(f"platform {platform!r}: bodies are lowered for cpu or cuda")
    if sys.byteorder != "little":
        raise ExportError("weight files are raw little-endian; exporting from a big-endian host is not supported")
    flat, treedef = flatten_weights(weights)
    mesh = abstract_mesh(mesh)
    unknown = sorted(set(weight_split_axes or {}) - set(flat))
    if unknown:
        raise ExportError(f"weight_split_axes names {', '.join(unknown)}, which are not weights")
    weight_parts = {slot: partition_of(w.ndim, (weight_split_axes or {}).get(slot), mesh) for slot, w in flat.items()}
    if embedding_slot and embedding_slot not in flat:
        raise ExportError(f"embedding_slot {embedding_slot!r} is not a weight (weights: {', '.join(flat)})")
    layout = _resolve_pools(pools, block_size=block_size, contexts=contexts, max_batch=batches[-1], chunk=chunk,
                            num_blocks=num_blocks, ring_blocks=ring_blocks, state_slots=state_slots)
    if mesh is not None:
        layout = dataclasses.replace(layout, pools=tuple(
            dataclasses.replace(p, partition=partition_of(len(p.shape), pool_split_axis(pools[p.name]), mesh))
            for p in layout.pools))
    specs = plan_entries(batches, contexts, prefill_max_batch, chunk)
    if not isinstance(decode_steps, int) or decode_steps < 1:
        raise ExportError(f"decode_steps must be a positive integer, got {decode_steps!r}")
    if decode_steps > 1:
        specs += [EntrySpec(mf.EntryKind.DECODE_STEPS, s.batch, s.context, 1, decode_steps) for s in specs
                  if s.kind == mf.EntryKind.DECODE]
    if prompt_logprobs is not None:
        specs += [dataclasses.replace(s, kind=mf.EntryKind.PREFILL_SCORED) for s in specs
                  if s.kind == mf.EntryKind.PREFILL]
    vocab = _vocab(step, treedef, specs[0], layout, block_size, flat, mesh, weight_parts)
    sampler_spec = sampler.manifest(vocab) if sampler is not None else None
    scorer_spec = prompt_logprobs.manifest(vocab) if prompt_logprobs is not None else None
    if embedding_slot and flat[embedding_slot].shape[:1] != (vocab,):
        raise ExportError(f"embedding {embedding_slot!r} has {flat[embedding_slot].shape[0]} rows, the logits "
                          f"{vocab} entries")

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"output directory {str(out)!r} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    entries, calling_convention = [], 0
    # Imported only when shown: tqdm.auto warns in a notebook without ipywidgets even when disabled.
    if progress:
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm
    bar = tqdm(total=len(specs) + len(flat), desc="export", unit="item", disable=not progress)
    for spec in specs:
        bar.set_postfix_str(spec.name)
        inputs, outputs, donations = entry_signature(spec, layout, block_size, vocab, flat, sampler_spec,
                                                     scorer_spec, weight_parts)
        if spec.kind == mf.EntryKind.DECODE_STEPS:
            inputs, outputs, donations = decode_steps_signature(inputs, outputs, batch=spec.batch, steps=spec.steps)
        exp = export_entry(step, treedef, spec, inputs, outputs, donations, ring_pages=layout.ring_pages,
                           platform=platform, scorer=prompt_logprobs, block_size=block_size, mesh=mesh)
        calling_convention = int(exp.calling_convention_version)
        entry = mf.Entry(name=spec.name, kind=mf.EntryKind(spec.kind), batch=spec.batch, context=spec.context,
                         tokens_per_seq=spec.tokens_per_seq, **dataclasses.asdict(write_body(out, exp)),
                         program=f"programs/{spec.name}.json", inputs=tuple(inputs), outputs=tuple(outputs),
                         donations=donations, kept_inputs=tuple(exp.module_kept_var_idx), steps=spec.steps)
        _write_program(out, entry)
        entries.append(entry)
        bar.update()

    if any(p.kind == mf.PoolKind.STATE_SLOTS for p in layout.pools):
        entries.append(_copy_slots_entry(out, layout, batches[-1], platform, mesh))
    files = write_weights(out, flat, bar, quant_records(weights), weight_parts, mesh_size(mesh))
    bar.close()
    tokenizer = copy_tokenizer(out, tokenizer_dir)

    describe = dict(describe or {})
    dtypes = sorted({w.dtype.name for w in flat.values()})
    m = mf.Manifest(
        schema=mf.SCHEMA_V4, block_size=block_size, pools=layout.pools,
        model=mf.ModelShape(name=name, model_type=model_type, vocab=vocab,
                            weight_dtype=describe.pop("weight_dtype", dtypes[0] if len(dtypes) == 1 else "mixed"),
                            kv_dtype=describe.pop("kv_dtype", layout.pools[0].dtype),
                            eos_token_ids=tuple(int(t) for t in eos_token_ids), embedding_slot=embedding_slot,
                            **describe),
        buckets=mf.Buckets(batch_ladder=batches, context_ladder=contexts, prefill_max_batch=prefill_max_batch,
                           prefill_chunk=chunk),
        entries=tuple(entries), weights=files,
        versions=mf.Versions(jax=jax.__version__, jaxlib=jaxlib.__version__, calling_convention=calling_convention,
                             platform=platform, attention_block=attention_block),
        refused_tokens=tuple(mf.RefusedToken(int(t), k) for t, k in refused_tokens),
        tokenizer_files=tokenizer, sampler=sampler_spec, scorer=scorer_spec,
        mesh=mf.Mesh((mf.MeshAxis(mesh.axis_names[0], mesh_size(mesh)),)) if mesh is not None else None,
    )
    (out / mf.MANIFEST_NAME).write_text(m.to_json())
    return mf.load_manifest(out)
