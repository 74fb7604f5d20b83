"""The in-process API for notebooks and tests: `load_hf(...)` and `Model.generate(...)`."""

from __future__ import annotations

import functools
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .checkpoint import load_checkpoint
from .config import LINEAR, DecoderConfig
from .decoder import DEFAULT_KEY_BLOCK, Pools, StepInputs, forward, init_pools
from .kernels.in_body_sampler import first_max
from .layout import in_layout
from .serve.core.kv_cache import UnitPool
from .serve.core.paging import RowCall, build_step_inputs, pages_for


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Model:
    """A decoder with its weights on the device, run through the paged decoder under jax.jit."""

    def __init__(self, config: DecoderConfig, weights: dict, *, block_size: int = 16,
                 key_block: int = DEFAULT_KEY_BLOCK, kv_dtype=jnp.float32):
        self.config = config
        self.weights = _on_device(weights)
        self.block_size = block_size
        self.key_block = key_block
        self.kv_dtype = kv_dtype
        step = functools.partial(forward, config, key_block=key_block)
        self._step = jax.jit(step, donate_argnums=(1,))
        self._greedy = jax.jit(lambda w, p, i: _greedy(step, w, p, i), donate_argnums=(1,))

    def with_weights(self, weights: dict) -> "Model":
        """The same decoder with other weights of the same shapes and layout: it shares this Model's jitted calls,
        so it runs what they have compiled (a test's control, a fine-tuned copy) instead of compiling again."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.weights = _on_device(weights)
        return other

    @property
    def has_state(self) -> bool:
        """Whether the model has linear-attention layers: its calls carry state slots."""
        return LINEAR in self.config.layer_types

    def new_pools(self, num_blocks: int, state_slots: int = 0) -> Pools:
        """Zeroed pools of num_blocks pages (and, with linear-attention layers, state_slots state slots)."""
        return init_pools(self.config, num_blocks, self.block_size, self.kv_dtype, state_slots=state_slots)

    def step(self, pools: Pools, inputs: StepInputs | dict) -> tuple[jax.Array, Pools]:
        """One call of the decoder (donates `pools`): -> (last-token logits [B, V], updated pools)."""
        if isinstance(inputs, dict):
            inputs = StepInputs(**{k: jnp.asarray(v) for k, v in inputs.items()})
        return self._step(self.weights, pools, inputs)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16,
                 stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """Greedy decoding: the prompts prefilled together in one call, then decoded together.

        Returns the new ids of each prompt (at most max_new_tokens; a sequence ends after a stop id).
        """
        ids, _ = self._run(prompts, max_new_tokens, stop_token_ids)
        return ids

    def first_logits(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """The logits after each prompt, from one batched prefill call: [len(prompts), V] f32."""
        return self._run(prompts, 1, ())[1]

    def _run(self, prompts, max_new_tokens, stop_token_ids):
        if not prompts:
            return [], np.zeros((0, self.config.vocab_size), np.float32)
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= int(t) < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} holds token id {bad[0]} outside the vocabulary "
                                 f"(size {self.config.vocab_size})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        S = self.block_size
        need = [pages_for(len(p) + max_new_tokens, S) for p in prompts]
        width = _pow2(max(need))
        alloc = UnitPool(_pow2(sum(need)))
        pages = [alloc.take(n) for n in need]
        batch = len(prompts)
        # Prompt b holds state slot b for its life (with linear-attention layers).
        state = self.has_state
        pools = self.new_pools(alloc.num_units, batch if state else 0)

        rows = [RowCall(list(p), 0, pg, state_slot=b) for b, (p, pg) in enumerate(zip(prompts, pages))]
        inputs = build_step_inputs(rows, batch=batch, tokens=_pow2(max(map(len, prompts))), width=width,
                                   block_size=S, state_slots=state)
        nxt, logits, pools = self._greedy(self.weights, pools, StepInputs(**inputs))
        first_logits = np.asarray(logits)
        out = [[int(t)] for t in np.asarray(nxt)]
        stops = set(int(t) for t in stop_token_ids)
        done = [o[-1] in stops for o in out]
        for step in range(1, max_new_tokens):
            if all(done):
                break
            rows = [RowCall([o[-1]], len(p) + step - 1, pg, state_slot=b) if not d else RowCall([], 0, pg)
                    for b, (p, o, pg, d) in enumerate(zip(prompts, out, pages, done))]
            inputs = build_step_inputs(rows, batch=batch, tokens=1, width=width, block_size=S,
                                       state_slots=state)
            nxt, _, pools = self._greedy(self.weights, pools, StepInputs(**inputs))
            for b, t in enumerate(np.asarray(nxt)):
                if not done[b]:
                    out[b].append(int(t))
                    done[b] = int(t) in stops
        return out, first_logits


def _on_device(weights: dict) -> dict:
    """Each slot's arrays on the device (a slot may be a tuple or a QuantizedWeight)."""
    return {k: jax.tree.map(jnp.asarray, v) for k, v in weights.items()}


def _greedy(step, weights, pools, inputs):
    logits, pools = step(weights, pools, inputs)
    return first_max(logits), logits, pools


def load_hf(checkpoint_dir: str | os.PathLike, dtype: str = "float32", *, block_size: int = 16,
            key_block: int = DEFAULT_KEY_BLOCK, weight_layout: str = "stacked", context: int | None = None) -> Model:
    """Load a Hugging Face checkpoint directory (config.json + safetensors) as a Model.

    weight_layout: "stacked" (one [L, ...] array per slot, the layers scanned: what training uses) or
    "per-layer" (what the exporter writes by default: tlaloc_jax.layout). context: the longest sequence the
    model will run, for what depends on it (LongRoPE's factor set: DecoderConfig.with_context); None: the
    checkpoint's original context."""
    cfg, weights = load_checkpoint(checkpoint_dir, dtype)
    if context is not None:
        cfg = cfg.with_context(context)
    return Model(cfg, in_layout(weights, weight_layout), block_size=block_size, key_block=key_block)
