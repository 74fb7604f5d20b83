"""Two small bounded programs for the tests (tlaloc_jax.stage_bounded), written in plain jax, and their controls.

embed: a sentence embedder over token ids [rows, tokens] (a batch bound and a length bound): embeddings and
positions, one self-attention layer whose padded keys are masked out, a tanh projection mean-pooled over the valid
tokens, L2-normalised. Outputs: "embedding" [rows, D] and "hidden" [rows, tokens, E] (it follows both bounds).

cross: a scorer of a query [Q, F] against a document [N, F], two length bounds and no batch: the query attends over
the valid document positions ("attended" [Q, F]), how much attention each document position gets from the valid
query positions ("doc_weight" [N]), and a max-sim score (a scalar).

Each has controls that read padding, which the exporter must refuse by name.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from tlaloc_jax import Bound

E, D, F = 16, 12, 6
NEG = -1e30            # a masked score: exp of it, less the row's max, is exactly 0


def embed_params(vocab: int, max_tokens: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)   # noqa: E731
    return {"embed": rng.standard_normal((vocab, E)).astype(np.float32),
            "pos": (0.1 * rng.standard_normal((max_tokens, E))).astype(np.float32),
            "attn": {"q": w(E, E), "k": w(E, E), "v": w(E, E)}, "out": w(E, D)}


def embed_bounds(max_rows: int = 4, max_tokens: int = 16, buckets=(4, 8, 16)) -> dict:
    return {"rows": Bound(max=max_rows, axes=[("ids", 0)], batch=True),
            "tokens": Bound(max=max_tokens, axes=[("ids", 1)], buckets=buckets)}


def embed(p, inputs, valid, *, control: str | None = None):
    ids = inputs["ids"]                                              # [B, T]
    mask, length = valid["tokens"].mask, valid["tokens"].length      # [B, T], [B]
    x = p["embed"][ids] + p["pos"][:ids.shape[1]]                    # [B, T, E]
    q, k, v = (x @ p["attn"][n] for n in "qkv")
    s = jnp.einsum("bte,bse->bts", q, k) / np.sqrt(E)                # [B, T, T]
    if control != "unmasked_keys":
        s = jnp.where(mask[:, None, :], s, NEG)
    h = x + jax.nn.softmax(s, axis=-1) @ v
    y = jnp.tanh(h @ p["out"])                                       # [B, T, D]
    if control == "mean_over_padding":
        pooled = jnp.mean(y, axis=1)
    else:
        m = mask[:1] if control == "first_row_mask" else mask
        pooled = jnp.sum(jnp.where(m[..., None], y, 0.0), axis=1) / jnp.maximum(length, 1)[..., None]
    norm = jnp.sqrt(jnp.sum(pooled * pooled, axis=-1, keepdims=True))
    return {"embedding": pooled / jnp.maximum(norm, 1e-12), "hidden": h}


EMBED_CONTROLS = {
    "mean_over_padding": "embedding",     # the pooling averages the padded tokens in
    "unmasked_keys": "embedding",         # attention reads the padded keys (every output changes; the first is named)
    "first_row_mask": "embedding",        # every row pools the tokens row 0 has (a row's length alone would not
                                          # do: the normalisation cancels a wrong divisor)
}


def cross_params(seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"wq": (rng.standard_normal((F, F)) / np.sqrt(F)).astype(np.float32),
            "wd": (rng.standard_normal((F, F)) / np.sqrt(F)).astype(np.float32)}


def cross_bounds() -> dict:
    return {"query": Bound(max=8, axes=[("query", 0)], buckets=(4, 8)),
            "doc": Bound(max=32, axes=[("doc", 0)], buckets=(8, 16, 32))}


def cross(p, inputs, valid, *, control: str | None = None):
    qm, dm = valid["query"].mask, valid["doc"].mask                  # [Q], [N]
    q, d = inputs["query"] @ p["wq"], inputs["doc"] @ p["wd"]
    s = q @ d.T / np.sqrt(F)                                         # [Q, N]
    if control != "unmasked_doc":
        s = jnp.where(dm[None, :], s, NEG)
    w = jax.nn.softmax(s, axis=-1)
    doc_weight = jnp.sum(jnp.where(qm[:, None], w, 0.0), axis=0) / valid["query"].length
    best = jnp.max(s, axis=-1)
    if control == "score_over_padded_queries":
        score = jnp.mean(best)
    else:
        score = jnp.sum(jnp.where(qm, best, 0.0)) / valid["query"].length
    return {"attended": w @ inputs["doc"], "doc_weight": doc_weight, "score": score}


CROSS_CONTROLS = {
    "unmasked_doc": "attended",                   # softmax over every document position
    "score_over_padded_queries": "score",         # the mean takes the padded queries' best scores in
}


def cross_examples(seed: int = 2) -> dict:
    rng = np.random.default_rng(seed)
    return {"query": rng.standard_normal((8, F)).astype(np.float32),
            "doc": rng.standard_normal((32, F)).astype(np.float32)}


def edge_sizes(buckets, maximum: int) -> list[int]:
    """1, one below, at and one above each bucket edge, and the maximum: the sizes a bound is served at."""
    return sorted({1, maximum} | {s for e in buckets for s in (e - 1, e, e + 1) if 1 <= s <= maximum})


def sweep(a: list[int], b: list[int]) -> list[tuple[int, int]]:
    """Pairs in which every size of `a` and every size of `b` appears, each beside the other's sizes in turn (the
    whole product would cost an in-process compile per pair for little more)."""
    pairs = [(x, b[i % len(b)]) for i, x in enumerate(a)] + [(a[i % len(a)], y) for i, y in enumerate(b)]
    return sorted(set(pairs))
