"""Paged attention for decode on GPU: a Pallas kernel lowered through Triton (inference only).

Same arguments and result as kernels.paged_attention.paged_attention for a decode call (one token a row,
T = 1), which stays the reference and the CPU path. One program per (row, KV head, split): it reads the
row's length, position and window, walks its share of the key blocks that hold the row's visible keys
(never the rest of the bucket), loads each block's pages straight from the stacked pool in the pool's dtype,
widens them in registers, and folds them into an online softmax in f32 for the G query heads that share the
KV head. With one split (large batches) the program finishes the softmax; with several (small batches, so
that enough programs run) the splits' states are merged by a small XLA fusion after the kernel.

Shapes: kv_pool [L, 2, P, S, K, D] as paged_attention's; the grouped queries [B, K, Gp, D] with G = H / K
padded to Gp = max(16, G rounded up to a power of two) rows (Triton's dot wants 16 rows; the padding rows
are zero and dropped). A key block is `pages_per_block` pages (pages_per_block * S keys).

Lowered for cuda, the kernel is one `stablehlo.custom_call @__gpu$xla.gpu.triton` (TRITON_CUSTOM_CALL)
carrying the kernel's Triton IR; XLA's GPU compiler, inside the CUDA PJRT plugin, compiles it to PTX
itself, so a JAX-free runtime with only the plugin can run it (docs/gpu.md). On CPU it runs in Pallas'
interpret mode (`interpret=True`), which is how the tests check it.

What a decode step can ask of paged_attention and this kernel does: GQA (H a multiple of K), a window
(None, int or traced int32; <= 0 none), ring pools, soft-cap, attention sinks, f32 / bf16 / f16 pools,
padding rows (position -1) and empty rows (seq_len 0). What it refuses by name (`refusal`): more than one
token a row, a head size or page size that is not a power of two, head sizes below 16, a non-float pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from .paged_attention import _refuse_derivative, _window_array

# The custom-call target of a Pallas kernel lowered for cuda by jaxlib up to 0.10.2 (the Triton IR rides in its
# backend_config and XLA's GPU compiler turns it into PTX). Later jaxlibs lower to "triton_kernel_call_ffi"
# instead (PTX compiled by jaxlib, run by a handler jaxlib's CUDA plugin registers): the export refuses that one.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
KEYS_PER_BLOCK = 64     # keys a program loads per loop iteration (rounded to whole pages)
TARGET_PROGRAMS = 128   # split a row's key blocks until about this many programs run (an H100/H200 has 132 SMs)
MIN_DOT_ROWS = 16       # Triton's dot wants at least 16 rows, columns and contraction length
FLOAT_POOLS = ("float32", "bfloat16", "float16")


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def refusal(tokens: int, heads: int, kv_heads: int, head_dim: int, page_size: int, pool_dtype) -> str | None:
    """Why the kernel cannot serve a call of this shape, or None. tokens: T, tokens a row."""
    dtype = jnp.dtype(pool_dtype).name
    if tokens != 1:
        return f"it is a decode kernel: one token a row, the call has {tokens}"
    if kv_heads <= 0 or heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} KV heads"
    if not _power_of_two(head_dim) or head_dim < MIN_DOT_ROWS:
        return f"head size {head_dim} is not a power of two of at least {MIN_DOT_ROWS} (Triton's block shapes)"
    if not _power_of_two(page_size):
        return f"page size {page_size} is not a power of two (Triton's block shapes)"
    if dtype not in FLOAT_POOLS:
        return f"pool dtype {dtype} is not one of {', '.join(FLOAT_POOLS)}"
    return None


def padded_group(groups: int) -> int:
    """G query heads per KV head -> the rows of a program's query block."""
    return max(MIN_DOT_ROWS, 1 << (groups - 1).bit_length())


