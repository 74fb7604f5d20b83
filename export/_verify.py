"""verify entries: speculative decoding's check of drafted tokens (manifest EntryKind.VERIFY).

A row of a verify call is a sequence's last token followed by up to K drafted tokens, right-aligned as a prefill's
row, at positions [start, start + n): the body runs the step's hidden states over every token (writing each one's
keys and values, as a prefill chunk does) and the head over every position, so one call scores what K + 1 decode
steps would. It returns per row VERIFY_ACCEPTED, the drafts it keeps, and per position t VERIFY_TOKENS, the token
the row emits after t when it stops accepting there, that position's emitted token's logprob and the N largest
logprobs. The host emits the accepted drafts and then VERIFY_TOKENS[start of row + accepted]. The keys and values
written for rejected drafts are never read: the sequence's next call writes those positions again.

An artifact with a sampler gives its verify entries the sampler's inputs, TOKEN_MASK one per position (position t's
mask is the grammar's after the row's drafts through t), and acceptance is kernels/rejection_sampler.py's: greedy
rows keep the drafts the argmax of their processed logits confirms, sampled rows rejection-sample, keeping the target distribution exactly. Without a sampler a verify entry is greedy only:
draft t + 1 is accepted while the first largest logit after t equals it, the longest such prefix.

A verify entry needs the step as a SplitStep (its hidden states and head). State pools (Mamba, gated delta) cannot
leave a rejected draft's update unused as pages can: the body gives the step a buffer per state pool
(tlaloc_jax.pools.per_position) where it writes each row's state after each of its tokens
(SplitStep.state_positions), and once it has counted the accepted drafts it writes the state after the row's last
accepted token into the row's slot, in the body: nothing goes to the host, and the sequence's next call starts from
the state the accepted tokens leave.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from tlaloc_jax import artifact as af
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import in_body_sampler as sampling_kernel
from tlaloc_jax.kernels import rejection_sampler
from tlaloc_jax.kernels.projection_native import native_projections
from tlaloc_jax.pools import per_position

from ._entries import ExportError

Role = af.Role


def verify_signature(inputs: Sequence[af.TensorSig], *, batch: int, tokens: int, top_n: int
                     ) -> tuple[list[af.TensorSig], list[af.TensorSig], tuple[tuple[int, int], ...]]:
    """A prefill entry's signature without scorer (export/_stage.entry_signature) -> the verify entry's: the same
    inputs (the sampler's among them, when the artifact has one) but a TOKEN_MASK per position [B, T, W] (a grammar's
    mask changes with each drafted token), the VERIFY_* outputs [B, T] ([B] accepted, [B, T, N] top) and the pools."""
    inputs = [af.TensorSig(s.role, s.dtype, (batch, tokens, *s.shape[1:]), s.slot,
                           (s.partition[0], None, *s.partition[1:]) if s.partition else ())
              if s.role == Role.TOKEN_MASK else s for s in inputs]
    shapes = {Role.VERIFY_TOKENS: (batch, tokens), Role.VERIFY_ACCEPTED: (batch,), Role.VERIFY_LOGPROB: (batch, tokens),
              Role.VERIFY_TOP_LOGPROBS: (batch, tokens, top_n), Role.VERIFY_TOP_IDS: (batch, tokens, top_n)}
    outputs = [af.TensorSig(r, af.VERIFY_DTYPES.get(r, "int32"), shapes[r]) for r in af.VERIFY_OUTPUTS]
    donations = []
    for i, sig in enumerate(inputs):
        if sig.role == Role.POOL_IN:
            donations.append((len(outputs), i))
            outputs.append(af.TensorSig(Role.POOL_OUT, sig.dtype, sig.shape, sig.slot, sig.partition))
    return list(inputs), outputs, tuple(donations)


def accepted_drafts(greedy: jax.Array, token_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """greedy, token_ids, positions [B, T] (rows right-aligned, position -1 before a row's tokens) -> [B] int32: how
    many drafts (a row's tokens after its first) match greedy[t] == token_ids[t + 1] from the row's start on."""
    # Column t tests the draft after it; accepted_prefix never reads the last column (the roll's wrapped one).
    return rejection_sampler.accepted_prefix(greedy == jnp.roll(token_ids, -1, axis=1), positions)


def accepted_index(positions: jax.Array, accepted: jax.Array) -> jax.Array:
    """positions [B, T] (rows right-aligned), accepted [B] -> [B] int32: the column of each row's last accepted token
    (its last token, then its accepted drafts), whose state the row keeps; an empty row's is clipped to T - 1."""
    return jnp.minimum(jnp.sum(positions < 0, axis=1) + accepted, positions.shape[1] - 1).astype(jnp.int32)


def per_position_buffers(pools: dict, state_pools: Sequence[af.Pool], batch: int, tokens: int) -> dict:
    """Zeroed per_position buffers of the state pools: each pool's shape with its slot axis replaced by [B, T]."""
    return {per_position(p.name): jnp.zeros(pools[p.name].shape[:p.slot_axis] + (batch, tokens)
                                            + pools[p.name].shape[p.slot_axis + 1:], pools[p.name].dtype)
            for p in state_pools}


def keep_accepted_states(pools: dict, state_pools: Sequence[af.Pool], slots: jax.Array, index: jax.Array) -> dict:
    """The step's pools with each state pool's per_position buffer taken out and each row's state at column index[b]
    written into its slot (slots [B]; -1, an empty row, writes nothing)."""
    out = dict(pools)
    for p in state_pools:
        if per_position(p.name) not in out:
            raise ExportError(f"the step's hidden function dropped pool {per_position(p.name)!r}: with "
                              f"state_positions it returns it, the state of pool {p.name!r} after every token written")
        steps, pool, lead = out.pop(per_position(p.name)), out[p.name], (slice(None),) * p.slot_axis
        chosen = steps[lead + (jnp.arange(steps.shape[p.slot_axis]), index)]            # [.., B, *shape]
        slot = jnp.where(slots < 0, pool.shape[p.slot_axis], slots)
        out[p.name] = pool.at[lead + (slot,)].set(chosen.astype(pool.dtype), mode="drop")
    return out


def with_projections(fn: Callable, projections: str) -> Callable:
    """fn traced with the C projection kernel where it takes a projection's rows (projections "native"), as the
    decode entries' bodies are (tlaloc_jax.decoder.forward); with projections "xla", XLA's forms only."""
    def traced(*args, **kw):
        with native_projections(projections == "native"):
            return fn(*args, **kw)
    return traced


def verify_fn(step: Callable, treedef, inputs: Sequence[af.TensorSig], outputs: Sequence[af.TensorSig], *,
              ring_pages: int, state_pools: Sequence[af.Pool] = ()):
    """The verify entry's function over its positional arguments, in signature order. state_pools: the model's
    state pools, whose per-position states the step writes (SplitStep.state_positions) and the body keeps."""
    step = getattr(step, "verify", None) or step
    if not (hasattr(step, "hidden") and hasattr(step, "head")):
        raise ExportError("speculative_tokens scores every drafted position with the model's head: give the step as "
                          "SplitStep(hidden, head) (tlaloc_jax.SplitStep)")
    top_n = next(o.shape[2] for o in outputs if o.role == Role.VERIFY_TOP_IDS)

    def entry(*args):
        fields, pools, leaves, sampler = {}, {}, [], {}
        for sig, a in zip(inputs, args):
            if sig.role in af.STEP_FIELDS:
                fields[af.STEP_FIELDS[sig.role]] = a
            elif sig.role in af.SAMPLER_INPUTS:
                sampler[sig.role] = a
            elif sig.role == Role.POOL_IN:
                pools[sig.slot] = a
            else:
                leaves.append(a)
        if ring_pages:
            # The step sees a sequence's ring, not the bucket-wide table the runtime fills.
            fields["window_block_tables"] = fields["window_block_tables"][:, :ring_pages]
        weights = jax.tree_util.tree_unflatten(treedef, leaves)
        B, T = fields["token_ids"].shape
        result = step.hidden(weights, {**pools, **per_position_buffers(pools, state_pools, B, T)}, StepInputs(**fields))
        if not (isinstance(result, tuple) and len(result) == 2) or getattr(result[0], "ndim", 0) != 3:
            raise ExportError("a SplitStep's hidden function must return (hidden [B, T, E], pools)")
        hidden, new_pools = result
        B, T, E = hidden.shape
        logits = step.head(weights, hidden.reshape(B * T, E)).astype(jnp.float32)         # [B * T, V]
        if sampler:
            verified = rejection_sampler.verify_sample(
                logits.reshape(B, T, -1), fields["token_ids"], fields["positions"],
                *(sampler[r] for r in af.SAMPLER_INPUTS), top_n=top_n)
        else:
            greedy = sampling_kernel.first_max(logits)
            lsm = jax.nn.log_softmax(logits, axis=-1)
            chosen = jnp.take_along_axis(lsm, greedy[:, None], axis=1)[:, 0]
            vals, ids = sampling_kernel.top_logprobs(lsm, top_n)
            greedy = greedy.reshape(B, T)
            verified = (greedy, accepted_drafts(greedy, fields["token_ids"], fields["positions"]),
                        chosen.reshape(B, T), vals.reshape(B, T, top_n), ids.reshape(B, T, top_n))
        if state_pools:
            new_pools = keep_accepted_states(new_pools, state_pools, fields["state_slots"],
                                             accepted_index(fields["positions"], verified[1]))
        results = {(role, ""): value for role, value in zip(af.VERIFY_OUTPUTS, verified)}
        results[(Role.HIDDEN_STATES, "")] = hidden.reshape(B, T, E).astype(jnp.float32)    # read where an MTP head's is
        results.update({(Role.POOL_OUT, name): buf for name, buf in new_pools.items()})
        return tuple(results[(o.role, o.slot)] for o in outputs)
    return entry
