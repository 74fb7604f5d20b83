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


@dataclass(frozen=True)
class Layout:
    """How an artifact's pools are laid out: the pools (name -> shape), the dtype, the ring size."""

    pools: dict
    kv_dtype: str
    ring_pages: int = 0


POOL_ROLES = {"kv": (mf.KV_POOL_IN, mf.KV_POOL_OUT), "window_kv": (mf.WINDOW_KV_POOL_IN, mf.WINDOW_KV_POOL_OUT)}


def entry_signature(cfg: DecoderConfig, spec: EntrySpec, width: int, weights: dict[str, np.ndarray],
                    layout: Layout) -> tuple[list[mf.TensorSig], list[mf.TensorSig], tuple[tuple[int, int], ...]]:
    """(inputs, outputs, donations) of an entry: step inputs by role, the pools, then the weights."""
    B, T = spec.batch, spec.tokens_per_seq
    i32 = "int32"
    shapes = {mf.TOKEN_IDS: (B, T), mf.POSITIONS: (B, T), mf.SEQ_LENS: (B,)}
    if "kv" in layout.pools:
        shapes.update({mf.BLOCK_TABLES: (B, width), mf.SLOT_MAPPING: (B, T)})
    if "window_kv" in layout.pools:
        shapes.update({mf.WINDOW_BLOCK_TABLES: (B, width), mf.WINDOW_SLOT_MAPPING: (B, T)})
    inputs = [mf.TensorSig(role, i32, shapes[role]) for role in mf.STEP_ROLES if role in shapes]
    outputs = [mf.TensorSig(mf.LOGITS, "float32", (B, cfg.vocab_size)), mf.TensorSig(mf.NEXT_TOKEN, i32, (B,))]
    donations = []
    for name, shape in layout.pools.items():
        in_role, out_role = POOL_ROLES[name]
        donations.append((len(outputs), len(inputs)))
        inputs.append(mf.TensorSig(in_role, layout.kv_dtype, shape, name))
        outputs.append(mf.TensorSig(out_role, layout.kv_dtype, shape, name))
    inputs += [mf.TensorSig(mf.WEIGHT, str(w.dtype), tuple(w.shape), slot) for slot, w in weights.items()]
    return inputs, outputs, tuple(donations)


def _entry_fn(cfg: DecoderConfig, inputs: list[mf.TensorSig], outputs: list[mf.TensorSig], key_block: int,
              ring_pages: int):
    """The entry's function over its positional arguments, in signature order."""
    def entry(*args):
        step, pools, weights = {}, {}, {}
        for sig, a in zip(inputs, args):
            if sig.role in mf.STEP_FIELDS:
                step[mf.STEP_FIELDS[sig.role]] = a
            elif sig.role in mf.POOL_IN_ROLES:
                pools[sig.slot] = a
            else:
                weights[sig.slot] = a
        # A model whose every attention layer is windowed keeps no full-history pages: no tables for them.
        step.setdefault("block_tables", None)
        step.setdefault("slot_mapping", None)
        logits, pools = forward(cfg, weights, pools, StepInputs(**step), key_block=key_block, ring_pages=ring_pages)
        # The argmax rides along so a greedy caller need not pull the whole logits vector each step.
        results = {mf.LOGITS: logits, mf.NEXT_TOKEN: jnp.argmax(logits, axis=-1).astype(jnp.int32)}
        results.update({POOL_ROLES[name][1]: buf for name, buf in pools.items()})
        return tuple(results[o.role] for o in outputs)
    return entry


def export_entry(cfg: DecoderConfig, spec: EntrySpec, inputs: list[mf.TensorSig], outputs: list[mf.TensorSig],
                 donations: tuple[tuple[int, int], ...], *, key_block: int, ring_pages: int,
                 platform: str) -> jax_export.Exported:
    """jax.export one entry with its pools donated; checks the body against its signature."""
    fn = jax.jit(_entry_fn(cfg, inputs, outputs, key_block, ring_pages),
                 donate_argnums=tuple(i for _, i in donations))
    avals = [jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in inputs]
    # Source locations would put this checkout's file paths into the body; an artifact must not depend on them.
    limit = jax.config.jax_traceback_in_locations_limit
    jax.config.update("jax_traceback_in_locations_limit", 0)
    try:
        exp = jax_export.export(fn, platforms=[platform])(*avals)
    finally:
        jax.config.update("jax_traceback_in_locations_limit", limit)
    check_body(spec.name, exp, inputs, outputs, donations)
    return exp


_MAIN = re.compile(r"func\.func public @main\((.*?)\)\s*->\s*\((.*?)\)\s*\{", re.S)
_ARG = re.compile(r"%arg\d+: tensor<([^>]*)>(\s*\{[^}]*\})?")
_MLIR_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "i32": "int32", "i8": "int8", "ui8": "uint8"}


def _parse_tensor(t: str) -> tuple[str, tuple[int, ...]]:
    parts = t.split("x")
    return _MLIR_DTYPES.get(parts[-1], parts[-1]), tuple(int(p) for p in parts[:-1])


def check_body(name: str, exp: jax_export.Exported, inputs: list[mf.TensorSig], outputs: list[mf.TensorSig],
               donations: tuple[tuple[int, int], ...] = ()) -> None:
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
        want = next((o for o, i_ in donations if i_ == i), None)
        if (int(alias.group(1)) if alias else None) != want:
            raise ExportError(f"entry {name!r}: argument {i} ({sig.slot or sig.role}) has aliasing_output "
                              f"{alias.group(1) if alias else None}, expected {want}")
    results = re.findall(r"tensor<([^>]*)>", m.group(2))
    if [_parse_tensor(r) for r in results] != [(o.dtype, tuple(o.shape)) for o in outputs]:
        raise ExportError(f"entry {name!r}: body results {results} differ from the signature's outputs")
