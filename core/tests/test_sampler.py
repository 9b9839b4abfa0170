"""The reference sampler against exact distributions and hand-computed logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from lmdock import SamplingParams
from lmdock._engine.sampler import apply_penalties, mask_min_tokens
from lmdock.backend import ReferenceSampler, SampleRow

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
DRAWS = 20_000


def expected(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Written out plainly, independently of the sampler's vectorised code."""
    p = [math.exp(x / temperature) for x in logits.tolist()]
    total = sum(p)
    p = [x / total for x in p]
    top = max(p)
    keep = [x >= min_p * top for x in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    if top_k:
        for rank, i in enumerate(order):
            keep[i] = keep[i] and rank < top_k
    if top_p < 1.0:
        mass = sum(p[i] for i in range(len(p)) if keep[i])
        before = 0.0
        for i in order:
            if not keep[i]:
                continue
            if before >= top_p:
                keep[i] = False
            before += p[i] / mass
    q = [x if k else 0.0 for x, k in zip(p, keep)]
    s = sum(q)
    return np.array([x / s for x in q])


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


MODES = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.8},
    {"top_k": 3},
    {"top_p": 0.8},
    {"min_p": 0.2},
    {"temperature": 1.3, "top_k": 5, "top_p": 0.9},
    {"temperature": 0.9, "min_p": 0.1, "top_p": 0.7},
    {"top_k": 4, "min_p": 0.3},
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_empirical_distribution_matches_exact(mode: dict) -> None:
    params = SamplingParams(seed=1, **mode)
    row = SampleRow(params, [1], 1, np.random.default_rng(12345))
    sampler = ReferenceSampler()
    logits = LOGITS[None, :]
    counts = np.zeros(len(LOGITS))
    for _ in range(DRAWS):
        counts[sampler.sample(logits, [row])[0].token] += 1
    want = expected(LOGITS, **mode)
    assert counts[want == 0].sum() == 0, "drew a token outside the allowed set"
    support = want > 0
    exp_counts = want[support] * DRAWS
    stat = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    dof = int(support.sum()) - 1
    if dof > 0:
        assert stat < chi2_critical(dof), (stat, counts, want)


def test_a_wrong_distribution_is_detected() -> None:
    """The test above can fail: uniform draws are far from the softmax."""
    counts = np.full(len(LOGITS), DRAWS / len(LOGITS))
    want = expected(LOGITS)
    stat = float(((counts - want * DRAWS) ** 2 / (want * DRAWS)).sum())
    assert stat > chi2_critical(len(LOGITS) - 1)


def test_greedy_modes_are_argmax() -> None:
    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32)
    sampler = ReferenceSampler()
    for params in (SamplingParams(temperature=0), SamplingParams(top_k=1, seed=3)):
        rows = [SampleRow(params, [1], 1, np.random.default_rng(i)) for i in range(6)]
        assert [s.token for s in sampler.sample(logits, rows)] == logits.argmax(axis=1).tolist()


def test_penalties_match_hand_computed_logits() -> None:
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    row = SampleRow(params, [0, 1, 2, 2, 1], prompt_len=2, rng=np.random.default_rng(0))
    out = apply_penalties(np.array([1.0, -1.0, 2.0, 0.5], dtype=np.float32), row)
    # repetition over prompt+output {0,1,2}: 1/1.5, -1*1.5, 2/1.5; token 3 unseen.
    # frequency over output counts {2: 2, 1: 1}; presence once for tokens 1 and 2.
    want = [1 / 1.5, -1.5 - 0.5 * 1 - 0.25, 2 / 1.5 - 0.5 * 2 - 0.25, 0.5]
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_min_new_tokens_masks_eos_and_stop_tokens() -> None:
    params = SamplingParams(min_new_tokens=2, stop_token_ids=[3])
    row = SampleRow(params, [1, 5], prompt_len=1, rng=np.random.default_rng(0), eos_token_ids=(2,))
    out = mask_min_tokens(np.zeros(6, dtype=np.float32), row)
    assert np.isneginf(out[[2, 3]]).all() and np.isfinite(out[[0, 1, 4, 5]]).all()
    row.token_ids.append(4)
    assert np.isfinite(mask_min_tokens(np.zeros(6, dtype=np.float32), row)).all()


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    params = SamplingParams(temperature=0, logprobs=3)
    row = SampleRow(params, [1], 1, np.random.default_rng(0))
    s = ReferenceSampler().sample(LOGITS[None, :], [row])[0]
    lp = LOGITS - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert s.token == 0 and s.rank == 1
    assert s.logprob == pytest.approx(lp[0], abs=1e-6)
    assert [t for t, _ in s.top] == [0, 1, 2]
    np.testing.assert_allclose([v for _, v in s.top], lp[:3], atol=1e-6)


