"""The decoder as pure functions over (weights, pools, step inputs).

`forward` serves both entry kinds: a decode step is a call with T = 1, a prefill call has T > 1 with right-aligned
rows. It returns the logits of each row's last token and the updated pools. The same function runs under jax.jit
in-process, inside jax.export for the artifact, and (compiled from the artifact) under the JAX-free runtime.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tlaloc_jax import artifact as af
from tlaloc_jax.kernels import (MoeSpec, causal_conv1d, causal_conv1d_histories, causal_conv1d_reference,
                                causal_conv1d_update, gated_delta_rule_chunked, gated_delta_rule_recurrent, kv_cache_write, moe,
                                paged_attention)
from tlaloc_jax.kernels.projection_native import native_projections

from .config import DENSE, FULL, LINEAR, SLIDING, DecoderConfig
from .inputs import StepInputs
from .latent import latent_attention
from .packing import packed_rows, query_rows as one_token_rows, token_rows, unpack_rows
from .layers import ACTIVATIONS, apply_rope, embed, gated_mlp, linear, rms_norm, rope_tables, soft_cap, tied_head
from .layout import is_per_layer
from .lora import call_adapters, delta, layer_adapters, plan_index, plus, query_deltas
from .plan import MLP_SLOTS, layer_plan
from .pools import PagedKV, PoolSpec, RingKV, StateSlots, keep_per_position, per_position

Weights = dict[str, jax.Array]
Pools = dict[str, jax.Array]

DEFAULT_KEY_BLOCK = 2048
# A decode call (T = 1) with plain-op attention folds its keys in blocks of at most this many positions, so that
# it reads the blocks its rows have written rather than its whole context bucket (docs/staging.md measures it).
DECODE_KEY_BLOCK = 128


def decode_key_block(key_block: int, page_size: int) -> int:
    """The key block of a decode call: key_block, capped at DECODE_KEY_BLOCK rounded down to whole pages."""
    return min(key_block, max(DECODE_KEY_BLOCK // page_size, 1) * page_size)


# How a decode call (T = 1) attends over its pages: "xla", kernels.paged_attention in plain ops (every platform);
# "pallas", the Pallas GPU kernel (kernels.paged_attention_gpu, lowered through Triton: cuda only);
# "pallas-interpret", that kernel in Pallas' interpreter (any platform, slow: for tests). Prefill calls use "xla".
DECODE_ATTENTION = ("xla", "native", "pallas", "pallas-interpret")
PROJECTIONS = ("xla", "native")
# How a packed call's tokens attend: "rows", laid out as its rows [B, T] (a row's queries side by side); "tokens",
# each token a row of its own [N, 1] over its row's pages (ragged, as vLLM's flat batches: no padded query slots).
PACKED_ATTENTION = ("rows", "tokens")
# Tokens per chunk of the gated delta rule's prefill form.
DELTA_CHUNK = 64


def decoder_pools(cfg: DecoderConfig, *, windowed: bool, kv_dtype: str, ring_pages: int) -> dict[str, PoolSpec]:
    """The decoder's pools, as its layer plan orders them, each stacking its layers: "kv" (full-history pages; a
    latent-attention model's latent and rotated key per position, no heads, tlaloc_jax/kernels/mla.py),
    "window_kv" (the sliding layers' rings, when windowed), "conv" and "recurrent" (the linear layers' states,
    f32: each sequence's last W - 1 conv inputs [C, W - 1], the gated delta rule's state per value head
    [Hv, Dk, Dv])."""
    plan = layer_plan(cfg, windowed)
    K, D = cfg.num_kv_heads, cfg.head_dim
    specs: dict[str, PoolSpec] = {}
    for name in plan.pool_names():
        ids = plan.pool_layers(name)
        if name == "kv" and cfg.latent:     # latent attention: the latent and the rotated key per position
            specs[name] = PagedKV.latent(len(ids), cfg.latent_width, kv_dtype, layer_ids=ids)
        elif name == "kv":
            specs[name] = PagedKV(len(ids), K, D, kv_dtype, layer_ids=ids)
        elif name == "window_kv":
            specs[name] = RingKV(len(ids), K, D, cfg.sliding_window, kv_dtype, ring_pages=ring_pages, layer_ids=ids)
        elif name == "conv":
            specs[name] = StateSlots((cfg.linear.conv_channels, cfg.linear.conv_kernel - 1), "float32", len(ids), ids,
                                     shard_axis=0)
        elif name == "recurrent":
            specs[name] = StateSlots((cfg.linear.value_heads, cfg.linear.key_dim, cfg.linear.value_dim), "float32",
                                     len(ids), ids, shard_axis=0)
        else:
            raise ValueError(f"the decoder's layer plan names pool {name!r}, which decoder_pools cannot declare")
    return specs


def _pool_records(cfg: DecoderConfig, num_blocks: int, block_size: int, window_blocks: int, state_slots: int,
                  kv_dtype: str) -> list[af.Pool]:
    specs = decoder_pools(cfg, windowed=window_blocks > 0, kv_dtype=kv_dtype, ring_pages=0)
    states = [s for s in specs.values() if isinstance(s, StateSlots)]
    if states and state_slots <= 0:
        raise ValueError(f"{cfg.model_type} has {states[0].layers} linear-attention layers: its pools need "
                         f"state_slots >= 1 (one per live sequence), got {state_slots}")
    capacity = {af.PoolKind.PAGED_KV: num_blocks, af.PoolKind.RING_KV: window_blocks,
                af.PoolKind.STATE_SLOTS: state_slots}
    return [spec.to_pool(name, capacity[spec.kind], block_size) for name, spec in specs.items()]


def pool_shapes(cfg: DecoderConfig, num_blocks: int, block_size: int,
                window_blocks: int = 0, state_slots: int = 0) -> dict[str, tuple[int, ...]]:
    """Each of decoder_pools' shapes: KV pools [L', 2, P, S, K, D] (0 = keys, 1 = values; latent attention
    [L', 1, P, S, 1, C + R]) of num_blocks pages, window_kv (when window_blocks > 0) of window_blocks; state pools
    [L', slots, ...] of state_slots slots."""
    return {p.name: p.shape for p in _pool_records(cfg, num_blocks, block_size, window_blocks, state_slots, "float32")}


def init_pools(cfg: DecoderConfig, num_blocks: int, block_size: int, dtype=jnp.float32,
               window_blocks: int = 0, state_slots: int = 0) -> Pools:
    """Zeroed pools: KV pools in `dtype`, state pools in f32."""
    return {p.name: jnp.zeros(p.shape, p.dtype) for p in
            _pool_records(cfg, num_blocks, block_size, window_blocks, state_slots, jnp.dtype(dtype).name)}


def _layer_slice(weights: Weights, group: str, index, keep=lambda name: True) -> Weights:
    """One layer's slots of a group ("layers", "attn", "linear"), those whose name `keep` accepts.

    Stacked weights ([L', ...] each) are indexed with a dynamic index (the scan's counter). (Indexing a slice that
    the scan already cut, w[i][j], makes XLA copy the layer's weights first.) Per-layer weights (a tuple of L' arrays
    each, tlaloc_jax.layout) are picked by the static index."""
    prefix = group + "."
    return {name[len(prefix):]: (w[index] if isinstance(w, (tuple, list)) else
                                 jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), w))
            for name, w in weights.items() if name.startswith(prefix) and keep(name[len(prefix):])}


_MLP_NAMES = frozenset(n for names in MLP_SLOTS.values() for n in names)


def _layer_weights(weights: Weights, lp, i) -> Weights:
    """The "layers" slots of plan layer lp at scan step i: its norms (stacked over every layer) and its MLP's
    slots (stacked over the layers of its MLP kind)."""
    return {**_layer_slice(weights, "layers", lp.layer.index(i), lambda n: n not in _MLP_NAMES),
            **_layer_slice(weights, "layers", lp.mlp_weights.index(i), lambda n: n in MLP_SLOTS[lp.mlp])}


def project_qkv(cfg: DecoderConfig, w: Weights, x: jax.Array, rope: tuple[jax.Array, jax.Array],
                q_delta: jax.Array | None = None):
    """x: [B, T, E] (normed) -> q [B, T, H, D], k, v [B, T, K, D]: projected (k and v with the layer's adapters,
    q with q_delta, its adapters' part of query_deltas), q/k normed when the family has the step, rotated by rope
    (cos, sin: [B, T, R])."""
    B, T, _ = x.shape
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if "qkv_proj" in w:             # fused at export (tlaloc_jax.layout): one projection, split here
        qkv = linear(x, w["qkv_proj"])
        if cfg.attention.bias:
            qkv = qkv + w["qkv_bias"]
        q, k, v = jnp.split(qkv, (H * D, (H + K) * D), axis=-1)
    else:
        q, k, v = linear(x, w["q_proj"]), linear(x, w["k_proj"]), linear(x, w["v_proj"])
        if cfg.attention.bias:
            q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    la = w.get("lora")      # the layer's adapters (tlaloc_jax.lora), added to each projection's output
    q, k, v = plus(q, q_delta), plus(k, delta(la, "k_proj", x)), plus(v, delta(la, "v_proj", x))
    if cfg.attention.qk_norm and cfg.attention.qk_norm_whole:       # OLMo 2: over the whole projection
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps, cfg.residual.norm_offset)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps, cfg.residual.norm_offset)
    q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)
    if cfg.attention.qk_norm and not cfg.attention.qk_norm_whole:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps, cfg.residual.norm_offset)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps, cfg.residual.norm_offset)
    cos, sin = rope
    return apply_rope(q, cos, sin, cfg.rope.interleaved), apply_rope(k, cos, sin, cfg.rope.interleaved), v


