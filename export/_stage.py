"""tlaloc_jax.stage: a step function authored in JAX -> a serving artifact the JAX-free runtime serves.

    manifest = tlaloc_jax.stage(step, weights, {"kv": PagedKV(layers=4, kv_heads=2, head_dim=32)}, "artifact/",
                                ladders=Ladders(batch=(1, 4), context=(128, 512), prefill_chunk=64))

`step(weights, pools, inputs) -> (logits [B, V] f32, pools)` is one call of the model: `weights` is the
pytree given here, `pools` a dict of the declared pools' arrays, `inputs` a `StepInputs` holding the integer
roles those pools need. `stage` exports it with `jax.export` once per (kind, batch, context) point of the
ladders, each body taking its pools donated, and writes the bodies, the weights (raw, one file a leaf,
hashed), the tokenizer files and a manifest (tlaloc-serving-v5) that says everything by role and pool
kind. The built-in Hugging Face decoder is staged by the same function (`export_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import export as jax_export

from tlaloc_jax import artifact as af
from tlaloc_jax import lora as lora_slots
from tlaloc_jax import native
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import in_body_sampler as sampling_kernel
from tlaloc_jax.kernels import scoring as scoring_kernel
from tlaloc_jax.serve.core.paging import ring_pages_for
from tlaloc_jax.pools import PagedKV, PoolSpec, RingKV, StateSlots

from ._copy_slots import copy_slots_entry
from ._decode_steps import decode_steps_fn, decode_steps_signature
from ._entries import EntrySpec, ExportError, check_body, export_fn, plan_entries
from ._files import copy_tokenizer, write_body, write_weights
from ._mtp_entries import MtpStage, mtp_fn, mtp_signature, mtp_specs, returns_hidden, with_hidden_output
from ._progress import progress_bar
from ._timing import timed
from ._verify import verify_fn, verify_signature
from ._mesh import abstract_mesh, mesh_size, partition_of, pool_split_axis, sharded
from ._options import (DEFAULT_POOL_SEQUENCES, DEFAULT_PREFILL_MAX_BATCH, Capacity, Features, Ladders, ModelInfo,
                       Options, SplitStep)
from ._quant import quant_records
from ._weights import flatten_weights

Role = af.Role
# The top logprobs a verify entry returns per position when no sampler says how many (OpenAI's largest).
VERIFY_TOP_LOGPROBS = 20


def sorted_ladder(values: Sequence[int], what: str) -> tuple[int, ...]:
    """A ladder's values, sorted and unique; refused unless positive."""
    out = tuple(sorted(set(int(v) for v in values)))
    if not out or out[0] <= 0:
        raise ExportError(f"{what} must hold positive integers, got {list(values)}")
    return out


@dataclasses.dataclass(frozen=True)
class _ResolvedPools:
    """The declared pools sized: manifest Pools in declaration order, and the ring size (0 without a ring)."""

    pools: tuple[af.Pool, ...]
    ring_pages: int

    @property
    def kinds(self) -> tuple[af.PoolKind, ...]:
        return tuple(k for k in af.PoolKind if any(p.kind == k for p in self.pools))