def _bias_row(params: SamplingParams, token_ids: list[int], prompt_len: int = 1, bad: tuple = ()) -> SampleRow:
    return SampleRow(params, token_ids, prompt_len, np.random.default_rng(params.seed), bad_words_ids=bad)


def test_logit_bias_is_added_before_sampling_and_logprobs_stay_raw() -> None:
    # LOGITS' argmax is token 0; -100 bans it, +100 on token 6 makes it the greedy choice
    banned = ReferenceSampler().sample(LOGITS[None, :], [_bias_row(SamplingParams(temperature=0, logit_bias={0: -100}), [1])])[0]
    assert banned.token == 1
    forced = ReferenceSampler().sample(LOGITS[None, :], [_bias_row(SamplingParams(temperature=0, logprobs=0, logit_bias={6: 100}), [1])])[0]
    lp = LOGITS - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert forced.token == 6 and forced.logprob == pytest.approx(lp[6], abs=1e-6) and forced.rank == 7


def test_a_small_logit_bias_shifts_the_distribution_exactly() -> None:
    bias = {1: 0.5, 3: -1.0}
    params = SamplingParams(temperature=1.0, seed=0, logit_bias=bias)
    row = _bias_row(params, [1])
    tokens = [s.token for s in ReferenceSampler().sample(np.repeat(LOGITS[None, :], DRAWS, axis=0), [row] * DRAWS)]
    shifted = LOGITS.copy()
    for t, b in bias.items():
        shifted[t] += b
    want = expected(shifted) * DRAWS
    counts = np.bincount(tokens, minlength=len(LOGITS))
    stat = sum((c - w) ** 2 / w for c, w in zip(counts, want) if w > 0)
    assert stat < chi2_critical(len(LOGITS) - 1)


def test_allowed_token_ids_mask_every_other_token() -> None:
    rows = [_bias_row(SamplingParams(temperature=1.5, seed=i, allowed_token_ids=(5, 7)), [1]) for i in range(200)]
    tokens = {s.token for s in ReferenceSampler().sample(np.repeat(LOGITS[None, :], 200, axis=0), rows)}
    assert tokens == {5, 7}  # both drawn, nothing else (token 7's logit is the lowest)


def test_bad_words_ban_the_last_token_after_their_prefix_in_the_output() -> None:
    params = SamplingParams(temperature=0, bad_words=("x",))
    bad = ((0,), (3, 1))  # token 0 anywhere; token 1 right after token 3
    sampler = ReferenceSampler()
    assert sampler.sample(LOGITS[None, :], [_bias_row(params, [9, 3], prompt_len=1, bad=bad)])[0].token == 2
    assert sampler.sample(LOGITS[None, :], [_bias_row(params, [9, 4], prompt_len=1, bad=bad)])[0].token == 1
    # the prefix must be output, not prompt (vLLM checks generated tokens only)
    assert sampler.sample(LOGITS[None, :], [_bias_row(params, [9, 3], prompt_len=2, bad=bad)])[0].token == 1
    with pytest.raises(ValueError, match="bad_words_ids"):
        SampleRow(params, [1], 1, np.random.default_rng(0))  # the sampler cannot tokenize: it is told the sequences


def test_biased_rows_are_not_argmax_only_and_batch_like_alone() -> None:
    logits = np.random.default_rng(1).normal(size=(4, 16)).astype(np.float32)
    top = logits.argmax(axis=1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={int(top[1]): -100}),
              SamplingParams(temperature=0, allowed_token_ids=(3,)), SamplingParams(temperature=0.7, seed=2, logit_bias={4: 50})]
    rows = [_bias_row(p, [1]) for p in params]
    assert [r.plain for r in rows] == [True, False, False, False]
    batched = [s.token for s in ReferenceSampler().sample(logits, rows)]
    alone = [ReferenceSampler().sample(logits[i : i + 1], [_bias_row(p, [1])])[0].token for i, p in enumerate(params)]
    assert batched == alone and batched[0] == top[0] and batched[1] != top[1] and batched[2:] == [3, 4]


def test_no_token_left_fails_the_row() -> None:
    from lmdock import RequestError

    row = _bias_row(SamplingParams(temperature=0, allowed_token_ids=(0,), bad_words=("x",)), [1], bad=((0,),))
    with pytest.raises(RequestError, match="no token"):
        ReferenceSampler().sample(LOGITS[None, :], [row])