def reduce_shards(cfg: DecoderConfig, x: jax.Array) -> jax.Array:
    """A row-parallel projection's partial sums added over the tensor-parallel shards (cfg.shard_axis): the
    one all-reduce of each attention and each MLP. On one device, x as it is."""
    return lax.psum(x, cfg.shard_axis) if cfg.shard_axis else x


def attention_output(cfg: DecoderConfig, w: Weights, x: jax.Array, o: jax.Array,
                     gate_delta: jax.Array | None = None) -> jax.Array:
    """o: [B, T, H, D] attention of the layer input x [B, T, E] -> [B, T, E]: gated (Qwen3.5; gate_delta, the
    adapters' part of query_deltas) and projected (with the layer's adapters)."""
    B, T, H, D = o.shape
    o = o.reshape(B, T, H * D)
    if cfg.attention.output_gate:
        o = o * jax.nn.sigmoid(plus(linear(x, w["gate_proj"]), gate_delta))
    o = reduce_shards(cfg, plus(linear(o, w["o_proj"]), delta(w.get("lora"), "o_proj", o)))
    return o + w["o_bias"] if cfg.attention.output_bias else o


# A mixture-of-experts layer's expert slots ("layers.expert_<name>"), as kernels.moe names them.
EXPERT_SLOTS = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


