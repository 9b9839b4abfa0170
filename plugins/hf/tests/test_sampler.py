"""lmdock-hf's torch sampler against the core's reference sampler, which defines the semantics.

Greedy choices, penalties, biases and logprobs must match the reference; seeded draws come from the
same uniform as the reference's (the row's NumPy generator, inverted through the CDF in token-id
order), so they agree token for token up to float rounding, and their distribution is checked by a
chi-square against the exact probabilities, computed here by a plain full sort.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from lmdock import SamplingParams
from lmdock.backend import ReferenceSampler, SampleRow
from lmdock_hf._sampler import TorchSampler

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
DRAWS = 4_000


def exact(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Steps 6-8 written plainly: softmax, then stable sorts of the whole row (ties by token id)."""
    p = np.exp(logits.astype(np.float64) / temperature)
    p /= p.sum()
    if min_p:
        p[p < min_p * p.max()] = 0.0
    if top_k:
        p[np.argsort(-p, kind="stable")[top_k:]] = 0.0
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        sp = p[order] / p.sum()
        p[order[np.cumsum(sp) - sp >= top_p]] = 0.0
    return p / p.sum()


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    want = probs[support] * counts.sum()
    return float(((counts[support] - want) ** 2 / want).sum())


def row(params: SamplingParams, tokens: list[int] | None = None, prompt_len: int = 1, seed: int = 0) -> SampleRow:
    return SampleRow(params, list(tokens or [1]), prompt_len, np.random.default_rng(seed))


def both(logits: np.ndarray, make_rows) -> tuple[list, list]:  # type: ignore[no-untyped-def]
    """The same rows (fresh, same seeds) through the reference and the torch sampler."""
    ref = ReferenceSampler().sample(logits, make_rows())
    native = TorchSampler("torch").sample(torch.from_numpy(logits), make_rows())
    return ref, native


MODES = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.8},
    {"top_k": 3},
    {"min_p": 0.2},
    {"temperature": 1.3, "top_k": 5, "top_p": 0.9},
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_seeded_draws_follow_the_exact_distribution(mode: dict) -> None:
    r = row(SamplingParams(seed=1, **mode), seed=12345)
    logits = torch.from_numpy(np.repeat(LOGITS[None, :], DRAWS, axis=0))
    tokens = [s.token for s in TorchSampler("torch").sample(logits, [r] * DRAWS)]
    counts = np.bincount(tokens, minlength=LOGITS.size).astype(np.float64)
    want = exact(LOGITS, **mode)
    assert counts[want == 0].sum() == 0, "drew a token the filters remove"
    dof = int((want > 0).sum()) - 1
    if dof:
        assert chi2(counts, want) < chi2_critical(dof), (counts, want)
        # the same counts against the unfiltered softmax: the test can tell the filters apart
        if mode.get("top_p", 1.0) < 1.0 or mode.get("top_k") or mode.get("min_p"):
            assert (counts[exact(LOGITS, temperature=mode.get("temperature", 1.0)) > 0] == 0).any()


def test_a_wrong_distribution_fails_the_chi_square() -> None:
    r = row(SamplingParams(seed=1, temperature=1.0), seed=7)
    logits = torch.from_numpy(np.repeat(LOGITS[None, :], DRAWS, axis=0))
    counts = np.bincount([s.token for s in TorchSampler("torch").sample(logits, [r] * DRAWS)], minlength=LOGITS.size)
    assert chi2(counts.astype(np.float64), exact(LOGITS, temperature=0.7)) > chi2_critical(LOGITS.size - 1)


def test_seeded_draws_are_the_reference_draws() -> None:
    """The same uniform, the same CDF order: token for token (rounding may move one in thousands)."""
    logits = np.random.default_rng(0).normal(0, 2, (64, 5_000)).astype(np.float32)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=3), SamplingParams(temperature=1.1, top_k=50, seed=4),
              SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3, seed=5)]
    for p in params:
        ref, native = both(logits, lambda p=p: [row(p, [1, 7, 7, 9], 2, seed=i) for i in range(64)])
        same = sum(a.token == b.token for a, b in zip(ref, native))
        assert same >= 63, (p, same)


