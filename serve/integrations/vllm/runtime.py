"""The plugin's one door into the JAX-free runtime: load an artifact (device, compiled entries, weights, pools) and
run one entry on rows of (token ids, start position, page ids, state slot), getting back each row's token and, when
asked, its logits.

Everything the vLLM worker knows of tlaloc's runtime goes through `ArtifactRuntime`, which stands on the runtime's
`Runner.run` and the engine's input builders (serve/core/inputs.py); nothing here imports vLLM or torch. Pages are
the caller's (vLLM's block manager hands them out), so the engine's scheduler and its pools' bookkeeping stay unused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from tlaloc_jax import artifact as af

from ...core.inputs import sampler_inputs, step_inputs
from ...core.scheduler import ScheduledCall
from ...engine import DEFAULT_CACHE_DIR
from ...host_sampling import Sampling
from ...lora_slots import LoraSlots
from ...runtime.pjrt import Device
from ...runtime.runner import Runner


@dataclass(frozen=True)
class Row:
    """One sequence's part of a call (what paging.build_step_inputs reads of a RowCall, and what the in-body
    sampler's inputs read of a sequence).

    token_ids start at position `start`; `pages` are the sequence's pages in position order (vLLM's block ids),
    `state_slot` its slot in the state pools (-1: none), `ring` its ring of windowed pages. sampling: how to choose the token after the row's last
    one (None: no token is wanted from this row, e.g. a chunk before the end of a prompt). seed: the request's
    random stream; prompt and generated: its tokens so far (the draw's counter is len(generated); penalties read
    both). mask: the packed allowed-token words ([ceil(V / 32)] int32), or None for all tokens. lora_slot: the
    adapter slot the row runs with (0: none; ArtifactRuntime.lora hands them out).
    """

    token_ids: Sequence[int]
    start: int
    pages: Sequence[int]
    state_slot: int = -1
    ring: Sequence[int] = ()
    sampling: Sampling | None = None
    seed: int = 0
    prompt: list[int] = ()
    generated: list[int] = ()
    mask: np.ndarray | None = None
    lora_slot: int = 0


@dataclass
class RunResult:
    """Per row: the chosen token (the in-body sampler's, else the argmax) and, when asked, the logits [V]."""

    tokens: np.ndarray
    logits: np.ndarray | None = None


class ArtifactRuntime:
    """An artifact loaded on a PJRT device: its entries, block size, pools, sampler and adapter slots (adapters in
    a host LRU of max_cpu_loras, 0: as many as the slots)."""

    def __init__(self, artifact_dir: str | Path, *, plugin: str | None = None,
                 cache_dir: str | Path | None = DEFAULT_CACHE_DIR, max_cpu_loras: int = 0):
        t0 = time.perf_counter()
        self.manifest: af.Manifest = af.load_remembering(af.load_manifest, artifact_dir, cache_dir)
        self.runner = Runner(artifact_dir, self.manifest, Device(plugin, cache_dir=cache_dir), progress=False)
        self.block_size = self.manifest.block_size
        self.vocab = self.manifest.model.vocab
        self.sampler: af.SamplerShape | None = self.manifest.sampler
        # The adapter slots' keeper (serve/lora_slots.py) of an artifact staged with them; None without.
        self.lora = None if self.manifest.lora is None else LoraSlots(
            self.manifest.lora, lambda slot, a: self.runner.adapters.write(slot, a.weights, a.scale), max_cpu_loras)
        self.ring_pages = self.manifest.ring.ring_pages if self.manifest.ring else 0
        self._by_kind = {kind: sorted((e for e in self.manifest.entries if e.kind == kind),
                                      key=lambda e: e.size_key) for kind in af.EntryKind}
        self.load_seconds = time.perf_counter() - t0

    def capacity(self, kind: af.PoolKind) -> int:
        return self.manifest.capacity(kind)

    def pick(self, kind: af.EntryKind, batch: int, context: int, tokens: int, total: int = 0) -> af.Entry | None:
        """The smallest entry of `kind` that holds `batch` rows of up to `tokens` tokens reaching `context` (a packed
        prefill: `total` tokens in all)."""
        return next((e for e in self._by_kind[kind] if e.holds(batch, context, tokens, total)), None)

    def run(self, entry: af.Entry, rows: Sequence[Row], *, logits: bool = False) -> RunResult:
        """Run `entry` once on `rows` (right-aligned, as the entry expects; unused rows empty)."""
        call = ScheduledCall(entry, tuple(rows), tuple(rows))
        inputs = step_inputs(call, self.manifest, self.ring_pages)
        want = {af.Role.LOGITS} if logits else set()
        if self.sampler is not None:
            producing = [r.sampling is not None for r in rows]
            inputs.update(sampler_inputs(self.runner, call, producing,
                                         [r.mask if p else None for r, p in zip(rows, producing)]))
            chosen = af.Role.SAMPLED_TOKEN
        else:
            chosen = af.Role.NEXT_TOKEN
        out = self.runner.run(entry, inputs, want | {chosen})
        return RunResult(np.asarray(out[chosen][:len(rows)]), out[af.Role.LOGITS][:len(rows)] if logits else None)

    def close(self) -> None:
        self.runner.close()
