"""Entries: the (kind, batch, context) points of the ladders, how a body is exported, and the checks every exported
body passes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import jax
from jax import export as jax_export

from tlaloc_jax import artifact as af
from tlaloc_jax import native
from tlaloc_jax.kernels.paged_attention_gpu import TRITON_CUSTOM_CALL


class ExportError(ValueError):
    """An entry's body does not match its signature, or needs something a PJRT plugin lacks."""


@dataclass(frozen=True)
class EntrySpec:
    kind: af.EntryKind
    batch: int
    context: int
    tokens_per_seq: int
    steps: int = 1
    long: bool = False          # a prefill entry of the long chunk, beside the ladder's of the same batch
    packed: int = 0             # a packed prefill's N: its rows' tokens, at most N, computed side by side

    @property
    def name(self) -> str:
        if self.packed:
            return f"{self.kind}_b{self.batch}_n{self.packed}_c{self.context}"
        if self.kind in (af.EntryKind.MIXED, af.EntryKind.MTP) or self.long:
            return f"{self.kind}_b{self.batch}_t{self.tokens_per_seq}_c{self.context}"
        return f"{self.kind}_b{self.batch}_c{self.context}"

    @property
    def rows(self) -> int:
        """The rows of its logits and sampler: a mixed entry's decode rows and its chunk's."""
        return self.batch + 1 if self.kind == af.EntryKind.MIXED else self.batch


def plan_entries(batch_ladder, context_ladder, prefill_max_batch: int, prefill_chunk: int,
                 mixed: bool = False, prefill_long_chunk: int = 0, packed: bool = False,
                 flat: bool = False) -> list[EntrySpec]:
    """One decode and one prefill entry per ladder point; prefill batches capped, tokens per call capped.
    prefill_long_chunk: one more prefill entry per context, of one row and that many tokens (capped by the context),
    where it is longer than the chunk and batch 1 is on the ladder: a prompt read alone takes fewer, fuller calls.
    mixed: a mixed entry (decode rows and one chunk) per context and decode batch of at least MIXED_MIN_BATCH rows.
    packed: where the largest prefill batch B is at least PACKED_MIN_BATCH, the prefill entries of several rows are
    packed prefills of B rows, one per N of packed_token_ladder(B, chunk): a call computes its rows' tokens, not
    B x chunk positions.
    flat: only packed prefills, one per context and token bucket (flat_entries): decode rows and prompt chunks
    alike run in them."""
    if flat:
        return flat_entries(batch_ladder, context_ladder, prefill_max_batch, prefill_chunk, prefill_long_chunk)
    specs = []
    for c in context_ladder:
        chunk = min(c, prefill_chunk) if prefill_chunk else c
        long = min(c, prefill_long_chunk)
        for b in batch_ladder:
            specs.append(EntrySpec(af.EntryKind.DECODE, b, c, 1))
        rows = [b for b in batch_ladder if b <= prefill_max_batch]
        if packed and rows[-1] >= PACKED_MIN_BATCH:
            specs += [EntrySpec(af.EntryKind.PREFILL, b, c, chunk) for b in rows if b == 1]
            specs += [EntrySpec(af.EntryKind.PREFILL, rows[-1], c, chunk, packed=n)
                      for n in packed_token_ladder(rows[-1], chunk)]
        else:
            specs += [EntrySpec(af.EntryKind.PREFILL, b, c, chunk) for b in rows]
        if long > chunk and 1 in batch_ladder:
            specs.append(EntrySpec(af.EntryKind.PREFILL, 1, c, long, long=True))
        if mixed:
            specs += [EntrySpec(af.EntryKind.MIXED, b, c, chunk) for b in batch_ladder
                      if b >= min(MIXED_MIN_BATCH, batch_ladder[-1])]
    return specs


# The fewest rows of packed prefills: of two rows, the ladder's only N would be both rows' chunks, a plain call's.
PACKED_MIN_BATCH = 4


def packed_token_ladder(rows: int, chunk: int) -> list[int]:
    """The N of a context's packed prefills of `rows` rows of `chunk` tokens: 2, 4, 6, ... chunks' worth, up to all
    rows' (a call pads its tokens to the next N: at most two chunks' worth)."""
    return [k * chunk for k in range(2, rows, 2)] + [rows * chunk]


def flat_token_buckets(top: int) -> list[int]:
    """The token counts a flat call pads its tokens to: powers of two up to `top` (and `top`), as vLLM's CUDA graph
    capture sizes and tpu-inference's token paddings (a call pads to at most twice its tokens)."""
    buckets = [1 << i for i in range(max(top, 1).bit_length()) if 1 << i < top]
    return buckets + [top]