def _resolve_pools(specs: Mapping[str, PoolSpec], capacity: Capacity, *, contexts: tuple[int, ...], max_batch: int,
                   chunk: int) -> _ResolvedPools:
    """Size each declared pool: pages for paged and ring pools, slots for state pools."""
    if not specs:
        raise ExportError("declare at least one pool (PagedKV, RingKV or StateSlots)")
    block_size = capacity.block_size
    pages_per_seq = contexts[-1] // block_size
    full_pages = int(capacity.paged_kv or min(max_batch, DEFAULT_POOL_SEQUENCES) * pages_per_seq)
    if full_pages < pages_per_seq:
        raise ExportError(f"capacity.paged_kv {full_pages} cannot hold one sequence of the largest context "
                          f"({pages_per_seq} pages)")
    sequences = max(max_batch, full_pages // pages_per_seq)
    rings = {(s.window, s.ring_pages) for s in specs.values() if isinstance(s, RingKV)}
    if len(rings) > 1:
        raise ExportError(f"ring pools share one ring per sequence; they declare windows and rings {sorted(rings)}")
    ring, ring_blocks = 0, 0
    if rings:
        window, declared = rings.pop()
        if window <= 0:
            raise ExportError(f"a ring pool needs a positive window, got {window}")
        ring = int(declared or ring_pages_for(window, chunk or contexts[-1], block_size, pages_per_seq))
        ring_blocks = int(capacity.ring_kv or min(full_pages, sequences * ring))
        if ring_blocks < ring:
            raise ExportError(f"capacity.ring_kv {ring_blocks} cannot hold one ring of {ring} pages")
    # Beside a slot for each sequence, spare ones for the runtime's state snapshots (prefix caching).
    slots = int(capacity.state_slots or sequences + min(max_batch, 4))
    if slots < 1:
        raise ExportError(f"capacity.state_slots must be positive, got {slots}")
    pools = []
    for name, spec in specs.items():
        if not isinstance(spec, (PagedKV, RingKV, StateSlots)):
            raise ExportError(f"pool {name!r} is a {type(spec).__name__}; declare PagedKV, RingKV or StateSlots")
        if not af.NAME.match(name):
            raise ExportError(f"pool name {name!r} keeps to letters, digits, '_', '.' and '-'")
        if spec.dtype not in af.DTYPES:
            raise ExportError(f"pool {name!r} has dtype {spec.dtype!r} (known: {', '.join(af.DTYPES)})")
        if isinstance(spec, RingKV):
            spec = dataclasses.replace(spec, ring_pages=ring)
        size = {af.PoolKind.PAGED_KV: full_pages, af.PoolKind.RING_KV: ring_blocks,
                af.PoolKind.STATE_SLOTS: slots}[spec.kind]
        pools.append(spec.to_pool(name, size, block_size))
    return _ResolvedPools(tuple(pools), ring)


def entry_signature(spec: EntrySpec, resolved: _ResolvedPools, block_size: int, vocab: int,
                    weights: Mapping[str, np.ndarray], sampler: af.SamplerShape | None = None,
                    scorer: af.ScorerShape | None = None, weight_parts: Mapping[str, af.Partition] | None = None,
                    lora: af.LoraShape | None = None
                    ) -> tuple[list[af.TensorSig], list[af.TensorSig], tuple[tuple[int, int], ...]]:
    """(inputs, outputs, donations) of an entry: the step inputs its pools need (a mixed entry: its decode rows',
    then its chunk's), the sampler's inputs, (a scoring prefill) the scorer's, (lora) each row's adapter slot, the
    pools, the weights (on a mesh, each weight split as weight_parts says, each pool as its own partition;
    everything else whole), (lora) the adapter buffers."""
    M = spec.context // block_size
    roles = set(af.BASE_STEP_INPUTS)
    for kind in resolved.kinds:
        roles.update(af.POOL_KIND_INPUTS[kind])
    if spec.packed:
        roles.add(Role.PACK_INDEX)

    def step_inputs(B: int, T: int, group: str = "") -> list[af.TensorSig]:
        shapes = {Role.TOKEN_IDS: (B, T), Role.POSITIONS: (B, T), Role.SEQ_LENS: (B,), Role.BLOCK_TABLES: (B, M),
                  Role.SLOT_MAPPING: (B, T), Role.WINDOW_BLOCK_TABLES: (B, M), Role.WINDOW_SLOT_MAPPING: (B, T),
                  Role.STATE_SLOTS: (B,), Role.PACK_INDEX: (B, T)}
        if spec.packed:         # the rows' tokens side by side
            shapes.update({r: (1, spec.packed) for r in af.PACKED_TOKEN_INPUTS})
        return [af.TensorSig(role, "int32", shapes[role], group) for role in af.STEP_FIELDS if role in roles]

    B, T = spec.rows, spec.tokens_per_seq
    if spec.kind == af.EntryKind.MIXED:
        inputs = step_inputs(spec.batch, 1) + step_inputs(1, T, af.CHUNK_GROUP)
    else:
        inputs = step_inputs(B, T)
    outputs = [af.TensorSig(Role.LOGITS, "float32", (B, vocab)), af.TensorSig(Role.NEXT_TOKEN, "int32", (B,))]
    if sampler is not None:
        shapes = sampler.shapes(B, spec.context)
        inputs += [af.TensorSig(r, af.SAMPLER_DTYPES.get(r, "int32"), shapes[r]) for r in af.SAMPLER_INPUTS]
        outputs += [af.TensorSig(r, af.SAMPLER_DTYPES.get(r, "int32"), shapes[r]) for r in af.SAMPLER_OUTPUTS]
    if spec.kind == af.EntryKind.PREFILL_SCORED:
        shapes = scorer.shapes(B, T)
        inputs += [af.TensorSig(r, "int32", shapes[r]) for r in af.SCORER_INPUTS]
        outputs += [af.TensorSig(r, af.SCORER_DTYPES.get(r, "int32"), shapes[r]) for r in af.SCORER_OUTPUTS]
    row_slots, adapters = lora_slots.signature(lora, B) if lora is not None else ([], [])
    inputs += row_slots
    donations = []
    for p in resolved.pools:
        donations.append((len(outputs), len(inputs)))
        inputs.append(af.TensorSig(Role.POOL_IN, p.dtype, p.shape, p.name, p.partition))
        outputs.append(af.TensorSig(Role.POOL_OUT, p.dtype, p.shape, p.name, p.partition))
    parts = weight_parts or {}
    inputs += [af.TensorSig(Role.WEIGHT, w.dtype.name, tuple(w.shape), slot, parts.get(slot, ()))
               for slot, w in weights.items()]
    return inputs + adapters, outputs, tuple(donations)


def _entry_fn(step: Callable, treedef, inputs: list[af.TensorSig], outputs: list[af.TensorSig], ring_pages: int):
    """The entry's function over its positional arguments, in signature order (a scoring prefill, one that takes
    SCORE_TARGETS, runs the SplitStep's hidden states and head itself)."""
    def entry(*args):
        groups, pools, leaves, sampler, targets, lora = {}, {}, [], {}, None, {}
        for sig, a in zip(inputs, args):
            if sig.role in af.LORA_INPUTS or sig.role in af.LORA_ADAPTERS:
                lora[(sig.role, sig.slot)] = a
            elif sig.role in af.STEP_FIELDS:
                groups.setdefault(sig.slot, {})[af.STEP_FIELDS[sig.role]] = a
            elif sig.role in af.SAMPLER_INPUTS:
                sampler[sig.role] = a
            elif sig.role == Role.SCORE_TARGETS:
                targets = a
            elif sig.role == Role.POOL_IN:
                pools[sig.slot] = a
            else:
                leaves.append(a)
        if ring_pages:
            # The step sees a sequence's ring, not the bucket-wide table the runtime fills.
            for fields in groups.values():
                fields["window_block_tables"] = fields["window_block_tables"][:, :ring_pages]
        weights = jax.tree_util.tree_unflatten(treedef, leaves)
        fields = groups[""]
        adapted = lora_slots.step_fields(lora)
        step_inputs = StepInputs(**fields, **adapted)
        if af.CHUNK_GROUP in groups:        # a mixed entry: the decode rows' inputs, then the chunk's
            chunk = dict(adapted)
            if adapted:                     # LORA_SLOTS holds the decode rows', then the chunk's
                rows = fields["token_ids"].shape[0]
                step_inputs = step_inputs._replace(lora_slots=adapted["lora_slots"][:rows])
                chunk["lora_slots"] = adapted["lora_slots"][rows:]
            step_inputs = (step_inputs, StepInputs(**groups[af.CHUNK_GROUP], **chunk))
            fields = {"seq_lens": jnp.concatenate([fields["seq_lens"], groups[af.CHUNK_GROUP]["seq_lens"]])}
        hidden_out = any(o.role == Role.HIDDEN_STATES for o in outputs)      # an MTP head's (_mtp_entries.py)
        if targets is not None or hidden_out:
            result = step.hidden(weights, pools, step_inputs)
            if not (isinstance(result, tuple) and len(result) == 2) or getattr(result[0], "ndim", 0) != 3:
                raise ExportError("a SplitStep's hidden function must return (hidden [B, T, E], pools)")
            hidden = result[0]
            result = (step.head(weights, hidden[:, -1]), result[1])
        else:
            result = step(weights, pools, step_inputs)
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
                   (Role.NEXT_TOKEN, ""): sampling_kernel.first_max(logits)}
        if sampler:
            # The sampler runs on every entry, after the step: the host pulls a token per row (and its logprobs),
            # never the logits, whatever the row's sampling parameters.
            top_n = next(o.shape[1] for o in outputs if o.role == Role.TOP_LOGPROBS)
            chosen = sampling_kernel.sample_tokens(logits, *(sampler[r] for r in af.SAMPLER_INPUTS),
                                                   fields["seq_lens"], top_n=top_n)
            results.update({(role, ""): value for role, value in zip(af.SAMPLER_OUTPUTS, chosen)})
        if targets is not None:
            top_n = next(o.shape[2] for o in outputs if o.role == Role.PROMPT_TOP_LOGPROBS)
            scores = scoring_kernel.score_positions(hidden, targets, lambda x: step.head(weights, x), top_n=top_n)
            results.update({(role, ""): value for role, value in zip(af.SCORER_OUTPUTS, scores)})
        if hidden_out:
            results[(Role.HIDDEN_STATES, "")] = hidden.astype(jnp.float32)
        results.update({(Role.POOL_OUT, name): buf for name, buf in new_pools.items()})
        return tuple(results[(o.role, o.slot)] for o in outputs)
    return entry


