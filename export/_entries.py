"""Entries: the (kind, batch, context) points of the ladders, and one exported body per entry."""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from tlaloc_jax import manifest as mf
from tlaloc_jax.config import DecoderConfig
from tlaloc_jax.decoder import StepInputs, forward


class ExportError(ValueError):
    """An entry's body does not match its signature, or needs something a PJRT plugin lacks."""


@dataclass(frozen=True)
class EntrySpec:
    kind: str
    batch: int
    context: int
    tokens_per_seq: int

    @property
    def name(self) -> str:
        return f"{self.kind}_b{self.batch}_c{self.context}"


def plan_entries(batch_ladder, context_ladder, prefill_max_batch: int, prefill_chunk: int) -> list[EntrySpec]:
    """One decode and one prefill entry per ladder point; prefill batches capped, tokens per call capped."""
    specs = []
    for c in context_ladder:
        for b in batch_ladder:
            specs.append(EntrySpec("decode", b, c, 1))
        for b in batch_ladder:
            if b <= prefill_max_batch:
                specs.append(EntrySpec("prefill", b, c, min(c, prefill_chunk) if prefill_chunk else c))
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


def entry_signature(cfg: DecoderConfig, spec: EntrySpec, width: int, weights: dict[str, np.ndarray],
                    pool_shape: tuple[int, ...], kv_dtype: str) -> tuple[list[mf.TensorSig], list[mf.TensorSig]]:
    B, T = spec.batch, spec.tokens_per_seq
    i32 = "int32"
    inputs = [mf.TensorSig(mf.TOKEN_IDS, i32, (B, T)), mf.TensorSig(mf.POSITIONS, i32, (B, T)),
              mf.TensorSig(mf.BLOCK_TABLES, i32, (B, width)), mf.TensorSig(mf.SEQ_LENS, i32, (B,)),
              mf.TensorSig(mf.SLOT_MAPPING, i32, (B, T)), mf.TensorSig(mf.KV_POOL_IN, kv_dtype, pool_shape, "kv")]
    inputs += [mf.TensorSig(mf.WEIGHT, str(w.dtype), tuple(w.shape), slot) for slot, w in weights.items()]
    outputs = [mf.TensorSig(mf.LOGITS, "float32", (B, cfg.vocab_size)), mf.TensorSig(mf.NEXT_TOKEN, i32, (B,)),
               mf.TensorSig(mf.KV_POOL_OUT, kv_dtype, pool_shape, "kv")]
    return inputs, outputs


POOL_INPUT = 5       # index of KV_POOL_IN in every entry's inputs
POOL_OUTPUT = 2      # index of KV_POOL_OUT in every entry's outputs


def _entry_fn(cfg: DecoderConfig, slots: list[str], key_block: int):
    def entry(token_ids, positions, block_tables, seq_lens, slot_mapping, kv_pool, *weights):
        inputs = StepInputs(token_ids, positions, block_tables, seq_lens, slot_mapping)
        logits, pools = forward(cfg, dict(zip(slots, weights)), {"kv": kv_pool}, inputs, key_block=key_block)
        # The argmax rides along so a greedy caller need not pull the whole logits vector each step.
        return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32), pools["kv"]
    return entry


def export_entry(cfg: DecoderConfig, spec: EntrySpec, inputs: list[mf.TensorSig], outputs: list[mf.TensorSig],
                 slots: list[str], *, key_block: int, platform: str) -> jax_export.Exported:
    """jax.export one entry with the KV pool donated; checks the body against its signature."""
    fn = jax.jit(_entry_fn(cfg, slots, key_block), donate_argnums=(POOL_INPUT,))
    avals = [jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in inputs]
    # Source locations would put this checkout's file paths into the body; an artifact must not depend on them.
    limit = jax.config.jax_traceback_in_locations_limit
    jax.config.update("jax_traceback_in_locations_limit", 0)
    try:
        exp = jax_export.export(fn, platforms=[platform])(*avals)
    finally:
        jax.config.update("jax_traceback_in_locations_limit", limit)
    check_body(spec.name, exp, inputs, outputs)
    return exp


_MAIN = re.compile(r"func\.func public @main\((.*?)\)\s*->\s*\((.*?)\)\s*\{", re.S)
_ARG = re.compile(r"%arg\d+: tensor<([^>]*)>(\s*\{[^}]*\})?")
_MLIR_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "i32": "int32", "i8": "int8", "ui8": "uint8"}


def _parse_tensor(t: str) -> tuple[str, tuple[int, ...]]:
    parts = t.split("x")
    return _MLIR_DTYPES.get(parts[-1], parts[-1]), tuple(int(p) for p in parts[:-1])


def check_body(name: str, exp: jax_export.Exported, inputs: list[mf.TensorSig], outputs: list[mf.TensorSig]) -> None:
    """The body's @main against the entry's signature: count, shapes, dtypes, kept args, the pool alias."""
    if tuple(exp.module_kept_var_idx) != tuple(range(len(inputs))):
        dropped = sorted(set(range(len(inputs))) - set(exp.module_kept_var_idx))
        raise ExportError(f"entry {name!r}: jax.export dropped unused inputs "
                          f"{[inputs[i].slot or inputs[i].role for i in dropped]}")
    text = exp.mlir_module()
    check_custom_calls(name, text)
    m = _MAIN.search(text)
    if not m:
        raise ExportError(f"entry {name!r}: no public @main in the body")
    args = _ARG.findall(m.group(1))
    if len(args) != len(inputs):
        raise ExportError(f"entry {name!r}: body takes {len(args)} arguments, the signature has {len(inputs)}")
    for i, ((tensor, attrs), sig) in enumerate(zip(args, inputs)):
        if _parse_tensor(tensor) != (sig.dtype, tuple(sig.shape)):
            raise ExportError(f"entry {name!r}: argument {i} ({sig.slot or sig.role}) is tensor<{tensor}> in the body, "
                              f"the signature says {sig.dtype}{list(sig.shape)}")
        alias = re.search(r"tf\.aliasing_output = (\d+)", attrs or "")
        want = POOL_OUTPUT if sig.role == mf.KV_POOL_IN else None
        if (int(alias.group(1)) if alias else None) != want:
            raise ExportError(f"entry {name!r}: argument {i} ({sig.slot or sig.role}) has aliasing_output "
                              f"{alias.group(1) if alias else None}, expected {want}")
    results = re.findall(r"tensor<([^>]*)>", m.group(2))
    if [_parse_tensor(r) for r in results] != [(o.dtype, tuple(o.shape)) for o in outputs]:
        raise ExportError(f"entry {name!r}: body results {results} differ from the signature's outputs")