def flat_entries(batch_ladder, context_ladder, prefill_max_batch: int, prefill_chunk: int,
                 prefill_long_chunk: int = 0) -> list[EntrySpec]:
    """Per context, a packed prefill per token bucket N (flat_token_buckets of the largest call: the prefill
    ladder's chunks of its largest batch, at least the largest batch and the long chunk) of min(N, largest batch)
    rows of up to min(N, long chunk) tokens each: every sequence's work of a step, one token or a chunk, rides in
    them."""
    rows = batch_ladder[-1]
    specs = []
    for c in context_ladder:
        chunk = min(c, prefill_chunk) if prefill_chunk else c
        longest = min(c, max(chunk, prefill_long_chunk))
        top = max(rows, longest, min(prefill_max_batch, rows) * chunk)
        specs += [EntrySpec(af.EntryKind.PREFILL, min(n, rows), c, min(n, longest), packed=n)
                  for n in flat_token_buckets(top)]
    return specs


# A mixed entry's fewest decode rows: fewer ride in the smallest one (padding a decode row costs next to nothing
# beside a chunk), so small batches add no entries to compile.
MIXED_MIN_BATCH = 4


# Custom-call targets a standalone PJRT plugin compiles. Anything else (jaxlib's LAPACK handlers such
# as lapack_strsm_ffi, cuSOLVER, ...) lives in jaxlib, not in the plugin, and is refused at export.
PLUGIN_CUSTOM_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
# Per platform, the targets its plugin's own compiler handles on top of those. cuda: a Pallas kernel lowered
# through Triton (tlaloc_jax/kernels/paged_attention_gpu.py) carries its Triton IR to XLA's GPU compiler, which turns it
# into PTX inside the CUDA plugin. Later jaxlibs' "triton_kernel_call_ffi" (PTX compiled by jaxlib, run by a
# handler jaxlib's CUDA plugin registers at import) is not in the list: the standalone plugin lacks it.
# On cpu, the C kernels of tlaloc_jax.native (a runtime builds and registers them: manifest versions.custom_calls).
PLATFORM_CUSTOM_CALLS = {"cpu": frozenset(native.KERNELS), "cuda": frozenset({TRITON_CUSTOM_CALL})}
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call\s+@([\w.$-]+)|call_target_name\s*=\s*\"([^\"]+)\"")


def custom_call_targets(mlir_text: str) -> set[str]:
    return {a or b for a, b in _CUSTOM_CALL.findall(mlir_text)}


def check_custom_calls(name: str, mlir_text: str, platform: str = "cpu") -> set[str]:
    """Refuse a body holding a custom call the `platform`'s standalone PJRT plugin cannot compile, by name.
    -> the custom-call targets the body holds."""
    allowed = PLUGIN_CUSTOM_CALLS | PLATFORM_CUSTOM_CALLS.get(platform, frozenset())
    targets = custom_call_targets(mlir_text)
    bad = sorted(targets - allowed)
    if bad:
        only = sorted(p for p, targets in PLATFORM_CUSTOM_CALLS.items() if set(bad) <= targets)
        where = f" (only on {', '.join(only)})" if only else ""
        raise ExportError(f"entry {name!r} holds custom_call {', '.join(repr(b) for b in bad)}, which the {platform} "
                          f"PJRT plugin does not provide{where} (a JAX-free runtime cannot compile it); write that "
                          "step in plain ops")
    return targets


def check_body(name: str, exp: jax_export.Exported, inputs: list[af.TensorSig], outputs: list[af.TensorSig],
               donations: tuple[tuple[int, int], ...] = (), platform: str = "cpu", devices: int = 1) -> set[str]:
    """The body's @main against the entry's signature: kept args, custom calls, shapes, dtypes, the pool
    aliases, read from the portable bytecode as the runtime reads it at load (tlaloc_jax.artifact.main_signature).
    -> the custom-call targets the body holds."""
    if tuple(exp.module_kept_var_idx) != tuple(range(len(inputs))):
        dropped = sorted(set(range(len(inputs))) - set(exp.module_kept_var_idx))
        raise ExportError(f"entry {name!r}: jax.export dropped unused inputs "
                          f"{[inputs[i].slot or inputs[i].role for i in dropped]}")
    text = exp.mlir_module()
    targets = check_custom_calls(name, text, platform)
    try:
        why = af.signature_mismatch(tuple(inputs), tuple(outputs), tuple(donations),
                                    af.main_signature(exp.mlir_module_serialized, f"entry {name!r} body"), devices)
    except af.ManifestError as e:
        raise ExportError(str(e)) from None
    if why:
        raise ExportError(f"entry {name!r}: {why}")
    return targets


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