def _avals(sigs: Sequence[af.TensorSig]):
    return [jax.ShapeDtypeStruct(s.shape, jnp.dtype(af.numpy_dtype(s.dtype))) for s in sigs]


def _vocab(step: Callable, treedef, spec: EntrySpec, resolved: _ResolvedPools, block_size: int,
           weights: Mapping[str, np.ndarray], mesh=None, weight_parts=None) -> int:
    """The vocabulary: the last axis of the step's logits, read off an abstract evaluation of one entry (on the
    mesh, when there is one)."""
    inputs, outputs, _ = entry_signature(spec, resolved, block_size, 1, weights, weight_parts=weight_parts)
    fn, avals = _entry_fn(step, treedef, inputs, outputs, resolved.ring_pages), _avals(inputs)
    if mesh is not None:
        fn, avals, _ = sharded(fn, inputs, outputs, mesh)
    shape = jax.eval_shape(fn, *avals)[0].shape
    if len(shape) != 2 or shape[0] != spec.batch:
        raise ExportError(f"the step function returned logits of shape {list(shape)}; expected [B, V] with "
                          f"B = {spec.batch}")
    return int(shape[1])


def export_entry(step: Callable, treedef, spec: EntrySpec, inputs, outputs, donations, *, ring_pages: int,
                 platform: str, block_size: int = 0, mesh=None, state_pools: Sequence[af.Pool] = ()
                 ) -> tuple[jax_export.Exported, set[str]]:
    """jax.export one entry with its pools donated; checks the body against its signature. -> (the export, the
    custom-call targets its body holds). mesh: the AbstractMesh the entry runs on (under shard_map, each argument
    split as its signature's partition says); None: one device. state_pools: the state pools (a verify entry keeps
    their state after each row's last accepted draft).

    jax.export drops arguments the function never reads. A weight or pool dropped that way is a mistake and
    is refused (check_body); a step input the model has no use for (a recurrent model needs no SEQ_LENS)
    is kept in the body instead, so that every entry takes what its pools' kinds say."""
    if spec.kind == af.EntryKind.DECODE_STEPS:
        fn = decode_steps_fn(step, treedef, inputs, outputs, steps=spec.steps, block_size=block_size,
                             ring_pages=ring_pages)
    elif spec.kind == af.EntryKind.MTP:
        fn = mtp_fn(step, treedef, inputs, outputs)
    elif spec.kind == af.EntryKind.VERIFY:
        fn = verify_fn(step, treedef, inputs, outputs, ring_pages=ring_pages, state_pools=state_pools)
    else:
        fn = _entry_fn(step, treedef, inputs, outputs, ring_pages)
    avals, out_shardings = _avals(inputs), None
    if mesh is not None:
        fn, avals, out_shardings = sharded(fn, inputs, outputs, mesh)

    def export(keep_unused: bool) -> jax_export.Exported:
        return export_fn(fn, avals, platform=platform, donate=tuple(i for _, i in donations),
                         keep_unused=keep_unused, out_shardings=out_shardings)

    exp = export(keep_unused=False)
    dropped = set(range(len(inputs))) - set(exp.module_kept_var_idx)
    if dropped and all(inputs[i].role in af.STEP_FIELDS for i in dropped):
        exp = export(keep_unused=True)
    return exp, check_body(spec.name, exp, inputs, outputs, donations, platform, mesh_size(mesh))


