"""The verify body's decode form (export/_verify.py, SplitStep.verify): a verify call's k + 1 tokens a row through the
decode entries' kernels (the C projections, and the C decode attention with each token a row of its own,
tlaloc_jax.packing.query_rows), in process on the demo model. Each position's logits are those the decode calls give
it, within the tolerance model; the form holds both kernels, and with XLA's options none.

Controls: a causal limit one key short (each token not seeing its own key) and a comparison one position off are far
outside the bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from margins import assert_within
from tlaloc_jax import decoder, packing
from tlaloc_jax.checkpoint import DEMO_MODEL
from tlaloc_jax.inputs import StepInputs
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.paged_attention_native import NATIVE_DECODE_ATTENTION
from tlaloc_jax.kernels.projection_native import NATIVE_PROJECTION, native_projections
from tlaloc_jax.serve.core.paging import RowCall, build_step_inputs

pytestmark = pytest.mark.numeric

B, T, BLOCK, WIDTH = 2, 5, 16, 4          # two rows of a last token and 4 drafts, 64 positions a row


@pytest.fixture(scope="module")
def demo():
    import tlaloc_jax
    return tlaloc_jax.load_hf(DEMO_MODEL, block_size=BLOCK, weight_layout="per-layer")


def _inputs(rows: list[RowCall], tokens: int) -> StepInputs:
    fields = build_step_inputs(rows, batch=B, tokens=tokens, width=WIDTH, block_size=BLOCK)
    return StepInputs(**{k: jnp.asarray(v) for k, v in fields.items()})


def verify_logits(cfg, weights, pools, inputs: StepInputs, native: bool) -> jax.Array:
    """The verify body's step in its decode form (native: the C kernels; else XLA's options) -> logits [B, T, V]."""
    with native_projections(native):
        hidden, _ = decoder.final_hidden(cfg, weights, pools, inputs, all_positions=True, query_rows=True,
                                         decode_attention="native" if native else "xla")
        return decoder.logits_from_hidden(cfg, weights, hidden.reshape(B * T, -1)).reshape(B, T, -1)


@pytest.fixture(scope="module")
def calls(demo):
    """(pools after each row's prompt, the verify call's inputs, the logits of the same tokens by decode calls
    [B, T, V]): row 1's tokens right-aligned after a padding column, so an empty query row is covered."""
    cfg, weights = demo.config, demo.weights
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4000, 21).tolist(), rng.integers(3, 4000, 33).tolist()]
    drafts = [rng.integers(3, 4000, T).tolist(), rng.integers(3, 4000, T - 1).tolist()]
    pages = [list(range(b * WIDTH, (b + 1) * WIDTH)) for b in range(B)]
    pools = demo.new_pools(B * WIDTH)
    step = jax.jit(lambda p, i: decoder.forward(cfg, weights, p, i, decode_attention="native", projections="native"))
    _, pools = step(pools, _inputs([RowCall(p, 0, g) for p, g in zip(prompts, pages)], 40))
    decoded, p = np.zeros((B, T, cfg.vocab_size), np.float32), pools
    for t in range(T):
        rows = [RowCall([d[t - T + len(d)]] if t >= T - len(d) else [], len(pr) + t - T + len(d), g)
                for d, pr, g in zip(drafts, prompts, pages)]
        logits, p = step(p, _inputs(rows, 1))
        for b in range(B):
            if rows[b].token_ids:
                decoded[b, t] = np.asarray(logits[b])
    return pools, _inputs([RowCall(d, len(pr), g) for d, pr, g in zip(drafts, prompts, pages)], T), decoded


def _worst(got: np.ndarray, want: np.ndarray, shift: int = 0) -> float:
    """max |got - want| over the positions both hold (row 1 has no first column); shift: want one position on."""
    live = [(0, t) for t in range(T - shift)] + [(1, t) for t in range(1, T - shift)]
    return max(float(np.abs(got[b, t] - want[b, t + shift]).max()) for b, t in live)


def test_the_decode_form_scores_each_position_as_decode_calls_do(demo, calls, monkeypatch):
    cfg, weights = demo.config, demo.weights
    pools, inputs, want = calls
    bound = tol.bound(tol.decoder_roundings_of(cfg, context=WIDTH * BLOCK)) * np.abs(want).max()
    form = jax.jit(lambda p, i: verify_logits(cfg, weights, p, i, native=True))
    got = np.asarray(form(pools, inputs))
    assert_within(_worst(got, want), bound, "verify form against decode calls")
    assert (got[0].argmax(-1) == want[0].argmax(-1)).all() and (got[1, 1:].argmax(-1) == want[1, 1:].argmax(-1)).all()
    assert _worst(got, want, shift=1) > 10 * bound, "control: one position off passes"
    # Control: each token one key short of its own position, as an off-by-one causal limit would leave it.
    real = packing.query_rows

    def short(inputs):
        rows = real(inputs)
        return rows._replace(seq_lens=jnp.maximum(rows.seq_lens - 1, 0))
    monkeypatch.setattr(decoder, "one_token_rows", short)
    bad = np.asarray(jax.jit(lambda p, i: verify_logits(cfg, weights, p, i, native=True))(pools, inputs))
    assert _worst(bad, want) > 10 * bound, "control: a causal limit one key short passes"


def test_the_decode_form_holds_the_kernels_and_xla_options_none(demo, calls):
    cfg, weights = demo.config, demo.weights
    pools, inputs, _ = calls
    for native in (True, False):
        text = jax.jit(lambda p, i: verify_logits(cfg, weights, p, i, native)).lower(pools, inputs).as_text()
        for target in (NATIVE_PROJECTION, NATIVE_DECODE_ATTENTION):
            assert (target in text) == native, (target, native)