def moe_spec(cfg: DecoderConfig) -> MoeSpec:
    e = cfg.experts
    return MoeSpec(experts=e.num_experts, top_k=e.experts_per_token, scoring=e.router_scoring,
                   normalize=e.router_normalize, activation=e.activation, alpha=e.swiglu_alpha,
                   limit=e.swiglu_limit, groups=e.router_groups, top_groups=e.router_top_groups,
                   scale=e.routed_scaling)


def stacked_experts(weights: Weights) -> dict[str, jax.Array]:
    """The experts' slots stacked over the sparse layers, [L', X, ...], by kernels.moe's names ({} for a dense
    model, and for per-layer weights, whose layers carry their own experts)."""
    return {name: weights[f"layers.expert_{name}"] for name in EXPERT_SLOTS
            if f"layers.expert_{name}" in weights and not isinstance(weights[f"layers.expert_{name}"], (tuple, list))}


def feed_forward(cfg: DecoderConfig, lw: Weights, x: jax.Array, *, kind: str | None = None,
                 valid: jax.Array | None = None, experts: dict | None = None, layer=None) -> jax.Array:
    """A layer's MLP on its normed input x [B, T, E] -> [B, T, E]: the gated MLP (kind DENSE), or the mixture of
    experts (SPARSE: kernels.moe; padding tokens, valid False, run no expert). kind None: the config's one kind.

    experts, layer: the experts stacked over the sparse layers (stacked_experts) and this layer's index in them,
    so that each expert is read in place; None: the layer's own slots in lw.
    """
    if kind is None:
        (kind,) = set(cfg.mlp_types)
    if kind == DENSE:
        la = lw.get("lora")
        if "gate_up_proj" not in lw and la is None:
            return reduce_shards(cfg, gated_mlp(x, lw["gate_proj"], lw["up_proj"], lw["down_proj"], cfg.hidden_act))
        if "gate_up_proj" in lw:    # fused at export (tlaloc_jax.layout)
            gate, up = jnp.split(linear(x, lw["gate_up_proj"]), 2, axis=-1)
        else:
            gate, up = linear(x, lw["gate_proj"]), linear(x, lw["up_proj"])
        gate, up = plus(gate, delta(la, "gate_proj", x)), plus(up, delta(la, "up_proj", x))
        y = ACTIVATIONS[cfg.hidden_act](gate) * up
        return reduce_shards(cfg, plus(linear(y, lw["down_proj"]), delta(la, "down_proj", y)))
    if experts is None:
        experts, layer = {name: lw[f"expert_{name}"] for name in EXPERT_SLOTS if f"expert_{name}" in lw}, None
    shared = None
    if cfg.shared_expert:
        shared = {"gate": lw["shared_gate"], "up": lw["shared_up"], "down": lw["shared_down"]}
        if cfg.shared_expert_gate:
            shared["gate_proj"] = lw["shared_expert_gate"]
    # A tensor-parallel shard holds a contiguous 1/n of the experts (tlaloc_jax.sharding): the shard's first.
    first = lax.axis_index(cfg.shard_axis) * jax.tree.leaves(experts["down"])[0].shape[-3] if cfg.shard_axis else 0
    return reduce_shards(cfg, moe(moe_spec(cfg), x, lw["router"], experts, router_bias=lw.get("router_bias"),
                                  correction=lw.get("router_correction"), shared=shared, valid=valid, layer=layer,
                                  first_expert=first))


