"""tlaloc_jax/kernels/in_body_sampler.py: the sampler every staged entry runs, against its naive float64 form, and its
draws against the filtered distribution (chi-square, fixed seeds).

Controls: a kernel fed the columns in another order, or with the penalties zeroed, fails the comparison; one whose
presence and frequency penalties count the prompt's tokens fails the prompt checks; the draws fail the chi-square
test against the unfiltered distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chi_square import chi_square_p
from margins import assert_within
from tlaloc_jax import artifact as af
from tlaloc_jax.kernels import in_body_sampler as S
from tlaloc_jax.kernels import tolerances as tol
from tlaloc_jax.kernels.tolerances import relative_error
from tlaloc_jax.serve import host_sampling as host

V, C, NB, N = 300, 48, 4, 5
ALPHA = 1e-3          # the chi-square tests' significance: a correct sampler fails one in a thousand seeds


def params_row(**kw) -> list[float]:
    return [float(kw.get(c, af.SAMPLING_NEUTRAL[c])) for c in af.SAMPLING_COLUMNS]


ROWS = [params_row(),                                                     # greedy
        params_row(temperature=0.8),
        params_row(temperature=1.0, top_k=7),
        params_row(temperature=1.3, top_p=0.6),
        params_row(temperature=0.9, min_p=0.08),
        params_row(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01, top_logprobs=1),
        params_row(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.7, frequency_penalty=0.4),
        params_row(temperature=1.1, repetition_penalty=0.8, frequency_penalty=-0.5, top_p=0.95),
        params_row(temperature=1e-30),                                    # tiny: the greedy token
        params_row(temperature=1.0, top_k=V + 10)]                        # top_k past the vocabulary: all of it


def batch(seed=0, rows=ROWS):
    rng = np.random.default_rng(seed)
    B = len(rows)
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    params = np.array(rows, np.float32)
    seeds = rng.integers(-2**31, 2**31, (B, 2)).astype(np.int32)
    steps = rng.integers(0, 1000, B).astype(np.int32)
    allowed = np.ones((B, V), bool)
    allowed[1, ::3] = False
    allowed[5, 100:] = False
    mask = np.stack([host.pack_mask(a) for a in allowed])
    bias_ids = np.full((B, NB), -1, np.int32)
    bias = np.zeros((B, NB), np.float32)
    bias_ids[2, :2], bias[2, :2] = [int(np.argmin(logits[2])), 11], [40.0, -3.0]
    bias_ids[6, 0], bias[6, 0] = 5, 2.5
    history = np.full((B, C), -1, np.int32)
    seq_lens = rng.integers(1, C, B).astype(np.int32)
    for b in range(B):
        history[b, :seq_lens[b]] = rng.integers(0, 30, seq_lens[b])     # repeats among the first 30 ids
    steps = np.minimum(steps, seq_lens).astype(np.int32)
    return [logits, params, seeds, steps, mask, bias_ids, bias, history, seq_lens]


_sample = jax.jit(lambda *a: S.sample_tokens(*a, top_n=N))
_process = jax.jit(lambda l, p, s, st, m, bi, b, h, sl: S.process_logits(l, p, m, bi, b, h, sl, st))
_kept = jax.jit(S.kept_tokens)


def _unrecorded(err: float, bound: float, what: str) -> None:
    """A control's check: raises like assert_within, without entering the margins report."""
    assert err <= bound, f"{what}: {err:.3g} over {bound:.3g}"


