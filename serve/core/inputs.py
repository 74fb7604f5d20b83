"""A scheduled call's inputs by role: the rows' integer step inputs, the in-body sampler's rows, a scoring
prefill's targets and a decode_steps call's limits and stop ids (numpy only)."""

from __future__ import annotations

import numpy as np

from tlaloc_jax import artifact as af
from .paging import RowCall, build_step_inputs, pack_step_inputs

from ..host_sampling import seed_words
from ..runtime.runner import Runner
from .scheduler import ScheduledCall


def step_inputs(call: ScheduledCall, m: af.Manifest, ring_pages: int) -> dict[str, np.ndarray]:
    """The rows' token ids, positions, block tables, slots (and ring tables, state slots) for `call`'s entry; a
    mixed entry's decode rows under their field names and its prompt chunk's under "chunk.<field>"; a packed
    prefill's per-token fields flat, with its pack_index."""
    e = call.entry
    kw = dict(width=e.context // m.block_size, block_size=m.block_size, ring_pages=ring_pages,
              state_slots=af.PoolKind.STATE_SLOTS in m.pool_kinds)
    if e.kind == af.EntryKind.MIXED:
        out = build_step_inputs(call.rows[:-1], batch=e.batch, tokens=1, **kw)
        chunk = build_step_inputs(call.rows[-1:], batch=1, tokens=e.tokens_per_seq, **kw)
        out.update({f"{af.CHUNK_GROUP}.{k}": v for k, v in chunk.items()})
    else:
        tokens = 1 if e.kind == af.EntryKind.DECODE_STEPS else e.tokens_per_seq
        out = build_step_inputs(call.rows, batch=e.batch, tokens=tokens, **kw)
        out = pack_step_inputs(out, e.packed_tokens) if e.packed_tokens else out
    if m.lora is not None:
        # Each row's adapter slot (0: none, padding rows too), in the rows of the outputs.
        slots = np.zeros(e.rows, np.int32)
        for b, s in zip(call.out_rows, call.seqs):
            slots[b] = s.lora_slot
        out[af.Role.LORA_SLOTS] = slots
    return out


def takes_sampler(e: af.Entry) -> bool:
    """Whether the entry takes the sampler's inputs: every entry of an artifact with a sampler but a verify entry
    staged before verify entries sampled (greedy acceptance only)."""
    return any(sig.role == af.Role.SAMPLING for sig in e.inputs)


def sampler_inputs(runner: Runner, call: ScheduledCall, producing: list[bool], allowed: list) -> dict:
    """The sampler's inputs of a call, by role: a host array, or a device buffer of neutral rows kept for the
    entry when no row of the call needs that input (nothing is uploaded for it)."""
    sp, e = runner.manifest.sampler, call.entry
    B, C = e.rows, e.context
    seqs = call.seqs
    at = call.out_rows
    out: dict = {}
    neutral = np.array([af.SAMPLING_NEUTRAL[c] for c in sp.columns], np.float32)
    params = np.array([neutral] * B, np.float32)
    seeds = np.zeros((B, 2), np.int32)
    steps = np.zeros(B, np.int32)
    for b, s, p in zip(at, seqs, producing):
        if p:
            params[b] = s.sampling.row(sp.columns)
            seeds[b] = seed_words(s.seed)
            steps[b] = len(s.generated)
    out[af.Role.SAMPLING], out[af.Role.RNG_SEED], out[af.Role.RNG_STEP] = params, seeds, steps
    if not params[:, sp.columns.index("temperature")].any():
        # No row draws: no row reads its seed (a greedy row is argmax of the processed logits).
        del out[af.Role.RNG_SEED]
        if (params == neutral).all():
            # Nor its counter, which presence and frequency penalties also read (the generated tokens are the
            # history's last `step`): only when no row is penalised.
            del out[af.Role.RNG_STEP], out[af.Role.SAMPLING]
    if any(a is not None for a in allowed):
        # [B, W], or a verify entry's [B, T, W]: a row's one mask, or its masks at its last positions (right-aligned).
        mask = np.full(e.inputs[e.input_index(af.Role.TOKEN_MASK)].shape, -1, np.int32)
        for b, a in zip(at, allowed):
            if a is not None and a.ndim == 2:
                mask[b, mask.shape[1] - len(a):] = a
            elif a is not None:
                mask[b] = a
        out[af.Role.TOKEN_MASK] = mask
    if any(p and s.sampling.logit_bias for s, p in zip(seqs, producing)):
        ids = np.full((B, sp.logit_bias), -1, np.int32)
        vals = np.zeros((B, sp.logit_bias), np.float32)
        for b, s, p in zip(at, seqs, producing):
            if p and s.sampling.logit_bias:
                pairs = s.sampling.logit_bias
                ids[b, :len(pairs)] = [t for t, _ in pairs]
                vals[b, :len(pairs)] = [v for _, v in pairs]
        out[af.Role.LOGIT_BIAS_IDS], out[af.Role.LOGIT_BIAS] = ids, vals
    if any(p and s.sampling.penalized for s, p in zip(seqs, producing)):
        history = np.full((B, C), -1, np.int32)
        for b, s, row, p in zip(at, seqs, call.rows, producing):
            if p:
                # The row's own tokens end it: a verify row's drafts follow the sequence's tokens before it.
                tokens = (s.prompt + s.generated)[:row.start] + list(row.token_ids)
                history[b, :len(tokens)] = tokens
        out[af.Role.TOKEN_HISTORY] = history
    for role in af.SAMPLER_INPUTS:
        if role not in out:
            out[role] = runner.neutral_buffer(e, role)
    return out