def pages_per_block_for(page_size: int) -> int:
    """Whole pages making about KEYS_PER_BLOCK keys, at least MIN_DOT_ROWS keys (a power of two)."""
    return max(1, KEYS_PER_BLOCK // page_size, -(-MIN_DOT_ROWS // page_size))


def splits_for(batch: int, kv_heads: int, table_width: int, pages_per_block: int) -> int:
    """Programs per (row, KV head): enough that about TARGET_PROGRAMS run, at most the key blocks a row's table
    spans (one more for a ring, whose live keys may straddle its wrap)."""
    blocks = -(-table_width // pages_per_block) + 1
    return max(1, min(blocks, TARGET_PROGRAMS // (batch * kv_heads)))


def paged_decode_attention(q: jax.Array, kv_pool: jax.Array, layer, block_tables: jax.Array, positions: jax.Array,
                           seq_lens: jax.Array, *, scale: float, window=None, soft_cap: float | None = None,
                           ring: bool = False, sinks: jax.Array | None = None, pages_per_block: int | None = None,
                           splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
                           interpret: bool = False) -> jax.Array:
    """Decode attention over paged keys and values, as paged_attention with T = 1.

    q: [B, 1, H, D]; kv_pool: [L, 2, P, S, K, D]; layer: int or int32 scalar; block_tables: [B, M] int32
    (ring: [B, R], each row's ring); positions: [B, 1] int32 (-1 = padding); seq_lens: [B] int32.
    -> [B, 1, H, D] f32; 0 where nothing is seen. interpret: run the kernel in Pallas' interpreter (CPU).
    splits: programs per (row, KV head), each folding a contiguous share of the row's key blocks; their
    partial softmax states are merged after the kernel (default splits_for: more for small batches).
    Refuses (ValueError, naming the reason) a call `refusal` names.
    """
    B, T, H, D = q.shape
    S, K = kv_pool.shape[3], kv_pool.shape[4]
    why = refusal(T, H, K, D, S, kv_pool.dtype)
    if why:
        raise ValueError(f"paged_decode_attention (Pallas GPU kernel): {why}")
    ppb = pages_per_block or pages_per_block_for(S)
    if not _power_of_two(ppb) or ppb * S < MIN_DOT_ROWS:
        raise ValueError(f"paged_decode_attention: pages_per_block {ppb} must be a power of two making at least "
                         f"{MIN_DOT_ROWS} keys with pages of {S}")
    splits = splits or splits_for(B, K, block_tables.shape[1], ppb)
    if splits < 1:
        raise ValueError(f"paged_decode_attention: splits must be >= 1, got {splits}")
    return _paged_decode(scale, soft_cap, ring, ppb, splits, num_warps, num_stages, interpret, q, kv_pool,
                         jnp.asarray(layer, jnp.int32), block_tables, positions, seq_lens, _window_array(window),
                         sinks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _paged_decode(scale, soft_cap, ring, ppb, splits, num_warps, num_stages, interpret, q, kv_pool, layer,
                  block_tables, positions, seq_lens, window, sinks):
    B, _, H, D = q.shape
    K = kv_pool.shape[4]
    G = H // K
    Gp = padded_group(G)
    q = q.astype(jnp.float32).reshape(B, K, G, D)          # query head h reads KV head h // G
    q = jnp.pad(q, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    # A program starts its softmax as if it had seen one key with the sink's score and a zero value.
    has_sinks = sinks is not None
    sink = (sinks.astype(jnp.float32).reshape(K, G) if has_sinks else jnp.zeros((K, G), jnp.float32))
    sink = jnp.pad(sink, ((0, 0), (0, Gp - G)))
    scalars = jnp.stack([layer, window]).astype(jnp.int32)
    # One split: the program finishes its softmax (sinks included). Several: each writes its unnormalised state.
    kernel = functools.partial(_decode_kernel, scale=scale, soft_cap=soft_cap, ring=ring, pages_per_block=ppb,
                               has_sinks=has_sinks, splits=splits)
    if splits == 1:
        out_specs = pl.BlockSpec((None, None, None, Gp, D), lambda b, k, s: (s, b, k, 0, 0))
        out_shape = jax.ShapeDtypeStruct((1, B, K, Gp, D), jnp.float32)
    else:
        out_specs = [pl.BlockSpec((None, None, None, Gp, D), lambda b, k, s: (s, b, k, 0, 0)),    # acc
                     pl.BlockSpec((None, None, None, Gp), lambda b, k, s: (s, b, k, 0)),          # m
                     pl.BlockSpec((None, None, None, Gp), lambda b, k, s: (s, b, k, 0))]          # l
        out_shape = [jax.ShapeDtypeStruct((splits, B, K, Gp, D), jnp.float32),
                     *[jax.ShapeDtypeStruct((splits, B, K, Gp), jnp.float32)] * 2]
    out = pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=[
            pl.BlockSpec((None, None, Gp, D), lambda b, k, s: (b, k, 0, 0)),   # q
            pl.BlockSpec((None, Gp), lambda b, k, s: (k, 0)),                  # sinks
            *[pl.BlockSpec()] * 5,            # whole arrays: pool, tables, positions, seq_lens, (layer, window)
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tlaloc_paged_decode_attention",
    )(q, sink, kv_pool, block_tables, positions[:, 0], seq_lens, scalars)
    out = out[0] if splits == 1 else merge_splits(*out, sink if has_sinks else None)
    return out[:, :, :G].reshape(B, 1, H, D)


def merge_splits(acc: jax.Array, m: jax.Array, l: jax.Array, sink: jax.Array | None) -> jax.Array:
    """The splits' softmax states (acc [N, B, K, Gp, D], m, l [N, B, K, Gp]; a split that saw nothing: m = -inf,
    l = 0) and the sinks [K, Gp] -> the attention output [B, K, Gp, D] (0 where nothing is seen)."""
    top = jnp.max(m, axis=0)
    if sink is not None:
        top = jnp.maximum(top, sink[None])
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp(m - shift[None])
    total = jnp.sum(w * l, axis=0)
    if sink is not None:
        total = total + jnp.exp(sink[None] - shift)
    seen = total > 0
    return jnp.where(seen[..., None], jnp.sum(w[..., None] * acc, axis=0) / jnp.where(seen, total, 1.0)[..., None], 0.0)


_paged_decode.defjvp(_refuse_derivative("paged_decode_attention"))


def _decode_kernel(q_ref, sink_ref, pool_ref, tables_ref, pos_ref, lens_ref, scalars_ref, *out_refs, scale,
                   soft_cap, ring, pages_per_block, has_sinks, splits):
    """Program (b, kh, s): the G (padded Gp) queries of row b that read KV head kh, over share s of the row's key
    blocks. One split: out_refs = (o,), the finished output; several: (acc, m, l), the unnormalised state."""
    b, kh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    Gp, D = q_ref.shape
    pages, S = pool_ref.shape[2], pool_ref.shape[3]
    width = tables_ref.shape[1]
    block = pages_per_block * S
    layer, window = scalars_ref[0], scalars_ref[1]
    pos, length = pos_ref[b], lens_ref[b]

    # The row's visible keys are the positions [lo, hi): j <= pos, j < seq_len, j > pos - window when windowed,
    # and what the table can hold (a ring: the last R * S positions before seq_len; else M * S positions).
    hi = jnp.minimum(pos + 1, length)
    lo = jnp.where(window > 0, jnp.maximum(pos - window + 1, 0), 0)
    if ring:
        lo = jnp.maximum(lo, length - width * S)
    else:
        hi = jnp.minimum(hi, width * S)
    hi = jnp.where(pos >= 0, hi, 0)                        # a padding row sees nothing

    q = q_ref[...]                                         # [Gp, D] f32
    if has_sinks and splits == 1:   # several splits: the sinks join when their states merge
        m0, l0 = sink_ref[...], jnp.ones((Gp,), jnp.float32)
    else:
        m0, l0 = jnp.full((Gp,), -jnp.inf, jnp.float32), jnp.zeros((Gp,), jnp.float32)
    acc0 = jnp.zeros((Gp, D), jnp.float32)

    def fold(i, state):
        m, l, acc = state
        logical = i * pages_per_block + lax.iota(jnp.int32, pages_per_block)      # the block's logical pages
        entry = logical % width if ring else jnp.minimum(logical, width - 1)
        page = jnp.clip(tables_ref[b, entry], 0, pages - 1)                      # a stray entry reads page 0..P-1
        k = pool_ref[layer, 0, page, :, kh, :].reshape(block, D).astype(jnp.float32)
        v = pool_ref[layer, 1, page, :, kh, :].reshape(block, D).astype(jnp.float32)
        key_pos = i * block + lax.iota(jnp.int32, block)
        visible = (key_pos >= lo) & (key_pos < hi)                                # [block]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32) * scale          # [Gp, block]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        # Select, never multiply: slots outside [lo, hi) may hold NaN (free pages, never-written slots).
        s = jnp.where(visible[None, :], s, -jnp.inf)
        v = jnp.where(visible[:, None], v, 0.0)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet: no -inf - -inf
        p = jnp.exp(s - shift[:, None])
        rescale = jnp.exp(m - shift)
        pv = lax.dot_general(p, v, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)                  # [Gp, D]
        return m_new, rescale * l + jnp.sum(p, axis=1), rescale[:, None] * acc + pv

    first = lo // block
    last = jnp.where(hi > lo, (hi + block - 1) // block, first)                   # exclusive
    share = (last - first + splits - 1) // splits
    start = first + split * share
    stop = jnp.maximum(jnp.minimum(start + share, last), start)
    m, l, acc = lax.fori_loop(start, stop, fold, (m0, l0, acc0))
    if splits == 1:
        seen = l > 0
        out_refs[0][...] = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...], m_ref[...], l_ref[...] = acc, m, l