def test_seeded_rows_reproduce_and_do_not_depend_on_the_batch() -> None:
    logits = torch.from_numpy(np.random.default_rng(1).normal(0, 2, (4, 3_000)).astype(np.float32))
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    sampler = TorchSampler("torch")
    batch = [s.token for s in sampler.sample(logits, [row(p, seed=i) for i in range(4)])]
    again = [s.token for s in sampler.sample(logits, [row(p, seed=i) for i in range(4)])]
    alone = [sampler.sample(logits[i : i + 1], [row(p, seed=i)])[0].token for i in range(4)]
    assert batch == again == alone


def test_greedy_with_penalties_biases_and_min_tokens_is_the_reference_choice() -> None:
    logits = np.random.default_rng(2).normal(0, 1, (6, 2_000)).astype(np.float32)
    top = logits.argmax(axis=1)
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=3.0),
              SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=1.0),
              SamplingParams(temperature=0, logit_bias={int(top[3]): -100, 5: 2.5}),
              SamplingParams(temperature=0, allowed_token_ids=(3, 30, 300)),
              SamplingParams(temperature=0, min_new_tokens=5, stop_token_ids=[int(top[5])])]

    def rows() -> list[SampleRow]:  # each row has already produced its argmax twice
        return [row(p, [1, int(top[i]), int(top[i])], 1) for i, p in enumerate(params)]

    ref, native = both(logits, rows)
    assert [s.token for s in native] == [s.token for s in ref]
    assert all(s.token != t for s, t in zip(ref[1:], top[1:].tolist()))  # every knob moved the choice


def test_logprobs_are_the_reference_logprobs() -> None:
    logits = np.random.default_rng(3).normal(0, 2, (3, 1_000)).astype(np.float32)
    logits[1, [10, 20]] = logits[1].max() + 1  # a tie at the top: the lower id first
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, seed=2, logprobs=0)]
    ref, native = both(logits, lambda: [row(p, seed=i) for i, p in enumerate(params)])
    for a, b in zip(ref, native):
        assert (a.token, a.rank) == (b.token, b.rank)
        assert b.logprob == pytest.approx(a.logprob, abs=1e-5)
        assert [t for t, _ in b.top] == [t for t, _ in a.top]
        np.testing.assert_allclose([v for _, v in b.top], [v for _, v in a.top], atol=1e-5)
    assert [t for t, _ in native[1].top][:2] == [10, 20]


def test_no_token_left_fails_the_row_as_the_reference_does() -> None:
    from lmdock import RequestError

    p = SamplingParams(temperature=0, allowed_token_ids=(0,), bad_words=("x",))
    r = SampleRow(p, [1], 1, np.random.default_rng(0), bad_words_ids=((0,),))
    with pytest.raises(RequestError, match="no token"):
        TorchSampler("torch").sample(torch.from_numpy(LOGITS[None, :]), [r])


def test_which_sampler_each_mode_uses() -> None:
    """"auto" leaves CPU tensors and NumPy to the reference (its selection is faster there);
    "torch" samples CPU tensors itself; "reference" lets the core's sampler answer."""
    from lmdock import ModelConfig
    from lmdock_hf import plugin

    calls = []

    class Spy(ReferenceSampler):
        def sample(self, logits, rows):  # type: ignore[no-untyped-def]
            calls.append(type(logits).__name__)
            return super().sample(logits, rows)

    rows = [row(SamplingParams(temperature=0.7, seed=1))]
    for mode, expect in (("auto", ["Tensor"]), ("torch", [])):
        sampler = plugin.sampler(ModelConfig("m", backends={"hf": {"sampler": mode}}))
        assert isinstance(sampler, TorchSampler)
        sampler.reference = Spy()
        calls.clear()
        sampler.sample(torch.from_numpy(LOGITS[None, :]), rows)
        assert calls == expect
    sampler.sample(LOGITS[None, :], rows)  # host logits: always the reference
    assert calls == ["ndarray"]
    assert plugin.sampler(ModelConfig("m", backends={"hf": {"sampler": "reference"}})) is None
