"""tlaloc_jax/kernels/rejection_sampler.py: speculative decoding's acceptance in a verify body.

Sampled rows: on an 8-token vocabulary, DRAWS rows of one verify row (each its own seed) emit the accepted drafts
and one token more; the empirical distribution of what they emit matches the target's, the product of each
position's filtered distribution (in_body_sampler's float64 reference, processed with the history through that
position), by Pearson's chi-square at ALPHA. Controls, each failing the same test: acceptance by the draft's
distribution (min(1, q/q): every draft kept), a rejection drawing from p instead of p without the draft, and
penalties that leave the drafts out of the history. Greedy rows (with and without penalties and bias) keep the drafts
the argmax of each position's processed logits confirms and emit the argmax after them; the same seeds give the
same tokens."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chi_square import chi_square_p
from tlaloc_jax import artifact as af
from tlaloc_jax.kernels import in_body_sampler as S
from tlaloc_jax.kernels import rejection_sampler as R

pytestmark = pytest.mark.numeric

V, T, C, NB = 8, 5, 16, 2
ALPHA = 1e-3        # a correct sampler fails one in a thousand seeds
# 20000 draws: the controls' emitted distributions differ from the target's by 0.1 or more in some category, which
# 20000 draws tell apart at p far below ALPHA; the correct one passes at ALPHA.
DRAWS = 20000
PRIOR = [3, 1, 4, 1, 7, 0]          # the sequence's tokens before the row's last token
GENERATED = 3                       # of which (and the last token) are output tokens: RNG_STEP
ROW = [0, 6, 2, 5, 2]               # column 0 is padding; then the last token and three drafts
POSITIONS = [-1, 6, 7, 8, 9]
# The target's logits at each column: each draft is likely, not certain, after the column before it (draft 2 twice:
# the penalties of the last column count the first).
LOGITS = np.array([[0.0] * V,
                   [0.9, 0.2, 1.6, -0.5, 0.3, 0.1, 0.4, -1.0],
                   [0.1, 0.8, -0.3, 0.6, 0.0, 1.6, -0.7, 0.5],
                   [0.7, -0.2, 1.5, 0.3, 1.0, -0.4, 0.2, 0.0],
                   [0.2, 0.5, -0.6, 1.2, 0.4, 0.0, 0.9, -0.3]], np.float32)


def params_row(**kw) -> list[float]:
    return [float(kw.get(c, af.SAMPLING_NEUTRAL[c])) for c in af.SAMPLING_COLUMNS]


CASES = {"temperature": params_row(temperature=0.9),
         "top_k_top_p": params_row(temperature=1.2, top_k=5, top_p=0.9),
         "min_p": params_row(temperature=1.0, min_p=0.3),
         "penalties_bias": params_row(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5,
                                      frequency_penalty=0.7)}
BIAS = {"penalties_bias": [(6, 0.8), (1, -0.5)]}


def _history(token_ids=ROW, with_drafts: bool = True) -> np.ndarray:
    """TOKEN_HISTORY of the row: the sequence's tokens through its last drafted one (with_drafts False: through its
    last token, as a host that left the drafts out would give)."""
    h = np.full(C, -1, np.int32)
    tokens = PRIOR + list(token_ids[1:] if with_drafts else token_ids[1:2])
    h[:len(tokens)] = tokens
    return h


def _inputs(row, B, bias=(), seeds=None, history=None, logits=LOGITS, token_ids=ROW):
    ids = np.full((B, NB), -1, np.int32)
    vals = np.zeros((B, NB), np.float32)
    for i, (t, v) in enumerate(bias):
        ids[:, i], vals[:, i] = t, v
    seeds = np.stack([np.arange(B), np.full(B, 7)], axis=1).astype(np.int32) if seeds is None else seeds
    return (np.broadcast_to(logits, (B, T, V)), np.tile(np.array(token_ids, np.int32), (B, 1)),
            np.tile(np.array(POSITIONS, np.int32), (B, 1)), np.tile(np.array(row, np.float32), (B, 1)), seeds,
            np.full(B, GENERATED, np.int32), np.full((B, af.mask_words(V)), -1, np.int32), ids, vals,
            np.tile(_history(token_ids) if history is None else history, (B, 1)))


_verify = jax.jit(functools.partial(R.verify_sample, top_n=2))


def _run(*args, patched: bool = False):
    """verify_sample's outputs as numpy; patched: traced afresh, so that a control's monkeypatch is in the body."""
    fn = jax.jit(functools.partial(R.verify_sample, top_n=2)) if patched else _verify
    return [np.asarray(a) for a in fn(*args)]


def _target(row, bias=(), logits=LOGITS, token_ids=ROW) -> list[np.ndarray]:
    """Each column's filtered distribution (reference), the history through that column, steps + drafts before."""
    ids = [t for t, _ in bias] + [-1] * (NB - len(bias))
    vals = [v for _, v in bias] + [0.0] * (NB - len(bias))
    mask = np.full(af.mask_words(V), -1, np.int32)
    history = _history(token_ids)
    out = []
    for j, col in enumerate(range(1, T)):
        x = S.reference_processed(logits[col], row, mask, ids, vals, history, len(PRIOR) + j + 1, GENERATED + j)
        out.append(S.filtered_probs(x, row))
    return out


