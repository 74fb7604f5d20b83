"""MTP heads, DeepSeek-V3's and Qwen3-Next's multi-token prediction layer: its weights read from the checkpoint, its
step a pure function.

DeepSeek-V3 (`num_nextn_predict_layers` >= 1) holds one more layer after the decoder's, `model.layers.<N>.*`
(N = num_hidden_layers): `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head` and a whole decoder
layer (latent attention, a dense or MoE MLP, its norms); `embed_tokens` there is the decoder's own (vLLM shares it),
read only when the checkpoint stores it. Qwen3-Next stores `mtp.*`: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`,
`fc`, `norm` and `mtp.layers.0`, a full-attention Qwen3-Next layer (gated attention, its MoE); embedding and lm_head
are the decoder's. transformers reads neither. At position t the head reads the decoder's hidden state h_t and the
next token x_{t+1}:

    h' = layer(eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h_t))))      logits(x_{t+2}) = head(norm(h'))

h_t is the decoder's hidden state after its final norm (what vLLM's target model returns, and what DeepSeek's own
modeling code hands its head), and k > 1 drafts chain norm(h') as vLLM does. A family's `MtpLayout` says where its
tensors are and how vLLM combines them: DeepSeek's head zeroes the embedding at position 0 (whose token follows
nothing), its norm and head its own shared_head's; Qwen3-Next's (vLLM's Qwen3NextMTP) has its own norm and the
decoder's lm_head.
The layer attends over its own KV pool (one layer's, kept at the positions the decoder keeps its own), so a call runs
any number of positions as a prefill does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .checkpoint import TensorIndex, read_config, read_slot, weight_dtype
from .config import DENSE, SPARSE, DecoderConfig
from .decoder import _attention as full_attention, attention_input, logits_from_hidden, residual_mlp
from .families import Family, family_for
from .inputs import StepInputs
from .latent import latent_attention
from .layers import embed, linear, rms_norm, rope_tables
from .plan import MLP_SLOTS
from .pools import PagedKV

# The pool of the head's one layer: the decoder's "kv" pages, so a sequence's pages hold both.
POOL = "mtp_kv"


@dataclasses.dataclass(frozen=True)
class MtpLayout:
    """A family's MTP head: prefix (its tensors' names start so; "{n}" is num_hidden_layers), tensors ({slot: (name
    under prefix, transposed to [in, out])}), marker (the tensor that says the checkpoint has a head), layer (the
    family prefix and layer index its decoder layer's tensors are read at), counts (the config keys of its layer
    count, in order; the default where none is set), zero_first (the embedding at position 0 zeroed). Its logits
    are its own "mtp.head"'s where tensors names one, else the decoder's lm_head's."""

    prefix: str
    tensors: dict
    marker: str
    layer: tuple[str, str]
    counts: tuple[str, ...]
    default_count: int
    zero_first: bool


LAYOUTS = {
    "deepseek_v3": MtpLayout("{p}layers.{n}.", {"mtp.enorm": ("enorm.weight", False),
                                                 "mtp.hnorm": ("hnorm.weight", False),
                                                 "mtp.eh_proj": ("eh_proj.weight", True),
                                                 "mtp.norm": ("shared_head.norm.weight", False),
                                                 "mtp.head": ("shared_head.head.weight", True)},
                             "eh_proj.weight", ("{p}", "{n}"), ("num_nextn_predict_layers",), 0,
                             zero_first=True),
    # vLLM's Qwen3NextMTP: its layer count is 1 where the config does not say.
    "qwen3_next": MtpLayout("mtp.", {"mtp.enorm": ("pre_fc_norm_embedding.weight", False),
                                     "mtp.hnorm": ("pre_fc_norm_hidden.weight", False),
                                     "mtp.eh_proj": ("fc.weight", True), "mtp.norm": ("norm.weight", False)},
                            "fc.weight", ("mtp.", "0"), ("num_nextn_predict_layers", "mtp_num_hidden_layers"), 1,
                            zero_first=False),
}


class MtpError(ValueError):
    """A checkpoint's MTP head the runtime cannot read; the message names the tensor or key."""


def layout_of(cfg: DecoderConfig) -> MtpLayout | None:
    """The MTP layout of cfg's family, None for a family without one."""
    return LAYOUTS.get(family_for(cfg.model_type).name)


def _names(layout: MtpLayout, fam: Family, hf: dict) -> tuple[str, str, int]:
    """(the head's tensor prefix, its layer's family prefix, its layer index) in this checkpoint."""
    n = str(hf["num_hidden_layers"])
    fill = lambda t: t.replace("{p}", fam.prefix).replace("{n}", n)      # noqa: E731
    return fill(layout.prefix), fill(layout.layer[0]), int(fill(layout.layer[1]))


def _count(layout: MtpLayout, hf: dict) -> int:
    return int(next((hf[k] for k in layout.counts if hf.get(k) is not None), layout.default_count))


def mtp_layer(checkpoint_dir) -> int | None:
    """The index its family reads the checkpoint's first MTP layer at, or None when it has none: a family without
    a layout, a layer count of 0, or none of the head's tensors stored (a checkpoint saved by transformers)."""
    hf = read_config(checkpoint_dir)
    fam = family_for(hf.get("model_type"))
    layout = LAYOUTS.get(fam.name)
    if layout is None or not _count(layout, hf):
        return None
    at, _, layer = _names(layout, fam, hf)
    return layer if at + layout.marker in TensorIndex(Path(checkpoint_dir)).file_of else None