def stage(step: Callable, weights: Any, pools: Mapping[str, PoolSpec], out_dir, *, ladders: Ladders = Ladders(),
          capacity: Capacity = Capacity(), features: Features = Features(), model: ModelInfo = ModelInfo(),
          platform: str = "cpu", progress: bool = True, mesh=None,
          weight_split_axes: Mapping[str, int | None] | None = None, mlir: bool = False,
          exported: bool = False, lora: lora_slots.Lora | None = None, mtp: MtpStage | None = None) -> af.Manifest:
    """Write the serving artifact of `step` to `out_dir` (empty or absent) and return its manifest.

    step(weights, pools, inputs) -> (logits [B, V], pools): one call, traced once per entry; it must return
        every pool it was given, same shape and dtype (written in place: the pools are donated). A SplitStep
        gives it as its hidden states and its head, which prompt scoring needs.
    weights: a pytree of arrays (a dict of named arrays, or a flax.nnx State); `step` gets the same structure.
    pools: {name: PagedKV | RingKV | StateSlots}.
    ladders: the entries' batches, contexts and prefill calls; capacity: the block size and the pools' sizes;
        features: the sampler, prompt scoring, decode steps; model: what the manifest says of the model
        (export/_options.py documents each field).
    platform: "cpu" or "cuda", lowered without the device.
    mesh: N (or a 1-D jax Mesh / AbstractMesh) stages every entry for N devices (tensor parallelism,
        docs/multi-device.md): `step` runs under jax.shard_map on each device's shards and all-reduces where its
        shards meet (lax.psum over the mesh axis). weight_split_axes: {slot: the axis of that weight split over
        the devices, or None}; unlisted weights are whole on every device. KV pools split over their KV heads,
        state pools over their `shard_axis`. None: one device.
    mlir, exported: also write each body's textual StableHLO (`.mlir`, for reading and debugging) and jax's
        serialization (`.exported`, for jax callers: jax.export.deserialize re-traces or runs it); the manifest
        lists them, the runtime needs neither (it compiles the `.mlirbc`).
    lora: adapter slots (tlaloc_jax.lora.Lora) every entry takes, on one device: the step gets each row's slot
        and the adapter buffers in its StepInputs (lora_slots, adapters); None: none.
    mtp: an MTP head staged as mtp entries, the decoder's entries returning the hidden states it reads
        (export/_mtp_entries.py).
    The export needs no accelerator and loads no PJRT plugin; the same inputs give the same bytes.
    """
    opts = Options(ladders, capacity, features, model)
    files = {"mlir": mlir, "exported": exported}
    if platform not in af.PLATFORMS:
        raise ExportError(f"platform {platform!r}: bodies are lowered for {' or '.join(af.PLATFORMS)}")
    if sys.byteorder != "little":
        raise ExportError("weight files are raw little-endian; exporting from a big-endian host is not supported")
    buckets, specs = _plan_entries(opts, step)
    if mtp is not None and (mesh is not None or lora is not None):
        raise ExportError("an MTP head is staged for one device without lora adapters: drop the mesh or the lora")
    specs += mtp_specs(specs) if mtp is not None else []
    mtp_flat, mtp_tree = flatten_weights(mtp.weights) if mtp is not None else ({}, None)
    if lora is not None and mesh is not None:
        raise ExportError("lora adapters are staged for one device; drop the mesh (tensor_parallel) or the lora")
    if lora is not None and opts.features.speculative_tokens:
        raise ExportError("lora adapters with speculative_tokens: verify entries that take adapter slots are not built "
                          "yet; stage one of them (--max-loras or --speculative-tokens)")
    lora_record = lora.record() if lora is not None else None
    block_size, info = opts.capacity.block_size, opts.model
    flat, treedef = flatten_weights(weights)
    mesh = abstract_mesh(mesh)
    unknown = sorted(set(weight_split_axes or {}) - set(flat))
    if unknown:
        raise ExportError(f"weight_split_axes names {', '.join(unknown)}, which are not weights")
    weight_parts = {slot: partition_of(w.ndim, (weight_split_axes or {}).get(slot), mesh) for slot, w in flat.items()}
    if info.embedding_slot and info.embedding_slot not in flat:
        raise ExportError(f"embedding_slot {info.embedding_slot!r} is not a weight (weights: {', '.join(flat)})")
    resolved = _resolve_pools(pools, opts.capacity, contexts=buckets.context_ladder,
                              max_batch=buckets.batch_ladder[-1], chunk=buckets.prefill_chunk)
    if mesh is not None:
        resolved = dataclasses.replace(resolved, pools=tuple(
            dataclasses.replace(p, partition=partition_of(len(p.shape), pool_split_axis(pools[p.name]), mesh))
            for p in resolved.pools))
    state = tuple(p for p in resolved.pools if p.kind == af.PoolKind.STATE_SLOTS)
    if opts.features.speculative_tokens and state and not getattr(step, "state_positions", False):
        raise ExportError(f"speculative_tokens {opts.features.speculative_tokens}: pools "
                          f"{', '.join(p.name for p in state)} are state pools (Mamba, gated delta), and a verify call "
                          "keeps the state after the last accepted draft only from a step that writes the state after "
                          "every token: give SplitStep(..., state_positions=True) (tlaloc_jax.pools.per_position), or "
                          "export without speculative_tokens (--speculative-tokens)")
    vocab = _vocab(step, treedef, specs[0], resolved, block_size, flat, mesh, weight_parts)
    sampler = opts.features.sampler.shape(vocab) if opts.features.sampler is not None else None
    n_scored = opts.features.prompt_logprobs
    scorer = af.ScorerShape(top_logprobs=min(n_scored, vocab)) if n_scored is not None else None
    if info.embedding_slot and flat[info.embedding_slot].shape[:1] != (vocab,):
        raise ExportError(f"embedding {info.embedding_slot!r} has {flat[info.embedding_slot].shape[0]} rows, the "
                          f"logits {vocab} entries")

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"output directory {str(out)!r} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    entries, calling_convention, native_calls = [], 0, set()
    bar = progress_bar(len(specs) + len({**flat, **mtp_flat}), "export", progress)
    for spec in specs:
        bar.set_postfix_str(spec.name)
        verify = spec.kind == af.EntryKind.VERIFY
        inputs, outputs, donations = entry_signature(spec, resolved, block_size, vocab, flat, sampler, scorer,
                                                     weight_parts, lora_record)
        if spec.kind == af.EntryKind.DECODE_STEPS:
            inputs, outputs, donations = decode_steps_signature(inputs, outputs, batch=spec.batch, steps=spec.steps)
        if verify:
            top_n = min(sampler.top_logprobs if sampler is not None else VERIFY_TOP_LOGPROBS, vocab)
            inputs, outputs, donations = verify_signature(inputs, batch=spec.batch, tokens=spec.tokens_per_seq,
                                                          top_n=top_n)
        head = spec.kind == af.EntryKind.MTP
        if head:
            inputs, outputs, donations = mtp_signature(*entry_signature(spec, resolved, block_size, vocab, mtp_flat),
                                                       batch=spec.batch, tokens=spec.tokens_per_seq, width=mtp.width)
        elif mtp is not None and returns_hidden(spec):
            inputs, outputs, donations = with_hidden_output(inputs, outputs, donations, batch=spec.batch,
                                                            tokens=spec.tokens_per_seq, width=mtp.width)
        with timed("entries"):
            exp, targets = export_entry(mtp if head else step, mtp_tree if head else treedef, spec, inputs, outputs,
                                        donations, ring_pages=resolved.ring_pages, platform=platform,
                                        block_size=block_size, mesh=mesh, state_pools=state)
        calling_convention = int(exp.calling_convention_version)
        native_calls |= targets & set(native.KERNELS)
        entry = af.Entry(name=spec.name, kind=af.EntryKind(spec.kind), batch=spec.batch, context=spec.context,
                         tokens_per_seq=spec.tokens_per_seq, **dataclasses.asdict(write_body(out, exp, **files)),
                         inputs=tuple(inputs), outputs=tuple(outputs), donations=donations,
                         kept_inputs=tuple(exp.module_kept_var_idx), steps=spec.steps)
        entries.append(entry)
        bar.update()

    if any(p.kind == af.PoolKind.STATE_SLOTS for p in resolved.pools):
        entries.append(copy_slots_entry(out, resolved.pools, buckets.batch_ladder[-1], platform, mesh, files))
    files = write_weights(out, {**flat, **mtp_flat}, bar, quant_records(weights), weight_parts, mesh_size(mesh))
    bar.close()
    dtypes = sorted({w.dtype.name for w in flat.values()})
    m = af.Manifest(
        schema=af.SCHEMA_V5, block_size=block_size, pools=resolved.pools,
        model=af.ModelShape(name=info.name, model_type=info.model_type, vocab=vocab,
                            weight_dtype=info.weight_dtype or (dtypes[0] if len(dtypes) == 1 else "mixed"),
                            kv_dtype=info.kv_dtype or resolved.pools[0].dtype,
                            eos_token_ids=tuple(int(t) for t in info.eos_token_ids),
                            embedding_slot=info.embedding_slot, layers=info.layers, heads=info.heads,
                            kv_heads=info.kv_heads, head_dim=info.head_dim, hidden=info.hidden),
        buckets=buckets, entries=tuple(entries), weights=files,
        versions=af.Versions(jax=jax.__version__, jaxlib=jaxlib.__version__, calling_convention=calling_convention,
                             platform=platform, attention_block=info.attention_block,
                             custom_calls=tuple(sorted(native_calls))),
        refused_tokens=tuple(af.RefusedToken(int(t), k) for t, k in info.refused_tokens),
        tokenizer_files=copy_tokenizer(out, info.tokenizer_dir), sampler=sampler, scorer=scorer,
        mesh=af.Mesh((af.MeshAxis(mesh.axis_names[0], mesh_size(mesh)),)) if mesh is not None else None,
        lora=lora_record,
    )
    (out / af.MANIFEST_NAME).write_text(m.to_json())
    return af.load_manifest(out)


