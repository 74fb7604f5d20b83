"""Weight quantization at export: which slots are quantized, and what the manifest records of each.

The projections (attention q, k, v, o and output gate, latent attention's q_a, q_b and kv_a, the MLP's gate,
up and down, and routed experts' gate, up and down per expert and output channel) are quantized from the
checkpoint's values in f32; the embedding, the norms, biases, the router and its correction bias, latent
attention's k_b and v_b (tlaloc_jax/kernels/mla.py contracts them along either axis, absorbed or expanded) and the head
keep the model's weight dtype (tlaloc_jax/kernels/quantized_matmul.py). The output head has a scheme of its own
(head_quant_for): int8 per output channel by default where the projections are 4-bit, else the weight dtype.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import jax
import numpy as np

from tlaloc_jax import artifact as af
from tlaloc_jax import prequantized
from tlaloc_jax.checkpoint import read_config
from tlaloc_jax.kernels.quantized_matmul import QuantError, QuantizedWeight, check_scheme, quantize_array

from ._entries import ExportError
from ._weights import path_name

# The weight slots a scheme quantizes (tlaloc_jax/families.py's names).
QUANTIZED_SLOTS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "attn.gate_proj",
                   "attn.q_a_proj", "attn.q_b_proj", "attn.kv_a_proj",                  # latent attention
                   "layers.gate_proj", "layers.up_proj", "layers.down_proj",
                   "attn.qkv_proj", "layers.gate_up_proj",                              # fused (tlaloc_jax.layout)
                   "layers.expert_gate", "layers.expert_up", "layers.expert_down",      # [L, X, in, out]
                   "layers.shared_gate", "layers.shared_up", "layers.shared_down")
WEIGHT_QUANT = ("none", *(s.value for s in af.QuantScheme))
# The output head's schemes (export --head-quant). A 4-bit artifact keeps its head at int8 by default, as llama.cpp
# keeps its output matrix above its 4-bit types (Q6_K beside Q4_0): the head's error reaches every logit directly,
# and in a bf16 head it is a large share of the bytes a 4-bit decode step reads.
HEAD_QUANT = ("none", af.QuantScheme.INT8.value)
HEAD_QUANT_DEFAULT = {s.value: af.QuantScheme.INT8.value for s in af.GROUPED_SCHEMES}


def head_quant_for(weight_quant: str, head_quant: str | None) -> str:
    """The head's scheme: head_quant where given, else HEAD_QUANT_DEFAULT's for weight_quant ("none": the weight
    dtype). Refuses an unknown one, and int8 for an artifact whose projections are not quantized here."""
    if head_quant is None:
        return HEAD_QUANT_DEFAULT.get(weight_quant, "none")
    if head_quant not in HEAD_QUANT:
        raise ExportError(f"head_quant {head_quant!r} is not one of {', '.join(HEAD_QUANT)}")
    if head_quant != "none" and weight_quant == "none":
        raise ExportError(f"head_quant {head_quant!r} (--head-quant) quantizes the head of an artifact whose "
                          "projections are quantized here: pass weight_quant (--weight-quant) too, or head_quant 'none'")
    return head_quant


def scheme_label(scheme: str, group: int) -> str:
    """The scheme as the model's name carries it: "int8", "fp8", "int4g128", "uint4g128"."""
    return f"{scheme}g{group}" if scheme in af.GROUPED_SCHEMES else scheme


def quantize_weights(weights: Mapping[str, np.ndarray], scheme: str, group: int, *, compute: str,
                     head: str = "none") -> dict[str, Any]:
    """weights with every QUANTIZED_SLOTS slot replaced by its QuantizedWeight (and the head by its `head` scheme's,
    unless "none"); the rest cast to `compute`."""
    if scheme not in WEIGHT_QUANT[1:]:
        raise ExportError(f"weight quantization {scheme!r} is not one of {', '.join(WEIGHT_QUANT)}")
    dtype = af.numpy_dtype(compute)
    out: dict[str, Any] = {}
    for name, w in weights.items():
        if name == "head" and head != "none":
            out[name] = quantize_array(np.asarray(w, np.float32), head, 0, compute=compute)
            continue
        if name not in QUANTIZED_SLOTS:
            out[name] = np.asarray(w).astype(dtype)
            continue
        grouped = group if scheme in af.GROUPED_SCHEMES else 0
        try:
            check_scheme(scheme, grouped, w.shape[-2])
            q = quantize_array(np.asarray(w, np.float32), scheme, grouped, compute=compute)
        except QuantError as e:
            raise ExportError(f"weight {name!r} {list(w.shape)}: {e}") from None
        out[name] = q
    return out


def prequantized_config(checkpoint_dir, weight_quant: str) -> prequantized.QuantConfig | None:
    """A pre-quantized checkpoint's quantization_config (None for an unquantized one); refuses quantizing it again."""
    qc = prequantized.quant_config(read_config(checkpoint_dir))
    if qc is not None and weight_quant != "none":
        raise ExportError(f"the checkpoint is already quantized (quantization_config.quant_method {qc.method!r}): "
                          f"export it with weight_quant 'none' (--weight-quant none), not {weight_quant!r}")
    return qc


def check_prequantized(weights: Mapping[str, Any], qc: prequantized.QuantConfig, *, progress: bool) -> str:
    """Refuses a slot read quantized that the decoder keeps float; says what was read (the export log); -> the
    label the model's name carries ("gptq-uint4g128")."""
    is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    stored = [name for name, w in weights.items() if any(map(is_q, jax.tree.leaves(w, is_leaf=is_q)))]
    for name in stored:
        if name not in QUANTIZED_SLOTS:
            raise ExportError(f"slot {name!r} is stored quantized ({qc.method}) but is kept in the weight dtype here "
                              f"(quantized slots: {', '.join(QUANTIZED_SLOTS)})")
    if progress:
        how = ("dequantized to the weight dtype (the artifact's fp8 has one scale per output channel, not one per "
               f"{qc.block[0]}x{qc.block[1]} block)" if qc.method == "fp8" else "codes read as stored")
        print(f"pre-quantized checkpoint ({qc.label}): {len(stored)} quantized slots, {how}", file=sys.stderr)
    return qc.label


def quant_records(weights: Any) -> dict[str, af.WeightQuant]:
    """{slot of a codes or scales file: what the manifest records of it}, for every QuantizedWeight in the
    weights pytree (slot names as stage's flatten_weights joins them)."""
    is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights, is_leaf=is_q)[0]:
        if not is_q(leaf):
            continue
        name = path_name(path)
        for part in af.QUANT_PARTS[leaf.scheme]:
            out[f"{name}.{part}"] = af.WeightQuant(af.QuantScheme(leaf.scheme), part, name, leaf.group,
                                                   leaf.out_major)
    return out
