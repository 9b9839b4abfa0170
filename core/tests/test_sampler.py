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
