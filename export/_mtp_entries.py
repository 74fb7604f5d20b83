"""mtp entries: an MTP head (DeepSeek-V3's `num_nextn_predict_layers`, Qwen3-Next's `mtp.*`, tlaloc_jax/mtp_head.py)
staged as its own entry.

An artifact with a head stages, beside each decode, prefill and verify point, an mtp entry of the same batch, context
and tokens per row: its rows are right-aligned as a prefill's, token x_{t+1} at position t, with the decoder's hidden
state at t (HIDDEN_STATES [B, T, E]); it writes its layer's keys into its own pool (its pages the decoder's: the
pools of one kind share an index space) and returns the logits of the token two after each row's last position, their
argmax (the draft) and the head's hidden state there (HIDDEN_STATES [B, 1, E]) for the next draft's call (T = 1).
The decoder's entries return HIDDEN_STATES [B, T, E], every position's hidden state after the final norm (what vLLM's
target model hands its MTP head). Every entry takes every pool (the runtime's rule); those that do not touch one pass
it through.
An artifact without a head has none of this: its manifest is as before.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from tlaloc_jax import artifact as af
from tlaloc_jax import mtp_head as mtp
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import in_body_sampler as sampling_kernel

from ._entries import EntrySpec, ExportError

Role = af.Role
# The decoder's entries that return HIDDEN_STATES: the calls after which a sequence drafts.
HIDDEN_KINDS = (af.EntryKind.DECODE, af.EntryKind.PREFILL, af.EntryKind.VERIFY)


@dataclasses.dataclass(frozen=True)
class MtpStage:
    """An MTP head to stage: hidden(weights, pools, inputs, hidden [B, T, E]) -> (h' [B, T, E], pools) runs its layer
    (pools: every pool, its own written), head(weights, x [R, E]) -> logits [R, V]; weights: its pytree (the
    decoder's embedding and head among them where it shares them); width: E; pool: its own pool's spec."""

    hidden: Callable
    head: Callable
    weights: Mapping
    width: int
    pool: object


def mtp_specs(specs: Sequence[EntrySpec]) -> list[EntrySpec]:
    """An mtp entry per (batch, context, tokens per row) of the decoder's entries that return hidden states."""
    contexts = sorted({s.context for s in specs})
    # The head attends with plain ops over its bucket: decode and verify points at every context, even where the
    # decoder's are at the top one alone (Features.decode_top_context).
    points = sorted({(s.batch, c, s.tokens_per_seq) for s in specs if s.kind in HIDDEN_KINDS and not s.packed
                     for c in (contexts if s.kind != af.EntryKind.PREFILL else [s.context])})
    return [EntrySpec(af.EntryKind.MTP, b, c, t) for b, c, t in points]


def returns_hidden(spec: EntrySpec) -> bool:
    return spec.kind in HIDDEN_KINDS and not spec.packed


def _insert(sigs: list, at: int, sig: af.TensorSig, donations, outputs: bool) -> tuple[list, tuple]:
    """sigs with sig inserted at `at`, and the donations' indices (on that side) shifted past it."""
    shifted = tuple((o + (outputs and o >= at), i + (not outputs and i >= at)) for o, i in donations)
    return sigs[:at] + [sig] + sigs[at:], shifted


def with_hidden_output(inputs, outputs, donations, *, batch: int, tokens: int, width: int):
    """A decoder entry's signature with HIDDEN_STATES [B, T, E] returned before its pools."""
    at = next(i for i, o in enumerate(outputs) if o.role == Role.POOL_OUT)
    outputs, donations = _insert(list(outputs), at, af.TensorSig(Role.HIDDEN_STATES, "float32", (batch, tokens, width)),
                                 donations, outputs=True)
    return list(inputs), outputs, donations


def mtp_signature(inputs, outputs, donations, *, batch: int, tokens: int, width: int):
    """A prefill-shaped signature without sampler (export/_stage.entry_signature) -> the mtp entry's: HIDDEN_STATES
    [B, T, E] taken after the step inputs, LOGITS [B, V], NEXT_TOKEN [B] and HIDDEN_STATES [B, 1, E] returned."""
    at = next(i for i, s in enumerate(inputs) if s.role not in af.STEP_FIELDS)
    inputs, donations = _insert(list(inputs), at, af.TensorSig(Role.HIDDEN_STATES, "float32", (batch, tokens, width)),
                                donations, outputs=False)
    return with_hidden_output(inputs, outputs, donations, batch=batch, tokens=1, width=width)


def mtp_fn(head: MtpStage, treedef, inputs: Sequence[af.TensorSig], outputs: Sequence[af.TensorSig]):
    """The mtp entry's function over its positional arguments, in signature order."""
    def entry(*args):
        named = list(zip(inputs, args))
        fields = {af.STEP_FIELDS[sig.role]: a for sig, a in named if sig.role in af.STEP_FIELDS}
        pools = {sig.slot: a for sig, a in named if sig.role == Role.POOL_IN}
        hidden = next(a for sig, a in named if sig.role == Role.HIDDEN_STATES)
        leaves = [a for sig, a in named if sig.role == Role.WEIGHT]
        weights = jax.tree_util.tree_unflatten(treedef, leaves)
        h, new_pools = head.hidden(weights, pools, StepInputs(**fields), hidden)
        if set(new_pools) != set(pools):
            raise ExportError(f"the MTP head returned pools {sorted(new_pools)}; it was given {sorted(pools)}")
        logits = head.head(weights, h[:, -1]).astype(jnp.float32)
        results = {(Role.LOGITS, ""): logits, (Role.NEXT_TOKEN, ""): sampling_kernel.first_max(logits),
                   (Role.HIDDEN_STATES, ""): h[:, -1:].astype(jnp.float32)}
        results.update({(Role.POOL_OUT, name): buf for name, buf in new_pools.items()})
        return tuple(results[(o.role, o.slot)] for o in outputs)
    return entry


def checkpoint_mtp(checkpoint_dir, fam, cfg, weights: Mapping, *, dtype: str, kv_dtype: str,
                   key_block: int) -> MtpStage | None:
    """The checkpoint's MTP head as an MtpStage over the decoder's config (tlaloc_jax/mtp_head.py), sharing the
    decoder's embedding (weights["embed"]) unless it stores its own, and its lm_head where the layout's logits are the
    decoder's; None without a head."""

    loaded = mtp.load_mtp_weights(checkpoint_dir, fam, cfg, dtype)
    if loaded is None:
        return None
    own, kind = loaded
    shared = [k for k in ("embed", "head") if k in weights and f"mtp.{k}" not in own]

    def hidden(w, pools, inputs, h):
        out, pool = mtp.mtp_hidden(cfg, kind, w, pools[mtp.POOL], inputs, h, key_block=key_block)
        return out, {**pools, mtp.POOL: pool}

    return MtpStage(hidden=hidden, head=lambda w, x: mtp.mtp_logits(cfg, w, x),
                    weights={**{k: weights[k] for k in shared}, **own}, width=cfg.hidden_size,
                    pool=mtp.mtp_pool(cfg, kv_dtype))