def mlp_kind(index: TensorIndex, prefix: str, layer: int) -> str:
    """The MTP layer's MLP: a mixture of experts where the checkpoint stores its router, else dense."""
    return SPARSE if f"{prefix}layers.{layer}.mlp.gate.weight" in index.file_of else DENSE


def load_mtp_weights(checkpoint_dir, fam: Family, cfg: DecoderConfig, dtype: str = "float32"
                     ) -> tuple[dict[str, np.ndarray], str] | None:
    """The MTP head's weights ({"mtp.<slot>": array}: its own tensors, then the layer's "layers.*" and "attn.*" slots as
    the decoder's table names them, one layer unstacked) and its MLP kind; None when the checkpoint has no head."""
    layer = mtp_layer(checkpoint_dir)
    if layer is None:
        return None
    layout = layout_of(cfg)
    at, layer_prefix, _ = _names(layout, fam, read_config(checkpoint_dir))
    layer_fam = dataclasses.replace(fam, prefix=layer_prefix)
    np_dtype = weight_dtype(dtype)
    index = TensorIndex(Path(checkpoint_dir))
    kind = mlp_kind(index, layer_prefix, layer)
    other = MLP_SLOTS[DENSE if kind == SPARSE else SPARSE]
    try:
        out = {}
        for slot, (name, transpose) in layout.tensors.items():
            a = index.get(at + name)
            out[slot] = np.ascontiguousarray((a.T if transpose else a).astype(np_dtype))
        if at + "embed_tokens.weight" in index.file_of:
            out["mtp.embed"] = index.get(at + "embed_tokens.weight").astype(np_dtype)
        for spec in fam.slots(cfg):
            group, _, name = spec.slot.partition(".")
            if group == "attn" or group == "layers" and name not in other:     # attn.gate_proj: an output gate
                out["mtp." + spec.slot] = read_slot(index, layer_fam, spec, cfg, layer, np_dtype)
    finally:
        index.close()
    E = cfg.hidden_size
    if out["mtp.eh_proj"].shape != (2 * E, E):
        raise MtpError(f"tensor {at}{layout.tensors['mtp.eh_proj'][0]} has shape "
                       f"{list(out['mtp.eh_proj'].shape[::-1])}, expected {[E, 2 * E]}")
    return out, kind


def mtp_pool(cfg: DecoderConfig, kv_dtype: str = "float32") -> PagedKV:
    """The MTP layer's KV pool: one layer's keys and values per position (latent attention: its latent and rotated
    key)."""
    if cfg.latent:
        return PagedKV.latent(1, cfg.latent_width, kv_dtype)
    return PagedKV(1, cfg.num_kv_heads, cfg.head_dim, kv_dtype)


def _group(weights: dict, group: str) -> dict:
    prefix = f"mtp.{group}."
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def mtp_hidden(cfg: DecoderConfig, kind: str, weights: dict, pool: jax.Array, inputs: StepInputs, hidden: jax.Array,
               *, key_block: int) -> tuple[jax.Array, jax.Array]:
    """The head's layer over a call's rows: inputs (rows right-aligned as a prefill's: token x_{t+1} at position t),
    hidden [B, T, E] the decoder's hidden state at each position after its final norm (or the head's own, chaining)
    -> (what the head chains [B, T, E]: norm(h'); the pool with the layer's keys written at the call's slots).
    weights: the decoder's and the head's ("mtp.*"); kind: the layer's MLP (load_mtp_weights)."""
    layout = layout_of(cfg)
    eps, off = cfg.rms_norm_eps, cfg.residual.norm_offset
    e = embed(weights.get("mtp.embed", weights["embed"]), inputs.token_ids)
    if layout.zero_first:
        e = jnp.where(inputs.positions[..., None] == 0, 0.0, e)
    x = jnp.concatenate([rms_norm(e, weights["mtp.enorm"], eps, off),
                         rms_norm(hidden.astype(jnp.float32), weights["mtp.hnorm"], eps, off)], axis=-1)
    h = linear(x, weights["mtp.eh_proj"])
    lw, aw = _group(weights, "layers"), _group(weights, "attn")
    rope = rope_tables(cfg.rope, cfg.head_dim, inputs.positions)
    if cfg.latent:
        a, pool = latent_attention(cfg, aw, attention_input(cfg, lw, h), pool, 0, inputs, rope, key_block)
    else:
        a, pool = full_attention(cfg, aw, attention_input(cfg, lw, h), pool, 0, inputs, rope, 0, key_block)
    h = residual_mlp(cfg, lw, h, a, kind=kind, valid=inputs.positions >= 0)
    return rms_norm(h, weights["mtp.norm"], eps, off), pool


def mtp_logits(cfg: DecoderConfig, weights: dict, h: jax.Array) -> jax.Array:
    """What mtp_hidden chains [..., E] -> the head's logits [..., V] f32 for the token two after the position."""
    if "mtp.head" in layout_of(cfg).tensors:
        return linear(h, weights["mtp.head"])
    return logits_from_hidden(cfg, weights, h)
