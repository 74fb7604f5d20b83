"""decode_steps entries: K decode steps of a staged step function in one call (manifest EntryKind.DECODE_STEPS).

The body runs the step function in a `lax.while_loop` of at most K iterations. Iteration i feeds each live row
the token iteration i - 1 chose (the first: the row's TOKEN_IDS), at position POSITIONS + i, writing its key and
value through the row's own block tables (the slot of position p is table[p // S] * S + p % S, as
tlaloc_jax.serve.core.paging.build_step_inputs computes it on the host), and chooses the next token as a decode entry
does: the argmax of the logits, or, with the sampler staged, tlaloc_jax/kernels/in_body_sampler.py's choice with the
random counter RNG_STEP + i, so that a seeded row draws what K single steps would. A row stops once it has produced
one of its STOP_IDS or STEP_LIMIT tokens; a stopped row is an empty row for the remaining iterations (no
position, nothing written, state slot -1), and the loop ends early when every row has stopped. The pools
are carried through the loop and donated, so XLA writes them in place as the steps go.

The host sees one call and one [B, K] array of tokens (-1 past a row's stop) per K tokens. What needs the host
between tokens (a grammar's mask, penalties over a growing history, logprobs, stop strings) is not done here:
the runtime keeps such requests on single decode steps.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from tlaloc_jax import artifact as af
from tlaloc_jax import lora as lora_slots
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import in_body_sampler as sampling_kernel

Role = af.Role

# NS: the stop ids a row may carry into a decode_steps call (its EOS ids and the request's stop_token_ids); a
# request with more keeps single steps.
STOP_SLOTS = 16


def decode_steps_signature(inputs: Sequence[af.TensorSig], outputs: Sequence[af.TensorSig], *, batch: int,
                           steps: int, stop_slots: int = STOP_SLOTS
                           ) -> tuple[list[af.TensorSig], list[af.TensorSig], tuple[tuple[int, int], ...]]:
    """A decode entry's signature (export/_stage.entry_signature) -> the decode_steps entry's: STEP_LIMIT and
    STOP_IDS after the sampler's inputs, STEP_TOKENS [B, K] and the pools as outputs (no logits)."""
    first_pool = next(i for i, s in enumerate(inputs) if s.role == Role.POOL_IN)
    new_inputs = list(inputs[:first_pool]) + [af.TensorSig(Role.STEP_LIMIT, "int32", (batch,)),
                                             af.TensorSig(Role.STOP_IDS, "int32", (batch, stop_slots))] \
        + list(inputs[first_pool:])
    new_outputs = [af.TensorSig(Role.STEP_TOKENS, "int32", (batch, steps))]
    donations = []
    for i, sig in enumerate(new_inputs):
        if sig.role == Role.POOL_IN:
            donations.append((len(new_outputs), i))
            new_outputs.append(af.TensorSig(Role.POOL_OUT, sig.dtype, sig.shape, sig.slot, sig.partition))
    return new_inputs, new_outputs, tuple(donations)


def _slots(tables, pos, alive, block_size: int, pages: int):
    """The slot of each row's position `pos` through its table [B, M] (entry (pos // S) % pages): -1 if not alive."""
    safe = jnp.maximum(pos, 0)
    page = jnp.take_along_axis(tables, ((safe // block_size) % pages)[:, None], axis=1)[:, 0]
    return jnp.where(alive, page * block_size + safe % block_size, -1)[:, None]


def decode_steps_fn(step: Callable, treedef, inputs: Sequence[af.TensorSig], outputs: Sequence[af.TensorSig], *,
                    steps: int, block_size: int, ring_pages: int):
    """The decode_steps entry's function over its positional arguments, in signature order."""
    def entry(*args):
        fields, pools, leaves, sampler, extra, lora = {}, {}, [], {}, {}, {}
        for sig, a in zip(inputs, args):
            if sig.role in af.LORA_INPUTS or sig.role in af.LORA_ADAPTERS:
                lora[(sig.role, sig.slot)] = a
            elif sig.role in af.STEP_FIELDS:
                fields[af.STEP_FIELDS[sig.role]] = a
            elif sig.role in af.SAMPLER_INPUTS:
                sampler[sig.role] = a
            elif sig.role in af.DECODE_STEPS_INPUTS:
                extra[sig.role] = a
            elif sig.role == Role.POOL_IN:
                pools[sig.slot] = a
            else:
                leaves.append(a)
        weights = jax.tree_util.tree_unflatten(treedef, leaves)
        limit, stop_ids = extra[Role.STEP_LIMIT], extra[Role.STOP_IDS]
        tok0, pos0 = fields["token_ids"][:, 0], fields["positions"][:, 0]
        B = tok0.shape[0]
        tables, wtables = fields.get("block_tables"), fields.get("window_block_tables")
        state_slots = fields.get("state_slots")
        names = list(pools)
        fields.update(lora_slots.step_fields(lora))

        def body(carry):
            i, tok, alive, out, pool_bufs = carry
            pos = pos0 + i
            f = dict(fields, token_ids=tok[:, None], positions=jnp.where(alive, pos, -1)[:, None],
                     seq_lens=jnp.where(alive, pos + 1, 0))
            if tables is not None:
                f["slot_mapping"] = _slots(tables, pos, alive, block_size, tables.shape[1])
            if wtables is not None:
                # The step sees a sequence's ring, not the bucket-wide table the runtime fills.
                f["window_slot_mapping"] = _slots(wtables, pos, alive, block_size, ring_pages)
                f["window_block_tables"] = wtables[:, :ring_pages]
            if state_slots is not None:
                f["state_slots"] = jnp.where(alive, state_slots, -1)
            logits, new_pools = step(weights, dict(zip(names, pool_bufs)), StepInputs(**f))
            logits = logits.astype(jnp.float32)
            if sampler:
                x = sampling_kernel.process_logits(logits, sampler[Role.SAMPLING], sampler[Role.TOKEN_MASK],
                                                   sampler[Role.LOGIT_BIAS_IDS], sampler[Role.LOGIT_BIAS],
                                                   sampler[Role.TOKEN_HISTORY], f["seq_lens"],
                                                   sampler[Role.RNG_STEP] + i)
                nxt = sampling_kernel.choose(x, sampler[Role.SAMPLING], sampler[Role.RNG_SEED],
                                             sampler[Role.RNG_STEP] + i)
            else:
                nxt = sampling_kernel.first_max(logits)
            nxt = jnp.where(alive, nxt, -1)
            out = lax.dynamic_update_slice(out, nxt[:, None], (0, i))
            stopped = jnp.any(nxt[:, None] == stop_ids, axis=1)
            alive = alive & ~stopped & (i + 1 < limit)
            return i + 1, jnp.maximum(nxt, 0), alive, out, tuple(new_pools[n] for n in names)

        def cond(carry):
            i, _, alive, _, _ = carry
            return (i < steps) & jnp.any(alive)

        alive0 = (pos0 >= 0) & (limit > 0)
        init = (jnp.int32(0), tok0, alive0, jnp.full((B, steps), -1, jnp.int32), tuple(pools[n] for n in names))
        _, _, _, out, pool_bufs = lax.while_loop(cond, body, init)
        results = {(Role.STEP_TOKENS, ""): out}
        results.update({(Role.POOL_OUT, n): buf for n, buf in zip(names, pool_bufs)})
        return tuple(results[(o.role, o.slot)] for o in outputs)
    return entry