def _outcomes(tokens, accepted) -> np.ndarray:
    """Each row's emitted tokens (the accepted drafts, then the token at the first rejection or after the last) as
    one category: accepted * V + the last token."""
    last = tokens[np.arange(len(accepted)), 1 + accepted]
    return accepted * V + last


def _expected(dists) -> np.ndarray:
    """The target's probability of each category: the drafts' probabilities, then the last token's; a category whose
    last token is the draft the row would then keep cannot occur."""
    drafts = ROW[2:]
    p = np.zeros(4 * V)
    before = 1.0
    for n in range(4):
        for x in range(V):
            if n < 3 and x == drafts[n]:
                continue
            p[n * V + x] = before * dists[n][x]
        if n < 3:
            before *= dists[n][drafts[n]]
    assert abs(p.sum() - 1) < 1e-9
    return p


def _chi_square(outcomes: np.ndarray, expected: np.ndarray) -> tuple[float, float, int]:
    """(p, statistic, impossible draws): categories of expected count under 5 pooled into one."""
    counts = np.bincount(outcomes, minlength=len(expected)).astype(np.float64)
    impossible = int(counts[expected == 0].sum())
    e = DRAWS * expected
    small = (e < 5) & (expected > 0)
    keep = e >= 5
    c_in, e_in = list(counts[keep]), list(e[keep])
    if small.any():
        c_in.append(counts[small].sum())
        e_in.append(e[small].sum())
    p, stat = chi_square_p(np.array(c_in), np.array(e_in))
    return p, stat, impossible


def _sampled_test(case, patched: bool = False, **kw):
    row, bias = CASES[case], BIAS.get(case, ())
    tokens, accepted, *_ = _run(*_inputs(row, DRAWS, bias, **kw), patched=patched)
    return _chi_square(_outcomes(tokens, accepted), _expected(_target(row, bias))), accepted


@pytest.mark.parametrize("case", sorted(CASES))
def test_speculated_tokens_follow_the_target_distribution(case):
    """DRAWS seeds of one verify row with three drafts: the emitted tokens' joint distribution is the target's
    (chi-square at ALPHA), nothing the target excludes is emitted, and drafts are both kept and rejected."""
    (p, stat, impossible), accepted = _sampled_test(case)
    print(f"{case}: chi-square {stat:.1f}, p = {p:.3f}, accepted per row {accepted.mean():.2f}")
    assert impossible == 0, f"{impossible} draws of a category the target cannot give"
    assert p > ALPHA, f"{case}: chi-square {stat:.1f}, p = {p:.2g}"
    assert 0 < accepted.mean() < 3 and (accepted == 0).any() and (accepted == 3).any()


def test_control_acceptance_by_the_drafts_distribution_fails(monkeypatch):
    """Accepting with min(1, q(d) / q(d)) = 1 (the acceptance draw always 0): the drafts are kept whenever the target
    allows them, and the emitted distribution is no longer the target's."""
    real = S.uniforms
    monkeypatch.setattr(S, "uniforms", lambda seeds, steps, lane=0: jnp.zeros_like(real(seeds, steps))
                        if lane == R.ACCEPT_LANE else real(seeds, steps, lane))
    (p, stat, _), accepted = _sampled_test("temperature", patched=True)
    assert (accepted == 3).all() and p < ALPHA, f"the control passed (chi-square {stat:.1f}, p = {p:.2g})"


def test_control_a_rejection_drawing_from_the_target_fails(monkeypatch):
    """At a rejection, a draw from p itself (the draft not removed): the draft comes out too often."""
    monkeypatch.setattr(R, "residual", lambda weights, draft: weights)
    (p, stat, _), _ = _sampled_test("temperature", patched=True)
    assert p < ALPHA, f"the control passed (chi-square {stat:.1f}, p = {p:.2g})"


