"""Greedy ids against an oracle (transformers), tolerating honest near-ties and nothing else.

Two correct implementations whose logits differ by at most D (the tolerance model's bound times the
largest |logit|) can choose different greedy tokens only where the exact logits of the two tokens are
within 2 D of each other. So: both sides run teacher-forced on the oracle's ids; where the argmaxes
differ, the oracle's own logit gap between its token and ours must be at most 2 D. Anything else is a
mismatch (the rule vLLM's `check_logprobs_close` applies with logprobs, here with a bound from the model).

Free-running ids are compared first; they equal teacher-forced ids up to the first divergence, so the
engine is only asked for teacher-forced steps after one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

import margins


class GreedyMismatch(AssertionError):
    """Greedy ids left the oracle's at a step where the oracle's margin exceeds the tolerance model's."""


@dataclass(frozen=True)
class OracleRun:
    """The oracle's greedy ids for a prompt and its logits at each step ([n, V], f32)."""

    ids: list[int]
    logits: np.ndarray


@dataclass(frozen=True)
class NearTie:
    step: int
    oracle_id: int
    got_id: int
    gap: float
    allowed: float


def check_greedy(prompt: Sequence[int], got: Sequence[int], oracle: OracleRun, *, logit_bound: float,
                 next_token: Callable[[list[int]], int]) -> list[NearTie]:
    """Raise GreedyMismatch unless `got` (free-running ids) equals the oracle's up to near-ties; returns them.

    logit_bound: the tolerance model's relative bound on |got logit - oracle logit| (of the largest |logit|).
    next_token(ids): the greedy id the system under test gives after `ids` (teacher forcing).
    """
    want = list(oracle.ids)
    got = list(got)
    if len(got) != len(want):
        raise GreedyMismatch(f"{len(got)} ids, the oracle has {len(want)}")
    ties: list[NearTie] = []
    diverged = False
    for k, want_k in enumerate(want):
        if diverged:
            got_k = int(next_token(list(prompt) + want[:k]))
        else:
            got_k = got[k]
        if got_k == want_k:
            continue
        diverged = True
        logits = np.asarray(oracle.logits[k], np.float64)
        gap = float(logits[want_k] - logits[got_k])
        allowed = 2.0 * logit_bound * float(np.abs(logits).max())
        if not gap <= allowed:
            raise GreedyMismatch(
                f"prompt of {len(prompt)} tokens, step {k}: got id {got_k}, the oracle chose {want_k} by a margin "
                f"of {gap:.4g} (more than the {allowed:.4g} the tolerance model allows); "
                f"got {got[:k + 1]}..., oracle {want[:k + 1]}...")
        ties.append(NearTie(k, want_k, got_k, gap, allowed))
    margins.NEAR_TIES.extend(ties)
    return ties


def check_greedy_batch(prompts: Sequence[Sequence[int]], got: Sequence[Sequence[int]], oracles: Sequence[OracleRun],
                       *, logit_bound: float, next_token: Callable[[list[int]], int]) -> list[NearTie]:
    if len(got) != len(prompts):
        raise GreedyMismatch(f"{len(got)} outputs for {len(prompts)} prompts")
    ties = []
    for prompt, ids, oracle in zip(prompts, got, oracles):
        ties += check_greedy(prompt, ids, oracle, logit_bound=logit_bound, next_token=next_token)
    return ties


def check_served_greedy(engine, prompts: Sequence[Sequence[int]], oracles: Sequence[OracleRun], *, logit_bound: float,
                        new: int) -> None:
    """Through a serving Engine, each prompt alone and then all of them at once give the oracle's greedy ids
    (near-tie rule; teacher forcing through the same engine)."""
    next_token = engine_next_token(engine)
    check_greedy_batch(prompts, [engine.generate([p], new)[0] for p in prompts], oracles, logit_bound=logit_bound,
                       next_token=next_token)
    check_greedy_batch(prompts, engine.generate(prompts, new), oracles, logit_bound=logit_bound, next_token=next_token)


def engine_next_token(engine) -> Callable[[list[int]], int]:
    """Teacher forcing through a serving Engine (or an in-process Model): one greedy token after `ids`."""
    return lambda ids: engine.generate([ids], 1)[0][0]


# -- controls: the same check run on a broken system must raise ----------------------------------------


def transposed_weight(model, slot: str = "attn.o_proj"):
    """An in-process Model with one stacked square projection read transposed (HF's [out, in] taken as
    [in, out], the classic checkpoint-reading bug); attn.o_proj is [H * D, E], square in the tiny models."""
    w = model.weights[slot]
    assert w.shape[-1] == w.shape[-2], f"{slot} {w.shape} is not square"
    return model.with_weights({**model.weights, slot: w.swapaxes(-1, -2)})


def kv_one_slot_off(monkeypatch) -> None:
    """Make the serving engine write each token's keys and values one slot past where they belong (a
    slot-mapping bug), in the full-history and the windowed pools alike."""
    import tlaloc_jax.serve.core.inputs as inputs_module
    real = inputs_module.build_step_inputs

    def shifted(*args, **kwargs):
        out = real(*args, **kwargs)
        for name in ("slot_mapping", "window_slot_mapping"):
            if name in out:
                out[name] = np.where(out[name] >= 0, out[name] + 1, out[name]).astype(np.int32)
        return out

    monkeypatch.setattr(inputs_module, "build_step_inputs", shifted)
