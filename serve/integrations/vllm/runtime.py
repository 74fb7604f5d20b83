"""The plugin's one door into the JAX-free runtime: load an artifact (device, compiled entries, weights, pools) and
run one entry on rows of (token ids, start position, page ids, state slot), getting back each row's token and, when
asked, its logits.

Everything the vLLM worker knows of tlaloc's runtime goes through `ArtifactRuntime`; nothing here imports vLLM or
torch. Pages are the caller's (vLLM's block manager hands them out), so the engine's own allocators stay unused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from tlaloc_jax import manifest as mf
from tlaloc_jax.paging import RowCall, build_step_inputs

from ...engine import DEFAULT_CACHE_DIR, Engine
from ...sampling import NEUTRAL_ROW, Sampling, seed_words


@dataclass(frozen=True)
class Row:
    """One sequence's part of a call.

    token_ids start at position `start`; `pages` are the sequence's pages in position order (vLLM's block ids),
    `state_slot` its slot in the state pools (-1: none). sampling: how to choose the token after the row's last
    one (None: no token is wanted from this row, e.g. a chunk before the end of a prompt). seed and step: the
    request's random stream and the index of the token being drawn. history: the sequence's tokens so far (read
    by penalties). mask: the packed allowed-token words ([ceil(V / 32)] int32), or None for all tokens.
    """

    token_ids: Sequence[int]
    start: int
    pages: Sequence[int]
    state_slot: int = -1
    sampling: Sampling | None = None
    seed: int = 0
    step: int = 0
    history: Sequence[int] = ()
    mask: np.ndarray | None = None


@dataclass
class RunResult:
    """Per row: the chosen token (the in-body sampler's, else the argmax) and, when asked, the logits [V]."""

    tokens: np.ndarray
    logits: np.ndarray | None = None
    stats: dict = field(default_factory=dict)


class ArtifactRuntime:
    """An artifact loaded on a PJRT device: its entries, block size, pools and sampler."""

    def __init__(self, artifact_dir: str | Path, *, plugin: str | None = None,
                 cache_dir: str | Path | None = DEFAULT_CACHE_DIR, max_model_len: int | None = None):
        self._engine = Engine.load(artifact_dir, plugin, cache_dir=cache_dir, progress=False,
                                   max_model_len=max_model_len, use_decode_steps=False)
        self.manifest: mf.Manifest = self._engine.manifest
        self.block_size = self.manifest.block_size
        self.vocab = self.manifest.model.vocab
        self.sampler: mf.Sampler | None = self.manifest.sampler
        self.load_seconds = self._engine.load_seconds

    def capacity(self, kind: mf.PoolKind) -> int:
        return self.manifest.capacity(kind)

    def pick(self, kind: mf.EntryKind, batch: int, context: int, tokens: int) -> mf.Entry | None:
        """The smallest entry of `kind` that holds `batch` rows of up to `tokens` tokens reaching `context`."""
        return self._engine._pick(kind, batch, context, tokens)

    def entries(self, kind: mf.EntryKind) -> list[mf.Entry]:
        return self._engine._entries(kind)

    def run(self, entry: mf.Entry, rows: Sequence[Row], *, logits: bool = False) -> RunResult:
        """Run `entry` once on `rows` (right-aligned, as the entry expects; unused rows empty)."""
        e = entry
        inputs = build_step_inputs([RowCall(r.token_ids, r.start, r.pages, (), r.state_slot) for r in rows],
                                   batch=e.batch, tokens=e.tokens_per_seq, width=e.context // self.block_size,
                                   block_size=self.block_size,
                                   state_slots=mf.PoolKind.STATE_SLOTS in self.manifest.pool_kinds)
        want = {mf.Role.LOGITS} if logits else set()
        if self.sampler is not None:
            inputs.update(self._sampler_inputs(e, rows))
            want.add(mf.Role.SAMPLED_TOKEN)
        else:
            want.add(mf.Role.NEXT_TOKEN)
        out = self._engine._execute(e, inputs, want)
        tokens = out[mf.Role.SAMPLED_TOKEN if self.sampler is not None else mf.Role.NEXT_TOKEN][:len(rows)]
        return RunResult(np.asarray(tokens), out[mf.Role.LOGITS][:len(rows)] if logits else None)

    def _sampler_inputs(self, e: mf.Entry, rows: Sequence[Row]) -> dict:
        """The in-body sampler's inputs by role: host arrays for the roles some row needs, the entry's kept neutral
        buffers for the others (nothing uploaded for them)."""
        sp, B = self.sampler, e.batch
        neutral = np.array([NEUTRAL_ROW[c] for c in sp.columns], np.float32)
        params = np.tile(neutral, (B, 1))
        seeds = np.zeros((B, 2), np.int32)
        steps = np.zeros(B, np.int32)
        out: dict = {}
        sampled = [(b, r) for b, r in enumerate(rows) if r.sampling is not None]
        for b, r in sampled:
            params[b] = r.sampling.row(sp.columns)
            seeds[b] = seed_words(r.seed)
            steps[b] = r.step
        if (params != neutral).any():
            out[mf.Role.SAMPLING], out[mf.Role.RNG_SEED], out[mf.Role.RNG_STEP] = params, seeds, steps
        if any(r.mask is not None for _, r in sampled):
            mask = np.full((B, sp.mask_words), -1, np.int32)
            for b, r in sampled:
                if r.mask is not None:
                    mask[b] = r.mask
            out[mf.Role.TOKEN_MASK] = mask
        if any(r.sampling.logit_bias for _, r in sampled):
            ids = np.full((B, sp.logit_bias), -1, np.int32)
            vals = np.zeros((B, sp.logit_bias), np.float32)
            for b, r in sampled:
                pairs = r.sampling.logit_bias
                ids[b, :len(pairs)] = [t for t, _ in pairs]
                vals[b, :len(pairs)] = [v for _, v in pairs]
            out[mf.Role.LOGIT_BIAS_IDS], out[mf.Role.LOGIT_BIAS] = ids, vals
        if any(r.sampling.penalized for _, r in sampled):
            history = np.full((B, e.context), -1, np.int32)
            for b, r in sampled:
                history[b, :len(r.history)] = r.history
            out[mf.Role.TOKEN_HISTORY] = history
        for role in mf.SAMPLER_INPUTS:
            if role not in out:
                out[role] = self._engine._neutral_buffer(e, role)
        return out

    def stats(self) -> dict:
        return self._engine.stats()

    def close(self) -> None:
        self._engine.close()