def _plan_entries(opts: Options, step: Callable) -> tuple[af.Buckets, list[EntrySpec]]:
    """The ladders checked against the block size, and every entry they and the features give."""
    block_size, features = opts.capacity.block_size, opts.features
    batches = sorted_ladder(opts.ladders.batch, "batch ladder")
    contexts = sorted_ladder(opts.ladders.context, "context ladder")
    if block_size <= 0:
        raise ExportError(f"block size must be positive, got {block_size}")
    for c in contexts:
        if c % block_size:
            raise ExportError(f"context {c} is not a multiple of the block size {block_size}")
    prefill_max_batch = (min(batches[-1], max(batches[0], DEFAULT_PREFILL_MAX_BATCH))
                         if opts.ladders.prefill_max_batch is None else int(opts.ladders.prefill_max_batch))
    if prefill_max_batch < batches[0]:
        raise ExportError(f"prefill_max_batch {prefill_max_batch} is below the smallest batch {batches[0]}: "
                          "no prefill entry would be written")
    chunk = int(opts.ladders.prefill_chunk or 0)
    if chunk < 0:
        raise ExportError(f"prefill chunk must be positive, got {chunk}")
    long = int(opts.ladders.prefill_long_chunk or 0)
    if long < 0:
        raise ExportError(f"prefill long chunk must be positive or 0 (none), got {long}")
    if features.flat and (features.mixed or features.decode_steps != 1):
        raise ExportError("flat entries run every call as a packed prefill: they take no mixed or decode_steps "
                          "entries (leave Features.mixed False and decode_steps 1, or drop flat)")
    specs = plan_entries(batches, contexts, prefill_max_batch, chunk, mixed=features.mixed, prefill_long_chunk=long,
                         packed=features.packed, flat=features.flat)
    if features.decode_top_context:
        # Their work does not depend on the bucket: one point per batch, at the top (Features.decode_top_context).
        specs = [s for s in specs if s.kind != af.EntryKind.DECODE or s.context == contexts[-1]]
    steps = features.decode_steps
    if not isinstance(steps, int) or steps < 1:
        raise ExportError(f"decode_steps must be a positive integer, got {steps!r}")
    if steps > 1:
        specs += [EntrySpec(af.EntryKind.DECODE_STEPS, s.batch, s.context, 1, steps) for s in specs
                  if s.kind == af.EntryKind.DECODE]
    if features.prompt_logprobs is not None:
        n = features.prompt_logprobs
        if not isinstance(n, int) or n < 0:
            raise ExportError(f"prompt_logprobs must be None or an integer >= 0, got {n!r}")
        if not isinstance(step, SplitStep):
            raise ExportError("prompt_logprobs scores every position with the model's head: give the step as "
                              "SplitStep(hidden, head) (tlaloc_jax.SplitStep)")
        # Scoring reads every position of its rows: the unpacked prefill entries' points.
        specs += [dataclasses.replace(s, kind=af.EntryKind.PREFILL_SCORED)
                  for s in plan_entries(batches, contexts, prefill_max_batch, chunk, prefill_long_chunk=long)
                  if s.kind == af.EntryKind.PREFILL]
    k = features.speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ExportError(f"speculative_tokens must be an integer >= 0, got {k!r}")
    if k:
        if not isinstance(step, SplitStep):
            raise ExportError("speculative_tokens scores every drafted position with the model's head: give the step "
                              "as SplitStep(hidden, head) (tlaloc_jax.SplitStep)")
        if k + 1 > contexts[0]:
            raise ExportError(f"speculative_tokens {k}: a verify row of {k + 1} tokens does not fit the smallest "
                              f"context {contexts[0]}")
        # A verify entry per decode point: every running sequence's last token and its drafts, in one call.
        specs += [EntrySpec(af.EntryKind.VERIFY, b, c, k + 1) for c in contexts for b in batches
                  if not features.decode_top_context or c == contexts[-1]]
    buckets = af.Buckets(batch_ladder=batches, context_ladder=contexts, prefill_max_batch=prefill_max_batch,
                         prefill_chunk=chunk)
    return buckets, specs