def test_control_penalties_without_the_drafts_in_the_history_fail():
    """The history as the sequence stood before its drafts (what a host that forgot them would pass): the penalties
    of the later positions miss the drafts before them."""
    (p, stat, _), _ = _sampled_test("penalties_bias", history=_history(with_drafts=False))
    assert p < ALPHA, f"the control passed (chi-square {stat:.1f}, p = {p:.2g})"


@pytest.mark.parametrize("row", [params_row(), params_row(repetition_penalty=1.6, frequency_penalty=0.9)],
                         ids=["plain", "penalties_bias"])
def test_greedy_rows_keep_the_drafts_the_argmax_confirms(row):
    """Random logits and drafts (often the argmax): the row keeps the drafts equal to each position's argmax of its
    processed logits, the longest such prefix, and emits the argmax after them; the logprob at each column is the
    emitted token's under log_softmax of the raw logits."""
    rng = np.random.default_rng(5)
    bias = [(2, 0.7)] if row != params_row() else []
    for trial in range(30):
        logits = (rng.standard_normal((T, V)) * 1.5).astype(np.float32)
        argmaxes = [int(np.argmax(x)) for x in logits]
        token_ids = [0, 6] + [argmaxes[c] if rng.random() < 0.7 else int(rng.integers(V)) for c in (1, 2, 3)]
        tokens, accepted, logprob, _, _ = _run(*_inputs(row, 1, bias, logits=logits, token_ids=token_ids))
        want = [int(np.argmax(d)) for d in _target(row, bias, logits, token_ids)]
        n = 0
        while n < 3 and want[n] == token_ids[2 + n]:
            n += 1
        assert int(accepted[0]) == n and int(tokens[0, 1 + n]) == want[n], trial
        emitted = token_ids[2:2 + n] + [want[n]]
        lsm = jax.nn.log_softmax(jnp.asarray(logits[1:2 + n]), axis=-1)
        np.testing.assert_allclose(logprob[0, 1:2 + n], np.asarray(lsm)[np.arange(n + 1), emitted], rtol=1e-6)


def test_the_same_seeds_give_the_same_tokens_and_other_seeds_others():
    row = CASES["top_k_top_p"]
    seeds = np.array([[11, 0], [12, 0], [11, 0], [13, 5]] * 64, np.int32)
    tokens, accepted, *_ = _run(*_inputs(row, len(seeds), seeds=seeds))
    again, accepted_again, *_ = _run(*_inputs(row, len(seeds), seeds=seeds))
    assert (tokens == again).all() and (accepted == accepted_again).all()
    assert (tokens[0::4] == tokens[2::4]).all() and (accepted[0::4] == accepted[2::4]).all()
    outcomes = _outcomes(tokens, accepted)
    assert len(set(outcomes[0::4].tolist())) == 1 and len(set(outcomes.tolist())) > 1


@pytest.mark.parametrize("row", [params_row(), CASES["temperature"]], ids=["greedy", "sampled"])
def test_each_column_takes_its_own_mask(row):
    """TOKEN_MASK per column [B, T, W] (a grammar's after each draft): column t's token is the one the row gives with
    column t's mask as its one mask [B, W], for every column, and greedy acceptance follows each column's masked
    argmax. Control: the first column's mask at every column gives other tokens."""
    rng = np.random.default_rng(8)
    masks = np.zeros((T, af.mask_words(V)), np.int32)
    for t in range(T):
        allowed = rng.permutation(V)[:3]                  # three tokens a column, a different three each
        masks[t, 0] = int(sum(1 << int(a) for a in allowed))
    args = list(_inputs(row, 64))
    args[6] = np.broadcast_to(masks, (64, T, masks.shape[1]))
    tokens, accepted, *_ = _run(*args)
    first = None
    for t in range(T):
        args[6] = np.broadcast_to(masks[t], (64, masks.shape[1]))
        alone, *_ = _run(*args)
        assert (tokens[:, t] == alone[:, t]).all(), t
        first = alone if t == 0 else first
        assert all((masks[t, 0] >> int(x)) & 1 for x in tokens[:, t]), t
    assert (tokens[:, 2:] != first[:, 2:]).any()
    if row == params_row():
        ok = [int(tokens[0, c]) == ROW[c + 1] for c in range(1, T - 1)]
        assert int(accepted[0]) == (ok + [False]).index(False)