# --- issue 44: the partial selection against a plain full sort -------------------------------------


def full_sort_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The pipeline's steps 6-8 as the sampler defined them before issue 44: float64 softmax over the
    whole row, then stable sorts of the whole row for top_k and top_p (ties by token id)."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if min_p > 0:
        p[p < min_p * p.max()] = 0.0
    if 0 < top_k < p.size:
        p[np.argsort(-p, kind="stable")[top_k:]] = 0.0
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        sp = p[order] / p.sum()
        p[order[np.cumsum(sp) - sp >= top_p]] = 0.0
    return p / p.sum()


def selected_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    from lmdock._engine.sampler import kept_tokens, scaled_weights

    y, e = scaled_weights(logits.astype(np.float32).copy(), params)
    ids, w = kept_tokens(y, e, params)
    out = np.zeros(logits.shape[-1])
    out[ids] = w / w.sum(dtype=np.float64)
    return out


def _rows(kind: str, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":  # flat: top_p keeps thousands
        return rng.normal(0, 2, vocab).astype(np.float32)
    if kind == "peaked":  # like a trained model: a few tokens hold the mass
        x = rng.normal(0, 1.5, vocab).astype(np.float32)
        x[rng.choice(vocab, 5, replace=False)] += np.array([12, 11, 10.5, 9, 8], dtype=np.float32)
        return x
    if kind == "ties":  # quarter steps: many equal logits at every boundary
        return (np.round(rng.normal(0, 1, vocab) * 4) / 4).astype(np.float32)
    x = rng.normal(0, 2, vocab).astype(np.float32)  # "masked": most of the row at -inf
    x[rng.random(vocab) < 0.9] = -np.inf
    return x


SELECTIONS = [
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 1.3, "top_p": 0.999},
    {"temperature": 0.7, "top_k": 40},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1.0, "top_k": 700, "top_p": 0.8},
    {"temperature": 0.9, "min_p": 0.05},
    {"temperature": 1.1, "min_p": 0.01, "top_k": 300, "top_p": 0.95},
    {"temperature": 0.6, "top_p": 1.0},
]


@pytest.mark.parametrize("kind", ["normal", "peaked", "ties", "masked"])
@pytest.mark.parametrize("mode", SELECTIONS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_selection_keeps_what_a_full_sort_keeps(kind: str, mode: dict) -> None:
    """Vocabularies past the point where the rounds start (SMALL): the same kept set, the same
    probabilities."""
    for vocab, seed in ((5_000, 1), (40_000, 2)):
        logits = _rows(kind, vocab, seed)
        want = full_sort_probs(logits, **mode)
        got = selected_probs(logits, SamplingParams(**mode))
        assert np.array_equal(got > 0, want > 0), (kind, vocab, int((got > 0).sum()), int((want > 0).sum()))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-12)


def test_ties_at_the_top_k_boundary_keep_the_lowest_token_ids() -> None:
    logits = np.zeros(3_000, dtype=np.float32)
    logits[[2500, 7, 1200]] = 1.0  # three equal leaders: top_k=2 keeps ids 7 and 1200
    got = selected_probs(logits, SamplingParams(top_k=2))
    assert np.flatnonzero(got).tolist() == [7, 1200]
    # all tied: top_k keeps the first k ids, top_p the first ceil(top_p * V)
    flat = np.zeros(1_000, dtype=np.float32)
    assert np.flatnonzero(selected_probs(flat, SamplingParams(top_k=5))).tolist() == [0, 1, 2, 3, 4]
    assert np.flatnonzero(selected_probs(flat, SamplingParams(top_p=0.0105))).tolist() == list(range(11))


def test_top_k_and_top_p_select_from_what_bias_and_allowed_ids_leave() -> None:
    """allowed_token_ids and logit_bias come first (step 2): the selection sees the masked row."""
    logits = _rows("normal", 20_000, 3)
    allowed = tuple(range(100, 20_000, 37))
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1, allowed_token_ids=allowed, logit_bias={137: 30.0})
    row = _bias_row(params, [1])
    biased = logits.copy()
    row.bias.apply(biased, row.token_ids, row.num_output)
    want = full_sort_probs(biased, 0.9, 50, 0.9)
    assert set(np.flatnonzero(want)) <= set(allowed) and want[137] > 0.99
    tokens = {ReferenceSampler().sample(logits[None, :], [row])[0].token for _ in range(50)}
    assert tokens <= set(np.flatnonzero(want).tolist()) and 137 in tokens