def embed_tokens(cfg: DecoderConfig, weights: Weights, token_ids: jax.Array) -> jax.Array:
    """token_ids: [B, T] -> the residual stream's start [B, T, E] f32: embeddings, times sqrt(E) (Gemma) or the
    embedding multiplier (Granite)."""
    h = embed(weights["embed"], token_ids)
    if cfg.residual.embed_scale:
        h = h * jnp.float32(cfg.hidden_size ** 0.5)
    if cfg.residual.embedding_multiplier != 1.0:
        h = h * jnp.float32(cfg.residual.embedding_multiplier)
    return h


def _residual(cfg: DecoderConfig, h: jax.Array, y: jax.Array) -> jax.Array:
    """h + y, y scaled by the residual multiplier (Granite's; 1 elsewhere)."""
    return h + (y * jnp.float32(cfg.residual.multiplier) if cfg.residual.multiplier != 1.0 else y)


def attention_input(cfg: DecoderConfig, lw: Weights, h: jax.Array) -> jax.Array:
    """What a layer's attention reads of the residual stream h: h normed (h itself without input norms: OLMo 2)."""
    return rms_norm(h, lw["attn_norm"], cfg.rms_norm_eps, cfg.residual.norm_offset) if cfg.residual.input_norms else h


def residual_mlp(cfg: DecoderConfig, lw: Weights, h: jax.Array, a: jax.Array, *, kind: str | None = None,
                 valid: jax.Array | None = None, experts: dict | None = None, layer=None) -> jax.Array:
    """The rest of a layer after its attention a: h + a (a normed first with sandwich norms), then the
    MLP's residual (feed_forward, whose arguments the keywords are). h, a: [B, T, E] -> [B, T, E]."""
    eps, off = cfg.rms_norm_eps, cfg.residual.norm_offset
    if cfg.residual.sandwich_norms:
        a = rms_norm(a, lw["post_attn_norm"], eps, off)
    h = _residual(cfg, h, a)
    x = rms_norm(h, lw["mlp_norm"], eps, off) if cfg.residual.input_norms else h
    m = feed_forward(cfg, lw, x, kind=kind, valid=valid, experts=experts, layer=layer)
    if cfg.residual.sandwich_norms:
        m = rms_norm(m, lw["post_mlp_norm"], eps, off)
    return _residual(cfg, h, m)


