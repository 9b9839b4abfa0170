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