def score_targets(call: ScheduledCall, batch: int, tokens: int) -> np.ndarray:
    """SCORE_TARGETS [B, T] of a scoring prefill: each position's next prompt token, right-aligned as the rows'
    tokens are (paging.build_step_inputs); -1 where there is none (padding, the prompt's last token)."""
    targets = np.full((batch, tokens), -1, np.int32)
    for b, (s, row) in enumerate(zip(call.seqs, call.rows)):
        n = len(row.token_ids)
        nxt = s.prompt[row.start + 1:row.start + n + 1]
        targets[b, tokens - n:tokens - n + len(nxt)] = nxt
    return targets


def decode_steps_inputs(call: ScheduledCall, stop_ids: list[list[int]]) -> dict:
    """STEP_LIMIT [B] (the most tokens each row may produce) and STOP_IDS [B, S] (-1 padded) of a decode_steps call."""
    e = call.entry
    limit = np.zeros(e.batch, np.int32)
    limit[:len(call.limits)] = call.limits
    stop = np.full(e.inputs[e.input_index(af.Role.STOP_IDS)].shape, -1, np.int32)
    for b, ids in enumerate(stop_ids):
        stop[b, :len(ids)] = ids
    return {af.Role.STEP_LIMIT: limit, af.Role.STOP_IDS: stop}


def empty_call_inputs(e: af.Entry, runner: Runner, ring_pages: int) -> dict:
    """The inputs of a call of `e` whose rows are all empty, as a call's padding rows are (no token, no slot: the
    call writes nothing): what a warm-up run takes."""
    if e.kind == af.EntryKind.COPY_SLOTS:
        none = np.full(e.batch, -1, np.int32)
        return {af.Role.COPY_SRC: none, af.Role.COPY_DST: none}
    call = ScheduledCall(e, (), ())
    return _with_rowless_roles(call, runner, step_inputs(call, runner.manifest, ring_pages))


def _with_rowless_roles(call: ScheduledCall, runner: Runner, out: dict) -> dict:
    """`out` (a call's step inputs) with the other roles of a call that produces for no sequence: neutral sampler
    rows, no score targets, no decode_steps limits."""
    e = call.entry
    if takes_sampler(e):
        out.update(sampler_inputs(runner, call, [], []))
    if e.kind == af.EntryKind.PREFILL_SCORED:
        out[af.Role.SCORE_TARGETS] = score_targets(call, e.batch, e.tokens_per_seq)
    if e.kind == af.EntryKind.DECODE_STEPS:
        out.update(decode_steps_inputs(call, []))
    for sig in e.inputs:
        if sig.role == af.Role.HIDDEN_STATES:     # an mtp entry's (serve/mtp_proposer.py)
            out[sig.role] = np.zeros(sig.shape, np.float32)
    return out


# The positions a warm-up row reads: three pages of 16, so that a decode call folds two key blocks and scores a
# page every row shares, as a cached prefix is scored (tlaloc_jax/kernels/paged_attention._decode_cpu).
WARM_UP_KEYS = 48


def warm_up_inputs(e: af.Entry, runner: Runner, ring_pages: int) -> dict:
    """A warm-up call's inputs: every row reads a few pages (the first one shared by all rows) and writes nothing (no
    slot, no state slot), so that the body's loops over keys run as a request's would; an executable's first run of
    a loop body pays one-time costs that a run of empty rows, whose loops run no iteration, leaves to the first
    request. decode_steps and copy_slots entries, which write where no slot input says, get every row empty."""
    if e.kind in (af.EntryKind.DECODE_STEPS, af.EntryKind.COPY_SLOTS):
        return empty_call_inputs(e, runner, ring_pages)
    m = runner.manifest
    chunk = e.tokens_per_seq
    if e.kind == af.EntryKind.DECODE:
        counts = [1] * e.batch
    elif e.kind == af.EntryKind.MIXED:
        counts = [1] * e.batch + [chunk]
    elif e.packed_tokens:         # the rows' tokens side by side: at most packed_tokens in all
        n = max(1, min(chunk, e.packed_tokens // e.batch))
        counts = [n] * min(e.batch, e.packed_tokens // n)
    else:
        counts = [chunk] * e.batch
    width = e.context // m.block_size
    kv = m.capacity(af.PoolKind.PAGED_KV) if af.PoolKind.PAGED_KV in m.pool_kinds else 0
    ring = m.capacity(af.PoolKind.RING_KV) if ring_pages else 0
    rows = []
    for b, n in enumerate(counts):
        end = min(e.context, max(n, WARM_UP_KEYS))
        pages = [0] + [(1 + b * width + j) % kv for j in range(1, width)] if kv else None
        rows.append(RowCall([0] * n, end - n, pages, [(b * ring_pages + j) % ring for j in range(ring_pages)],
                            state_slot=0))
    call = ScheduledCall(e, (), tuple(rows))
    out = step_inputs(call, m, ring_pages)
    for name, value in out.items():
        if name.endswith(("slot_mapping", "state_slots")):
            value[...] = -1                 # nothing written: every KV write and state write is dropped
    return _with_rowless_roles(call, runner, out)
