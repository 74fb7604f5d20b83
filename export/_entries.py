"""Entries: the (kind, batch, context) points of the ladders, and the checks every exported body passes."""

from __future__ import annotations

import re
from dataclasses import dataclass

from jax import export as jax_export

from tlaloc_jax import manifest as mf


class ExportError(ValueError):
    """An entry's body does not match its signature, or needs something a PJRT plugin lacks."""


@dataclass(frozen=True)
class EntrySpec:
    kind: mf.EntryKind
    batch: int
    context: int
    tokens_per_seq: int
    steps: int = 1

    @property
    def name(self) -> str:
        return f"{self.kind}_b{self.batch}_c{self.context}"


def plan_entries(batch_ladder, context_ladder, prefill_max_batch: int, prefill_chunk: int) -> list[EntrySpec]:
    """One decode and one prefill entry per ladder point; prefill batches capped, tokens per call capped."""
    specs = []
    for c in context_ladder:
        for b in batch_ladder:
            specs.append(EntrySpec(mf.EntryKind.DECODE, b, c, 1))
        for b in batch_ladder:
            if b <= prefill_max_batch:
                specs.append(EntrySpec(mf.EntryKind.PREFILL, b, c, min(c, prefill_chunk) if prefill_chunk else c))
    return specs


# Custom-call targets a standalone PJRT plugin compiles. Anything else (jaxlib's LAPACK handlers such
# as lapack_strsm_ffi, cuSOLVER, ...) lives in jaxlib, not in the plugin, and is refused at export.
PLUGIN_CUSTOM_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call\s+@([\w.$-]+)|call_target_name\s*=\s*\"([^\"]+)\"")


def custom_call_targets(mlir_text: str) -> set[str]:
    return {a or b for a, b in _CUSTOM_CALL.findall(mlir_text)}


def check_custom_calls(name: str, mlir_text: str) -> None:
    bad = sorted(custom_call_targets(mlir_text) - PLUGIN_CUSTOM_CALLS)
    if bad:
        raise ExportError(f"entry {name!r} holds custom_call {', '.join(repr(b) for b in bad)}, which the PJRT "
                          "plugins do not provide (a JAX-free runtime cannot compile it); write that step in plain ops")


def check_body(name: str, exp: jax_export.Exported, inputs: list[mf.TensorSig], outputs: list[mf.TensorSig],
               donations: tuple[tuple[int, int], ...] = ()) -> None:
    """The body's @main against the entry's signature: kept args, custom calls, shapes, dtypes, the pool
    aliases; the same reading of @main the runtime does at load (manifest.signature_mismatch)."""
    if tuple(exp.module_kept_var_idx) != tuple(range(len(inputs))):
        dropped = sorted(set(range(len(inputs))) - set(exp.module_kept_var_idx))
        raise ExportError(f"entry {name!r}: jax.export dropped unused inputs "
                          f"{[inputs[i].slot or inputs[i].role for i in dropped]}")
    text = exp.mlir_module()
    check_custom_calls(name, text)
    try:
        why = mf.signature_mismatch(tuple(inputs), tuple(outputs), tuple(donations),
                                    mf.main_signature(text, f"entry {name!r} body"))
    except mf.ManifestError as e:
        raise ExportError(str(e)) from None
    if why:
        raise ExportError(f"entry {name!r}: {why}")