def compare(args, kernel_args=None, within=assert_within):
    """The kernel (on kernel_args, default args) against the reference on args: processed logits, kept sets,
    tokens, logprobs. Raises AssertionError on a difference beyond the tolerance model."""
    kernel_args = args if kernel_args is None else kernel_args
    logits, params = args[0], args[1]
    tokens, logprob, top, top_ids = (np.asarray(x) for x in _sample(*kernel_args))
    x = np.asarray(_process(*kernel_args))
    kept = np.asarray(_kept(x, kernel_args[1]))
    want_tokens, want_lp, want_top, want_ids, dists = S.sample_reference(*args, top_n=N)
    # Processed logits: a bias, a penalty and a mask are one or two roundings on the logit.
    want_x = np.stack([S.reference_processed(logits[b], params[b], args[4][b], args[5][b], args[6][b], args[7][b],
                                             int(args[8][b]), int(args[3][b])) for b in range(len(logits))])
    finite = np.isfinite(want_x)
    assert (np.isfinite(x) == finite).all(), "the mask differs"
    within(relative_error(x[finite], want_x[finite]), tol.bound(3), "processed logits")
    for b in range(len(logits)):
        if params[b][0] > 0:
            # Kept with a weight exp(z) that is not zero (a tiny temperature underflows all but the largest).
            weight = np.exp((want_x[b] - np.max(want_x[b])) / params[b][0]) > 0
            np.testing.assert_array_equal(kept[b] & weight, dists[b] > 0, err_msg=f"row {b}: kept tokens")
    np.testing.assert_array_equal(tokens, want_tokens)
    # log_softmax: a max, a subtraction, exp, a V-term sum, log, a subtraction.
    lp_bound = tol.bound(V + 2 * tol.TRANSCENDENTAL_ULPS + 2)
    within(relative_error(logprob, want_lp), lp_bound, "chosen token's logprob")
    within(relative_error(top, want_top), lp_bound, "top logprobs")
    np.testing.assert_array_equal(top_ids, want_ids)


def no_draw_at_a_boundary(args, what: str) -> None:
    """The precondition that keeps the comparison exact: no draw within the tolerance model of a CDF boundary (a
    nearer one may fall either way on another CPU, for both implementations are correct)."""
    _, _, _, _, dists = S.sample_reference(*args, top_n=N)
    u = np.asarray(S.uniforms(jnp.asarray(args[2]), jnp.asarray(args[3])), np.float64)
    for b, row in enumerate(args[1]):
        if row[0] > 0:
            cdf = np.cumsum(dists[b])
            assert np.min(np.abs(cdf - u[b])) > 1e-4, f"{what} row {b}: a draw at a CDF boundary"


@pytest.mark.numeric
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_equals_the_reference(seed):
    args = batch(seed)
    no_draw_at_a_boundary(args, f"seed {seed}")
    compare(args)


@pytest.mark.numeric
def test_controls_fail():
    args = batch(0)
    swapped = list(args)
    cols = list(af.SAMPLING_COLUMNS)
    order = [cols.index(c) for c in ("temperature", "top_k", "top_p") + tuple(cols[3:])]
    swapped[1] = args[1][:, order]                       # top_p and top_k read from each other's column
    with pytest.raises(AssertionError):
        compare(args, swapped, _unrecorded)
    no_penalty = list(args)
    no_penalty[1] = args[1].copy()
    no_penalty[1][:, 4:7] = [0.0, 0.0, 1.0]
    with pytest.raises(AssertionError):
        compare(args, no_penalty, _unrecorded)