def _attention(cfg: DecoderConfig, w: Weights, x: jax.Array, kv: jax.Array, layer: jax.Array, inputs: StepInputs,
               rope: tuple[jax.Array, jax.Array], window: int, key_block: int, ring_pages: int = 0,
               decode_attention: str = "xla", groups: tuple[tuple[int, StepInputs], ...] = (),
               packed_attention: str = "rows", query_rows: bool = False) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, E] (normed) -> (attention output [B, T, E], kv pool with this layer's keys and values written).

    ring_pages > 0: the layer's pool is the windowed pool; it writes through the window slot mapping and scores
    only the first ring_pages entries of the window block table (the ring), whatever the bucket. decode_attention:
    which attention a decode call (T = 1) uses (DECODE_ATTENTION); other calls use plain ops. groups: (offset,
    inputs) of each group of a call whose rows have several shapes (mixed_inputs): x and `inputs` hold their tokens
    side by side in one row [1, N]; the keys and values are written at once, then each group attends as a call of
    its own shape would. packed_attention: how a packed call's tokens attend (PACKED_ATTENTION). query_rows: with
    the native decode attention, each token attends as a decode row of its own (a verify call's k + 1 positions).
    """
    q_delta, gate_delta = query_deltas(cfg, w.get("lora"), x)
    q, k, v = project_qkv(cfg, w, x, rope, q_delta)
    kv = kv_cache_write(kv, k, v, inputs.window_slot_mapping if ring_pages else inputs.slot_mapping, layer)
    common = dict(scale=cfg.query_scale, window=window or None, soft_cap=cfg.attention.softcap or None,
                  ring=bool(ring_pages), sinks=w["sinks"] if cfg.attention.sinks else None)

    def attend(q, g: StepInputs):
        tables = g.window_block_tables[:, :ring_pages] if ring_pages else g.block_tables
        if decode_attention == "native" and q.shape[1] == 1 and not ring_pages:   # a ring keeps plain ops
            from tlaloc_jax.kernels.paged_attention_native import native_decode_attention
            return native_decode_attention(q, kv, layer, tables, g.positions, g.seq_lens,
                                           **{k: v for k, v in common.items() if k != "ring"})
        if decode_attention.startswith("pallas") and q.shape[1] == 1:
            from tlaloc_jax.kernels.paged_attention_gpu import paged_decode_attention   # imports Pallas when used
            return paged_decode_attention(q, kv, layer, tables, g.positions, g.seq_lens, **common,
                                          interpret=decode_attention == "pallas-interpret")
        kb = decode_key_block(key_block, kv.shape[3]) if q.shape[1] == 1 else key_block
        return paged_attention(q, kv, layer, tables, g.positions, g.seq_lens, key_block=kb, **common)

    if inputs.pack_index is not None and packed_attention == "tokens":
        o = attend(q[0][:, None], token_rows(inputs))[None, :, 0]
    elif inputs.pack_index is not None:
        # A packed prefill: its tokens' queries laid out as its rows, each row attending over its own pages.
        rows = inputs._replace(positions=packed_rows(inputs.positions, inputs.pack_index, -1))
        o = unpack_rows(attend(packed_rows(q, inputs.pack_index, 0), rows), inputs.pack_index, x.shape[1])
    elif not groups and query_rows and decode_attention == "native" and not ring_pages:
        o = attend(q.reshape(-1, 1, *q.shape[2:]), one_token_rows(inputs)).reshape(q.shape)
    elif not groups:
        o = attend(q, inputs)
    else:
        parts = []
        for offset, g in groups:
            B, T = g.token_ids.shape
            parts.append(attend(q[0, offset:offset + B * T].reshape(B, T, *q.shape[2:]), g).reshape(B * T, -1))
        o = jnp.concatenate(parts).reshape(1, x.shape[1], *q.shape[2:])
    return attention_output(cfg, w, x, o, gate_delta), kv


def mixed_inputs(groups: tuple[StepInputs, ...]) -> tuple[StepInputs, tuple[tuple[int, StepInputs], ...]]:
    """The step inputs of a call whose rows have several shapes (a decode group of one token a row and a prompt
    chunk), as one row [1, N] of all their tokens for the token-wise work, with each group's offset in it."""
    spans, at = [], 0
    for g in groups:
        spans.append((at, g))
        at += g.token_ids.size
    flat = {name: jnp.concatenate([getattr(g, name).reshape(1, -1) for g in groups], axis=1)
            for name in ("token_ids", "positions", "slot_mapping", "window_slot_mapping")
            if getattr(groups[0], name) is not None}
    return StepInputs(**flat), tuple(spans)


def supports_mixed_calls(cfg: DecoderConfig) -> bool:
    """Whether the decoder runs calls of several row shapes (mixed_inputs): every layer a paged attention."""
    return LINEAR not in cfg.layer_types and not cfg.latent


def _linear_attention(cfg: DecoderConfig, w: Weights, x: jax.Array, pools: Pools, layer: jax.Array,
                      inputs: StepInputs) -> tuple[jax.Array, Pools]:
    """A Gated DeltaNet layer. x: [B, T, E] (normed) -> (output [B, T, E], pools with the layer's conv and
    recurrent states of each row's slot written). Each row reads its state slot (inputs.state_slots), runs the causal
    conv over q | k | v and the gated delta rule over its live tokens (decode forms for T = 1 and verify calls, prefill
    forms otherwise), and writes both states back with one scatter per pool, so a donated pool is updated in place."""
    B, T, _ = x.shape
    Kh, Dk, Hv, Dv = cfg.linear.key_heads, cfg.linear.key_dim, cfg.linear.value_heads, cfg.linear.value_dim
    live = inputs.positions >= 0
    # -1 (an empty row) -> one past the last slot: its reads give zeros and its writes are dropped.
    slots = inputs.state_slots
    slots = jnp.where(slots < 0, pools["conv"].shape[1], slots)
    # A row whose first token is at position 0 starts from zero state, so a freed slot is reused uncleared.
    fresh = jnp.any(inputs.positions == 0, axis=1)
    history = pools["conv"].at[layer, slots].get(mode="fill", fill_value=0.0)
    state = pools["recurrent"].at[layer, slots].get(mode="fill", fill_value=0.0)
    history = jnp.where(fresh[:, None, None], 0.0, history)
    state = jnp.where(fresh[:, None, None, None], 0.0, state)
    each, history0 = per_position("recurrent") in pools, history     # each: a verify call (export/_verify.py)
    la = w.get("lora")
    qkv = plus(linear(x, w["in_qkv"]), delta(la, "in_proj_qkv", x))    # [B, T, C]
    if T == 1:
        y, history = causal_conv1d_update(qkv[:, 0], w["conv"], None, history, valid=live[:, 0],
                                          activation=cfg.hidden_act)
        y = y[:, None]
    else:               # a verify call runs the decode form token by token, as the decode calls it stands for
        y, history = (causal_conv1d_reference if each else causal_conv1d)(qkv, w["conv"], None, history, valid=live,
                                                                          activation=cfg.hidden_act)
    q = y[..., :Kh * Dk].reshape(B, T, Kh, Dk)
    k = y[..., Kh * Dk:2 * Kh * Dk].reshape(B, T, Kh, Dk)
    v = y[..., 2 * Kh * Dk:].reshape(B, T, Hv, Dv)
    beta = jax.nn.sigmoid(plus(linear(x, w["in_b"]), delta(la, "in_proj_b", x)))        # [B, T, Hv]
    g = -jnp.exp(w["a_log"].astype(jnp.float32)) * jax.nn.softplus(
        plus(linear(x, w["in_a"]), delta(la, "in_proj_a", x)) + w["dt_bias"].astype(jnp.float32))   # log decay <= 0
    if T == 1 or each:
        o, state = gated_delta_rule_recurrent(q, k, v, g, beta, state, valid=live, each=each)
    else:
        o, state = gated_delta_rule_chunked(q, k, v, g, beta, state, valid=live, chunk=min(DELTA_CHUNK, T))
    if each:            # the states after every token too, and the last one in the slot as any call
        pools = keep_per_position(pools, layer, conv=causal_conv1d_histories(qkv, history0, valid=live), recurrent=state)
        state = state[:, -1]
    # The gated norm (a plain (w) RMSNorm over each head, whatever the model's norm_offset) times silu(z).
    z = plus(linear(x, w["in_z"]), delta(la, "in_proj_z", x)).reshape(B, T, Hv, Dv)
    o = rms_norm(o, w["norm"], cfg.rms_norm_eps) * jax.nn.silu(z)
    pools = {**pools,
             "conv": pools["conv"].at[layer, slots].set(history, mode="drop"),
             "recurrent": pools["recurrent"].at[layer, slots].set(state, mode="drop")}
    o = o.reshape(B, T, Hv * Dv)
    return reduce_shards(cfg, plus(linear(o, w["out_proj"]), delta(la, "out_proj", o))), pools


def final_hidden(cfg: DecoderConfig, weights: Weights, pools: Pools, inputs: StepInputs | tuple[StepInputs, ...], *,
                 key_block: int = DEFAULT_KEY_BLOCK, ring_pages: int = 0, all_positions: bool = False,
                 decode_attention: str = "xla", packed_attention: str = "rows",
                 query_rows: bool = False) -> tuple[jax.Array, Pools]:
    """Run every layer over the call's tokens: -> (final-normed hidden state of each row's last token [B, E], pools);
    all_positions: of every token of the call [B, T, E] (a scoring prefill scores each one).

    ring_pages > 0 puts the sliding layers in the windowed pool ("window_kv"), each sequence's ring of ring_pages
    pages; 0 keeps every attention layer in the full-history pool ("kv"). decode_attention: one of DECODE_ATTENTION,
    the attention of a decode call. inputs a tuple of StepInputs: one call of several groups of rows, each group's
    rows of one shape (supports_mixed_calls); the last tokens' hidden states of the groups' rows in order.
    packed_attention: one of PACKED_ATTENTION, how a packed call's tokens attend. query_rows: a verify
    call's tokens attend as decode rows of one token each (_attention).
    """
    groups = ()
    adapters, slots = call_adapters(inputs)
    if isinstance(inputs, tuple) and not isinstance(inputs, StepInputs):
        if not supports_mixed_calls(cfg) or all_positions:
            raise ValueError(f"{cfg.model_type}: a call of several row shapes runs paged attention layers only, "
                             "and returns last tokens")
        shapes = [g.token_ids.shape for g in inputs]
        inputs, groups = mixed_inputs(inputs)
    if inputs.pack_index is not None and (not supports_mixed_calls(cfg) or all_positions):
        raise ValueError(f"{cfg.model_type}: a packed prefill runs paged attention layers only, and returns last tokens")
    if decode_attention not in DECODE_ATTENTION:
        raise ValueError(f"decode_attention {decode_attention!r} is not one of {', '.join(DECODE_ATTENTION)}")
    if packed_attention not in PACKED_ATTENTION:
        raise ValueError(f"packed_attention {packed_attention!r} is not one of {', '.join(PACKED_ATTENTION)}")
    if cfg.latent and decode_attention != "xla":
        raise ValueError(f"{cfg.model_type} has latent attention, which decode_attention {decode_attention!r} has no "
                         "kernel for: use 'xla'")
    eps, off = cfg.rms_norm_eps, cfg.residual.norm_offset
    h = embed_tokens(cfg, weights, inputs.token_ids)
    tables = {FULL: rope_tables(cfg.rope, cfg.head_dim, inputs.positions)}
    tables[SLIDING] = (rope_tables(cfg.rope_sliding, cfg.head_dim, inputs.positions)
                       if cfg.rope_sliding is not None else tables[FULL])
    if LINEAR in cfg.layer_types and inputs.state_slots is None:
        raise ValueError(f"{cfg.model_type} has linear-attention layers: its step inputs need state_slots")
    plan = layer_plan(cfg, windowed=ring_pages > 0)
    experts = stacked_experts(weights) or None
    valid = inputs.positions >= 0

    def period(carry, i):
        h, pools = carry
        for lp in plan.layers:      # one period: 1 layer for Llama, 2 for Gemma 2, 4 for Qwen3.5
            lw = _layer_weights(weights, lp, i)
            a = attention_input(cfg, lw, h)
            aw = _layer_slice(weights, lp.group, lp.weights.index(i))
            if adapters is not None:
                lw["lora"] = aw["lora"] = layer_adapters(adapters, slots, plan_index(lp, i))
            if lp.kind == LINEAR:
                a, pools = _linear_attention(cfg, aw, a, pools, lp.pool.index(i), inputs)
            elif cfg.latent:
                kb = decode_key_block(key_block, pools["kv"].shape[3]) if a.shape[1] == 1 else key_block
                a, kv = latent_attention(cfg, aw, a, pools["kv"], lp.pool.index(i), inputs, tables[FULL], kb)
                pools = {**pools, "kv": kv}
            else:
                (name,) = lp.pools
                a, kv = _attention(cfg, aw, a, pools[name], lp.pool.index(i), inputs, tables[lp.kind], lp.window,
                                   key_block, ring_pages if name == "window_kv" else 0, decode_attention, groups,
                                   packed_attention, query_rows)
                pools = {**pools, name: kv}
            h = residual_mlp(cfg, lw, h, a, kind=lp.mlp, valid=valid, experts=experts,
                             layer=lp.mlp_weights.index(i))
        return (h, pools), None

    if is_per_layer(weights):
        # One array per layer (tlaloc_jax.layout): the periods unrolled, each dot reading its weight in place.
        carry = (h, pools)
        for i in range(plan.periods):
            carry, _ = period(carry, i)
        h, pools = carry
    else:
        # A scan over periods keeps one copy of the period's layers in the graph (compile time, body size);
        # the pools ride in the carry so each layer's scatter writes the donated buffers in place.
        (h, pools), _ = lax.scan(period, (h, pools), jnp.arange(plan.periods))
    if groups:
        # Each group's rows end at their last column: the row's last token (rows are right-aligned).
        last = [offset + b * T + T - 1 for (offset, _), (B, T) in zip(groups, shapes) for b in range(B)]
        return rms_norm(h[0, jnp.array(last)], weights["final_norm"], eps, off), pools
    if inputs.pack_index is not None:         # each row's last token, where the packing put it
        return rms_norm(packed_rows(h, inputs.pack_index[:, -1:], 0.0)[:, 0], weights["final_norm"], eps, off), pools
    # Rows are right-aligned, so every row's last token is at T - 1.
    return rms_norm(h if all_positions else h[:, -1], weights["final_norm"], eps, off), pools


def logits_from_hidden(cfg: DecoderConfig, weights: Weights, x: jax.Array) -> jax.Array:
    """x: [B, E] -> logits [B, V] f32."""
    logits = tied_head(x, weights["embed"]) if cfg.tie_word_embeddings else linear(x, weights["head"])
    if cfg.residual.logits_scaling != 1.0:      # Granite divides its logits by logits_scaling
        logits = logits / jnp.float32(cfg.residual.logits_scaling)
    return soft_cap(logits, cfg.residual.final_softcap)


def forward(cfg: DecoderConfig, weights: Weights, pools: Pools, inputs: StepInputs | tuple[StepInputs, ...], *,
            key_block: int = DEFAULT_KEY_BLOCK, ring_pages: int = 0, decode_attention: str = "xla",
            projections: str = "xla", packed_attention: str = "rows") -> tuple[jax.Array, Pools]:
    """One call: -> (logits of each row's last token [B, V] f32, updated pools). A tuple of StepInputs: one call of
    several groups of rows (final_hidden), logits of every group's rows in order. projections: one of PROJECTIONS,
    "native" for the C kernel where it takes the call's rows and weight dtype (kernels/projection_native.py)."""
    if projections not in PROJECTIONS:
        raise ValueError(f"projections {projections!r} is not one of {', '.join(PROJECTIONS)}")
    with native_projections(projections == "native"):
        x, pools = final_hidden(cfg, weights, pools, inputs, key_block=key_block, ring_pages=ring_pages,
                                decode_attention=decode_attention, packed_attention=packed_attention)
        return logits_from_hidden(cfg, weights, x), pools