def test_penalties_touch_only_the_seen_tokens_and_count_repeats() -> None:
    vocab = 10_000
    logits = _rows("normal", vocab, 4)
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
    prompt, output = [5, 9, 5], [9, 42, 42, 42, 7]
    row = SampleRow(params, prompt + output[:2], len(prompt), np.random.default_rng(0))
    apply_penalties(logits.copy(), row)  # counts kept so far; the rest arrive one token at a time
    row.token_ids.extend(output[2:])
    got = apply_penalties(logits.copy(), row)
    want = logits.astype(np.float64)
    for t in {5, 9, 42, 7}:
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t, n in {9: 1, 42: 3, 7: 1}.items():
        want[t] -= 0.4 * n + 0.3
    np.testing.assert_allclose(got, want, rtol=1e-6)
    untouched = np.setdiff1d(np.arange(vocab), [5, 9, 42, 7])
    assert np.array_equal(got[untouched], logits[untouched])


def test_the_draw_is_the_inverse_cdf_over_the_whole_row() -> None:
    """The same uniform picks the same token as a CDF over all V tokens in id order, so seeded
    samples are the ones the full-sort sampler drew (up to float rounding at a CDF step)."""
    logits = _rows("normal", 30_000, 5)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    probs = full_sort_probs(logits, 0.8, top_p=0.9)
    cdf = np.cumsum(probs)
    row = SampleRow(params, [1], 1, np.random.default_rng(7))
    mirror = np.random.default_rng(7)
    for _ in range(200):
        token = ReferenceSampler().sample(logits[None, :], [row])[0].token
        assert token == min(int((cdf <= mirror.random() * cdf[-1]).sum()), cdf.size - 1)


def test_logprob_top_entries_are_the_k_best_with_ties_by_id() -> None:
    logits = _rows("ties", 8_000, 6)
    s = ReferenceSampler().sample(logits[None, :], [SampleRow(SamplingParams(temperature=0, logprobs=20), [1], 1, np.random.default_rng(0))])[0]
    lp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    order = np.argsort(-lp, kind="stable")[:20]
    assert [t for t, _ in s.top] == order.tolist()
    np.testing.assert_allclose([v for _, v in s.top], lp[order], atol=1e-5)
    assert s.rank == 1 and s.token == order[0]


@pytest.mark.parametrize("mode", SELECTIONS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_small_vocabularies_sort_whole_rows_to_the_same_draws(mode: dict) -> None:
    """Up to FULL_SORT_VOCAB tokens the sampler sorts whole rows, batch-wide: the same kept sets,
    probabilities and (one uniform per row, the CDF in token-id order) the same tokens."""
    from lmdock._engine.sampler import (
        FULL_SORT_VOCAB,
        _sample_small,
        draw,
        full_sort_distributions,
        kept_tokens,
        scaled_weights,
    )

    logits = np.stack([_rows(kind, 2_000, 7) for kind in ("normal", "peaked", "ties", "masked")])
    assert logits.shape[-1] <= FULL_SORT_VOCAB
    params = SamplingParams(seed=3, **mode)
    whole = full_sort_distributions(logits, [params] * 4)
    for j in range(4):
        np.testing.assert_allclose(whole[j], selected_probs(logits[j], params), rtol=2e-5, atol=1e-12)
    rows = [SampleRow(params, [1], 1, np.random.default_rng(j)) for j in range(4)]
    small = _sample_small(logits.copy(), rows)
    partial = []
    for j in range(4):
        y, e = scaled_weights(logits[j].copy(), params)
        partial.append(draw(*kept_tokens(y, e, params), np.random.default_rng(j)))
    assert small == partial


def test_a_boundary_within_rounding_of_the_target_is_found() -> None:
    """A case the engine_overhead benchmark met: the first round's mass above the bracket equals the
    target to float32 rounding, the second round's sum of the same tokens falls short of it, and the
    rounds were left with no candidate (IndexError).  The kept set is the full sort's up to that token."""
    vocab = 151_936
    logits = np.random.default_rng(0).normal(0, 2, vocab).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2)
    prompt = [1] + [3 + (i % 500) for i in range(15)]
    row = SampleRow(params, prompt + [56412, 88214, 76245, 104364, 98425, 129653, 87225], len(prompt), np.random.default_rng(0))
    x = apply_penalties(logits.copy(), row)
    got = selected_probs(x, params) > 0
    want = full_sort_probs(x, 0.8, top_p=0.9) > 0
    assert abs(int(got.sum()) - int(want.sum())) <= 1 and (got & want).sum() == min(got.sum(), want.sum())
    assert ReferenceSampler().sample(logits[None, :], [row])[0].token in np.flatnonzero(got)
