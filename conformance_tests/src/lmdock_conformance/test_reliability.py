"""Reliability: aborts free the backend's state, preemption keeps the tokens, a failing request fails
alone, hundreds of concurrent requests with random aborts leave nothing held, and a fuzz of
parameters and prompts never takes the engine down."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import numpy as np
import pytest
from lmdock import LmdockError, RequestError, SamplingParams

PROMPTS = ["Once upon a time", "The cat", "Lily and Tom", "One day", "The sun was", "A little dog"]


def held(llm: Any) -> int | None:
    """Sequences the backend holds state for on behalf of requests: ``stats()["num_sequences_held"]``
    (prefix caches hold theirs on purpose and are not counted; the core's loop reports a step engine's
    ``num_sequences()`` so); None when the backend reports none."""
    value = llm.engine.stats().get("num_sequences_held")
    return None if value is None else int(value)


def assert_nothing_held(llm: Any, lmdock_setup: Any, timeout: float = 10.0) -> None:
    llm.clear_cache()  # the prefix caches hold KV state on purpose
    deadline = time.time() + timeout
    while True:
        n = held(llm)
        if n is None:
            if lmdock_setup.spec.kind == "step":
                pytest.fail("a step engine must implement num_sequences() (lmdock.backend.StepEngine)")
            pytest.skip(f"request backend {lmdock_setup.backend!r} reports no num_sequences_held in stats()")
        if n == 0:
            return
        if time.time() > deadline:
            pytest.fail(f"the backend still holds {n} sequences {timeout:.0f} s after every request ended")
        time.sleep(0.05)


@pytest.mark.requires("stream")
def test_abort_frees_the_backends_state(llm: Any, lmdock_setup: Any) -> None:
    params = SamplingParams(temperature=0.8, seed=1, max_new_tokens=200, ignore_eos=True)
    futures = [llm.generate_async(p, params) for p in PROMPTS]
    time.sleep(0.05)
    for fut in futures:
        fut.cancel()
    for fut in futures:
        if not fut.cancelled():
            fut.result(timeout=120)
    stream = llm.stream("Once upon a time", params)
    next(stream)
    stream.close()  # abandoning a stream aborts it
    assert_nothing_held(llm, lmdock_setup)
    assert len(llm.generate("The cat", SamplingParams(temperature=0, max_new_tokens=3))[0].outputs[0].token_ids) == 3


def test_preemption_under_a_small_kv_budget_gives_the_same_tokens(llm: Any, lmdock_setup: Any) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    with lmdock_setup.llm(kv_cache={"max_tokens": 128}, build={"max_seq_len": 128}, **small_budget_speculation(lmdock_setup)) as small:
        got = [o.outputs[0].token_ids for o in small.generate(PROMPTS, params)]
        if lmdock_setup.spec.kind == "step":
            assert small.engine.stats()["num_preemptions_total"] > 0, "the KV budget was not honoured: nothing was preempted"
        assert got == want
        assert_nothing_held(small, lmdock_setup)


def small_budget_speculation(lmdock_setup: Any) -> dict[str, Any]:
    """With speculation on, at most one draft per sequence per step, so the budget must preempt.

    Drafts only take the KV room the plan leaves, so with many drafts accepted the first sequences
    can finish (and free their room) before the others fill it: no preemption, legitimately.  With
    one draft a step, the first sequence needs 16 steps for its 32 tokens, by which time the six
    sequences hold at least 28 + 7 * 16 = 140 positions, over the 128: some sequence is preempted
    whatever the drafts and their acceptance."""
    spec = lmdock_setup.options.get("speculative")
    return {"speculative": {**spec, "num_speculative_tokens": 1}} if spec else {}


@pytest.fixture()
def failing_processor(lmdock_setup: Any) -> Any:
    """A plugin whose logits processor raises for requests with seed 4242."""
    import lmdock
    from lmdock._plugin.manager import get_registry

    if lmdock_setup.spec.kind != "step":
        pytest.skip("logits-processor plugins run in the core's sampler, which request engines do not use")

    class Failing:
        @lmdock.hookimpl
        def lmdock_logits_processors(self, params: SamplingParams) -> Any:
            if params.seed != 4242:
                return None

            def explode(token_ids: list[int], logits: np.ndarray) -> np.ndarray:
                raise ArithmeticError("deliberate")

            return [explode]

    plugin = Failing()
    registry = get_registry()
    registry.add_plugin(plugin, "conformance-failing-processor")
    yield plugin
    registry.pm.unregister(plugin)


def test_a_failing_logits_processor_fails_one_request_and_the_next_succeeds(llm: Any, lmdock_setup: Any, failing_processor: Any) -> None:
    ok = SamplingParams(temperature=0.8, seed=7, max_new_tokens=12)
    alone = llm.generate("The cat", ok)[0].outputs[0].token_ids
    good = llm.generate_async("The cat", ok)
    bad = llm.generate_async("One day", ok.replace(seed=4242))
    with pytest.raises(LmdockError, match=r"conformance-failing-processor.*deliberate"):
        bad.result(timeout=120)
    assert good.result(timeout=120).outputs[0].token_ids == alone
    assert llm.generate("The cat", ok)[0].outputs[0].token_ids == alone
    assert_nothing_held(llm, lmdock_setup)


@pytest.mark.requires("stream")
def test_two_hundred_concurrent_requests_with_random_aborts_leave_nothing_held(llm: Any, lmdock_setup: Any) -> None:
    rng = np.random.default_rng(0)
    futures = []
    for i in range(200):
        params = SamplingParams(temperature=1.0, seed=i, max_new_tokens=int(rng.integers(1, 24)))
        futures.append(llm.generate_async(PROMPTS[i % len(PROMPTS)], params))
    for i in rng.choice(200, 50, replace=False):
        futures[int(i)].cancel()
    live = [f for f in futures if not f.cancelled()]
    done, pending = concurrent.futures.wait(live, timeout=300)
    assert not pending, f"{len(pending)} requests never finished"
    for f in done:
        assert f.result().finished
    assert_nothing_held(llm, lmdock_setup)


# -- sampling against the exact distribution ----------------------------------------------------------


def _expected(logits: np.ndarray, prompt: list[int], p: dict[str, Any]) -> np.ndarray:
    """The distribution lmdock's SamplingParams define (vLLM's order): repetition penalty on seen
    tokens, temperature, min_p, top_k, top_p.  Written here from the definitions, not imported."""
    x = logits.astype(np.float64).copy()
    rp = p.get("repetition_penalty", 1.0)
    if rp != 1.0:
        seen = np.unique(prompt)
        x[seen] = np.where(x[seen] > 0, x[seen] / rp, x[seen] * rp)
    x = x / p.get("temperature", 1.0)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.get("min_p", 0.0) > 0:
        probs[probs < p["min_p"] * probs.max()] = 0
    k = p.get("top_k", 0)
    if k > 0:
        probs[np.argsort(-probs, kind="stable")[k:]] = 0
    top_p = p.get("top_p", 1.0)
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sp = probs[order] / probs.sum()
        probs[order[(np.cumsum(sp) - sp) >= top_p]] = 0
    return probs / probs.sum()


# temperature 3 flattens the first token's distribution (at 1 one token has 97% of it), so each
# filter changes what is drawn by a lot; a repetition penalty below 1 boosts the prompt's tokens
# temperature 2 flattens the distribution enough for every setting to matter, and is the most that
# OpenAI's API and vLLM accept
SETTINGS = [
    {"temperature": 2.0, "top_k": 3},
    {"temperature": 2.0, "top_p": 0.6},
    {"temperature": 2.0, "min_p": 0.3},
    {"temperature": 2.0, "repetition_penalty": 0.5},
]


@pytest.mark.requires("sampling")
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_first_token_distribution_under_sampling_settings(llm: Any, reference: dict, setting: dict) -> None:
    """Chi-square of 2,000 seeded first-token draws against the distribution computed from the
    recorded transformers float32 logits."""
    import math

    probs = _expected(np.array(reference["next_token_logits"]), reference["prompt_ids"], setting)
    top = [int(t) for t in np.argsort(-probs)[:6] if probs[t] > 0]
    counts = np.zeros(len(top) + 1)
    draws = 0
    for i in range(40):
        # seeds far apart: vLLM seeds the n completions of a request seed, seed + 1, ..., seed + n - 1,
        # so requests seeded 0, 1, 2, ... would draw mostly the same samples again
        out = llm.generate([reference["prompt_ids"]], SamplingParams(n=50, seed=1000 * i, max_new_tokens=1, **setting))[0]
        for c in out.outputs:
            t = c.token_ids[0]
            assert probs[t] > 0, f"token {t} has probability 0 under {setting}, yet it was drawn"
            counts[top.index(t) if t in top else len(top)] += 1
            draws += 1
    expected = np.append(probs[top], 1 - probs[top].sum()) * draws
    keep = expected >= 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = max(1, int(keep.sum()) - 1)
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3  # p = 0.001
    assert stat < critical, f"{setting}: chi-square {stat:.1f} >= {critical:.1f}: counts {counts}, expected {expected.round(1)}"


# -- fuzz: parameters and prompts sent to a live engine -------------------------------------------------


def test_fuzzed_parameters_and_prompts_fail_alone_and_the_engine_serves_on(llm: Any) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    vocab = llm.tokenizer.vocab_size if hasattr(llm.tokenizer, "vocab_size") else 512
    nan = st.just(float("nan"))
    fields = st.fixed_dictionaries({}, optional={
        "temperature": st.one_of(st.floats(-1, 3), nan, st.integers(-2, 3)),
        "top_p": st.one_of(st.floats(-0.5, 1.5), nan),
        "top_k": st.integers(-3, 1000),
        "min_p": st.floats(-0.5, 1.5),
        "max_new_tokens": st.one_of(st.none(), st.integers(-2, 6)),
        "min_new_tokens": st.integers(-1, 8),
        "n": st.integers(-1, 3),
        "seed": st.one_of(st.none(), st.integers(-5, 2**64)),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
        "stop_token_ids": st.lists(st.integers(-3, vocab + 3), max_size=2),
        "logprobs": st.one_of(st.none(), st.integers(-1, vocab + 2)),
        "repetition_penalty": st.one_of(st.floats(-1, 3), nan),
        "presence_penalty": st.floats(-3, 3),
        "frequency_penalty": st.floats(-3, 3),
    })
    prompts = st.one_of(st.text(max_size=40), st.lists(st.integers(-5, vocab + 5), max_size=12))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(fields, prompts)
    def run(kwargs: dict[str, Any], prompt: Any) -> None:
        if "max_new_tokens" not in kwargs or kwargs["max_new_tokens"] is None:
            kwargs["max_new_tokens"] = 4  # keep each case short
        try:
            params = SamplingParams(**kwargs)
            llm.generate_async(prompt, params).result(timeout=120)
        except (ValueError, RequestError):
            pass  # a clear refusal is the right answer for bad input

    run()
    out = llm.generate("The cat", SamplingParams(temperature=0, max_new_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3
