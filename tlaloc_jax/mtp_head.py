"""DeepSeek-V3's multi-token prediction (MTP) head: its weights read from the checkpoint, its step a pure function.

A checkpoint with `num_nextn_predict_layers` >= 1 holds one more layer after the decoder's, `model.layers.<N>.*`
(N = num_hidden_layers): `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head` and a whole decoder
layer (latent attention, a dense or MoE MLP, its norms); `embed_tokens` there is the decoder's own (vLLM shares it),
read only when the checkpoint stores it. transformers' DeepseekV3 does not read it. At position t the head reads the
decoder's hidden state h_t before the final norm and the next token x_{t+1}:

    h' = layer(eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h_t))))      logits(x_{t+2}) = head(norm(h'))

The layer attends over its own KV pool (one layer's latents, kept at the positions the decoder keeps its own), so a
call runs any number of positions as a prefill does. k > 1 drafts chain the same layer on its own h' (vLLM's
DeepSeekMTP). vLLM zeroes the embedding at position 0, whose token follows nothing; so does this.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .checkpoint import TensorIndex, read_config, read_slot, weight_dtype
from .config import DENSE, SPARSE, DecoderConfig
from .decoder import attention_input, logits_from_hidden, residual_mlp
from .families import Family
from .inputs import StepInputs
from .latent import latent_attention
from .layers import embed, linear, rms_norm, rope_tables
from .plan import MLP_SLOTS
from .pools import PagedKV

# The head's own tensors, by slot: (name under model.layers.<N>., transposed to [in, out]).
HEAD_TENSORS = {"mtp.enorm": ("enorm.weight", False), "mtp.hnorm": ("hnorm.weight", False),
                "mtp.eh_proj": ("eh_proj.weight", True), "mtp.norm": ("shared_head.norm.weight", False),
                "mtp.head": ("shared_head.head.weight", True)}
# The pool of the head's one layer: the decoder's "kv" pages, so a sequence's pages hold both.
POOL = "mtp_kv"


class MtpError(ValueError):
    """A checkpoint's MTP head the runtime cannot read; the message names the tensor or key."""


def mtp_layer(checkpoint_dir) -> int | None:
    """The layer index of the checkpoint's first MTP layer (num_hidden_layers), or None when it has none: no
    num_nextn_predict_layers, or none of the head's tensors stored (a checkpoint saved by transformers)."""
    hf = read_config(checkpoint_dir)
    if not hf.get("num_nextn_predict_layers"):
        return None
    n = int(hf["num_hidden_layers"])
    return n if f"model.layers.{n}.eh_proj.weight" in TensorIndex(Path(checkpoint_dir)).file_of else None


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
    if not cfg.latent:
        raise MtpError(f"{cfg.model_type}: the MTP head is read for DeepSeek-V3 (latent attention) only")
    np_dtype = weight_dtype(dtype)
    index = TensorIndex(Path(checkpoint_dir))
    kind = mlp_kind(index, fam.prefix, layer)
    other = MLP_SLOTS[DENSE if kind == SPARSE else SPARSE]
    at = f"{fam.prefix}layers.{layer}."
    try:
        out = {}
        for slot, (name, transpose) in HEAD_TENSORS.items():
            a = index.get(at + name)
            out[slot] = np.ascontiguousarray((a.T if transpose else a).astype(np_dtype))
        if at + "embed_tokens.weight" in index.file_of:
            out["mtp.embed"] = index.get(at + "embed_tokens.weight").astype(np_dtype)
        for spec in fam.slots(cfg):
            group, _, name = spec.slot.partition(".")
            if group in ("layers", "attn") and name not in other:
                out["mtp." + spec.slot] = read_slot(index, fam, spec, cfg, layer, np_dtype)
    finally:
        index.close()
    E = cfg.hidden_size
    if out["mtp.eh_proj"].shape != (2 * E, E):
        raise MtpError(f"tensor {at}eh_proj.weight has shape {list(out['mtp.eh_proj'].shape[::-1])}, expected "
                       f"{[E, 2 * E]}")
    return out, kind


def mtp_pool(cfg: DecoderConfig, kv_dtype: str = "float32") -> PagedKV:
    """The MTP layer's KV pool: one latent-attention layer's latents and rotated keys per position."""
    return PagedKV.latent(1, cfg.latent_width, kv_dtype)


def _group(weights: dict, group: str) -> dict:
    prefix = f"mtp.{group}."
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def mtp_hidden(cfg: DecoderConfig, kind: str, weights: dict, pool: jax.Array, inputs: StepInputs, hidden: jax.Array,
               *, key_block: int) -> tuple[jax.Array, jax.Array]:
    """The head's layer over a call's rows: inputs (rows right-aligned as a prefill's: token x_{t+1} at position t),
    hidden [B, T, E] the decoder's pre-norm hidden state at each position (or the head's own, chaining) ->
    (h' [B, T, E] before the head's norm, the pool with the layer's latents written at the call's slots).
    weights: the decoder's and the head's ("mtp.*"); kind: the layer's MLP (load_mtp_weights)."""
    eps, off = cfg.rms_norm_eps, cfg.residual.norm_offset
    e = embed(weights.get("mtp.embed", weights["embed"]), inputs.token_ids)
    e = jnp.where(inputs.positions[..., None] == 0, 0.0, e)
    x = jnp.concatenate([rms_norm(e, weights["mtp.enorm"], eps, off),
                         rms_norm(hidden.astype(jnp.float32), weights["mtp.hnorm"], eps, off)], axis=-1)
    h = linear(x, weights["mtp.eh_proj"])
    lw, aw = _group(weights, "layers"), _group(weights, "attn")
    rope = rope_tables(cfg.rope, cfg.head_dim, inputs.positions)
    a, pool = latent_attention(cfg, aw, attention_input(cfg, lw, h), pool, 0, inputs, rope, key_block)
    return residual_mlp(cfg, lw, h, a, kind=kind, valid=inputs.positions >= 0), pool


def mtp_logits(cfg: DecoderConfig, weights: dict, h: jax.Array) -> jax.Array:
    """h' [..., E] -> the head's logits [..., V] f32 for the token two after the position."""
    return linear(rms_norm(h, weights["mtp.norm"], cfg.rms_norm_eps, cfg.residual.norm_offset), weights["mtp.head"])


def normed_logits(cfg: DecoderConfig, weights: dict, x: jax.Array) -> jax.Array:
    """The decoder's head over hidden states before its final norm (an MTP artifact's SplitStep head): [R, E] ->
    [R, V] f32."""
    return logits_from_hidden(cfg, weights, rms_norm(x, weights["final_norm"], cfg.rms_norm_eps,
                                                     cfg.residual.norm_offset))