def prompt_check(seed: int, within=assert_within) -> None:
    """The kernel against the reference on rows whose first half of history is their prompt: presence and frequency
    penalties count only the output half, the repetition penalty both (batch() draws steps near seq_lens: there
    nearly every token is an output token)."""
    args = batch(seed)
    args[3] = (args[8] // 2).astype(np.int32)
    assert (args[3] < args[8]).all()
    no_draw_at_a_boundary(args, f"seed {seed}, prompt halves:")
    compare(args, within=within)


@pytest.mark.numeric
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_leave_prompt_tokens_to_the_repetition_penalty(seed):
    prompt_check(seed)


def hand_check(within=assert_within) -> None:
    """One row worked by hand through the kernel, the reference and the host sampler: prompt [1, 1, 2], output
    [2, 3, 3]; repetition 2 divides (or, below zero, multiplies) tokens 1, 2 and 3, presence 0.5 and frequency
    0.25 reach only 2 (once) and 3 (twice). Token 1, repeated in the prompt alone, is not charged for it."""
    logits = np.array([[1.0, 3.0, 2.0, -1.0, 0.5, 4.0]], np.float32)
    want = np.array([1.0, 3.0 / 2, 2.0 / 2 - 0.75, -1.0 * 2 - 1.0, 0.5, 4.0])
    row = params_row(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    history, vocab = [1, 1, 2, 2, 3, 3], logits.shape[1]
    args = [logits, np.array([row], np.float32), np.zeros((1, 2), np.int32), np.array([3], np.int32),
            np.full((1, af.mask_words(vocab)), -1, np.int32), np.full((1, 1), -1, np.int32),
            np.zeros((1, 1), np.float32), np.array([history + [-1, -1]], np.int32), np.array([6], np.int32)]
    sampling = host.Sampling(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    for name, got in (("kernel", np.asarray(_process(*args))[0]),
                      ("reference", S.reference_processed(logits[0], row, args[4][0], args[5][0], args[6][0],
                                                          args[7][0], 6, 3)),
                      ("host", host.processed(logits[0], sampling, history, 3, None))):
        within(relative_error(got, want), tol.bound(3), f"{name}: penalised logits worked by hand")


@pytest.mark.numeric
def test_penalties_of_a_row_worked_by_hand():
    hand_check()


@pytest.mark.numeric
def test_control_penalties_that_count_prompt_tokens_are_caught(monkeypatch):
    """The planted bug: presence and frequency penalties over the whole history (every token an output token). Both
    prompt checks pass on the kernel as it is and fail on it; the jit caches are cleared so that the kernel is
    traced again with it, and after it."""
    real = S._penalize
    prompt_check(0, _unrecorded)
    hand_check(_unrecorded)
    monkeypatch.setattr(S, "_penalize", lambda x, params, history, seq_lens, steps: real(x, params, history,
                                                                                          seq_lens, seq_lens))
    jax.clear_caches()
    try:
        for seed in (0, 1, 2):
            with pytest.raises(AssertionError):
                prompt_check(seed, _unrecorded)
        with pytest.raises(AssertionError, match="kernel: penalised logits"):
            hand_check(_unrecorded)
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_a_default_request_fills_the_neutral_row():
    assert host.GREEDY.row(af.SAMPLING_COLUMNS) == [af.SAMPLING_NEUTRAL[c] for c in af.SAMPLING_COLUMNS]
    assert host.Sampling(temperature=0.5, logprobs=2).row(("top_logprobs", "temperature")) == [1.0, 0.5]


def test_greedy_is_exactly_argmax_and_masks_pack_as_the_kernel_reads_them():
    rng = np.random.default_rng(5)
    args = batch(3, [params_row()] * 10)
    args[4] = np.full_like(args[4], -1)
    args[5] = np.full_like(args[5], -1)
    # Near-ties on purpose: equal maxima (the first wins) and values a rounding apart.
    args[0][0, [10, 20]] = 50.0
    args[0][1, 7], args[0][1, 8] = 9.0, np.nextafter(np.float32(9.0), np.float32(10))
    args[0][2:] = rng.standard_normal((8, V)).astype(np.float32)
    tokens = np.asarray(_sample(*args)[0])
    np.testing.assert_array_equal(tokens, np.argmax(args[0], axis=-1))
    allowed = rng.random((3, 70)) < 0.3
    words = np.stack([host.pack_mask(a) for a in allowed])
    np.testing.assert_array_equal(np.asarray(S.unpack_mask(jnp.asarray(words), 70)), allowed)
    np.testing.assert_array_equal(np.stack([host.unpack_mask(w, 70) for w in words]), allowed)


def test_first_max_is_argmax_with_ties_nans_and_infinities():
    """first_max (the greedy token in every body) gives jnp.argmax's index: the first of equal maxima, the first
    NaN where a row has one, +inf over finite values, 0 for a row of -inf, -0.0 equal to 0.0. Control: the last of
    equal maxima disagrees on the tied rows."""
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, (40, 33)).astype(np.float32)       # small integers: most rows tie at their maximum
    x[1, [4, 9]] = np.nan
    x[2] = -np.inf
    x[3, 30], x[3, 2] = np.inf, np.inf
    x[4] = 0.0
    x[4, 0] = -0.0
    x[5, 5], x[5, 6] = 7.0, np.nextafter(np.float32(7.0), np.float32(8))
    got = np.asarray(jax.jit(S.first_max)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert list(got[1:6]) == [4, 0, 2, 0, 6]
    last = x.shape[1] - 1 - np.argmax(x[:, ::-1], axis=-1)
    assert (last != got).sum() > 10


@pytest.mark.numeric
def test_a_rows_token_is_the_same_in_any_batch():
    """Counter-based draws and row-wise work: each row's token is its own, alone or beside rows that make the
    batch take the other branch of every lax.cond (top-k / top-p, penalties, top logprobs, all greedy)."""
    args = batch(7)
    together = np.asarray(_sample(*args)[0])
    for b in range(len(ROWS)):
        alone = np.asarray(_sample(*[a[b:b + 1] for a in args])[0])
        assert alone[0] == together[b], f"row {b}"
        pair = np.asarray(_sample(*[a[[b, 5]] for a in args])[0])
        assert pair[0] == together[b], f"row {b} beside row 5"


DRAWS = 20000
CASES = {"temperature": params_row(temperature=0.7), "top_k": params_row(temperature=1.0, top_k=6),
         "top_p": params_row(temperature=1.2, top_p=0.8), "min_p": params_row(temperature=1.0, min_p=0.15)}


def _draws(row, vocab=24, seed=11):
    logits = (np.random.default_rng(seed).standard_normal(vocab) * 1.5).astype(np.float32)
    B = DRAWS
    args = [np.tile(logits, (B, 1)), np.tile(np.array(row, np.float32), (B, 1)),
            np.tile(np.array([123456789, 42], np.int32), (B, 1)), np.arange(B, dtype=np.int32),
            np.full((B, af.mask_words(vocab)), -1, np.int32), np.full((B, 1), -1, np.int32), np.zeros((B, 1), np.float32),
            np.full((B, 1), -1, np.int32), np.ones(B, np.int32)]
    tokens = np.asarray(jax.jit(lambda *a: S.sample_tokens(*a, top_n=0))(*args)[0])
    return logits, np.bincount(tokens, minlength=vocab)


@pytest.mark.numeric
@pytest.mark.parametrize("case", sorted(CASES))
def test_draws_follow_the_filtered_distribution(case):
    """20000 draws of one row (one seed, steps 0..19999) against the reference's filtered distribution: Pearson's
    chi-square over the kept tokens, significance 1e-3; no draw outside them. Control: the same counts against
    the distribution before the filter (for temperature: at temperature 1), over every token, are rejected."""
    row = CASES[case]
    logits, counts = _draws(row)
    dist = S.filtered_probs(logits.astype(np.float64), row)
    kept = dist > 0
    assert counts[~kept].sum() == 0, f"{counts[~kept].sum()} draws outside the kept tokens"
    p, stat = chi_square_p(counts[kept], DRAWS * dist[kept])
    print(f"{case}: chi-square {stat:.1f} over {kept.sum() - 1} degrees of freedom, p = {p:.3f}")
    assert p > ALPHA, f"{case}: chi-square {stat:.1f}, p = {p:.2g}"
    unfiltered = params_row(temperature=1.0 if case == "temperature" else row[0])
    p_control, _ = chi_square_p(counts, DRAWS * S.filtered_probs(logits.astype(np.float64), unfiltered))
    assert p_control < ALPHA, f"{case}: the control passed (p = {p_control:.2g})"
