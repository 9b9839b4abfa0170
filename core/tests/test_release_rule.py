"""The release rule over the FAKE step backend: aborts at every stage, scheduler failures, KV budgets
and preemption leave nothing held and nothing hangs (docs/engine.md, "The release rule")."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest
from engine_checks import GREEDY, PROMPTS, wait_idle
from fakes import FakePlugin, FakeStepEngine
from lmdock import (
    LLM,
    RequestError,
    SamplingParams,
)

pytestmark = pytest.mark.usefixtures("host_overlap")

pytestmark = pytest.mark.usefixtures("host_overlap")


def test_aborts_at_every_stage_leave_nothing_held(fake: FakePlugin) -> None:
    with LLM("m", backend="fake", scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 8}) as llm:
        rng = np.random.default_rng(0)
        futures = []
        for i in range(60):
            fut = llm.generate_async("abcdefghij"[: 1 + i % 10], SamplingParams(temperature=1.0, seed=i, max_new_tokens=30, n=1 + i % 2))
            futures.append(fut)
            if rng.random() < 0.4:
                time.sleep(float(rng.random()) * 0.002)
                fut.cancel()
        for fut in futures:
            if not fut.cancelled():
                fut.result(timeout=20)
        wait_idle(llm)


def test_scheduler_failure_releases_siblings(fake: FakePlugin) -> None:
    fake.factory = lambda: FakeStepEngine(kv_capacity_tokens=40)
    with LLM("m", backend="fake") as llm:
        with pytest.raises(RequestError, match="KV capacity"):
            llm.generate("abc", SamplingParams(n=2, temperature=1.0, seed=1, max_new_tokens=100, ignore_eos=True))
        wait_idle(llm)
        assert llm.generate("abc", GREEDY)[0].finished


def test_beam_search_under_a_kv_budget_finishes_or_fails_never_hangs(fake: FakePlugin) -> None:
    params = SamplingParams(beam_width=4, max_new_tokens=20, ignore_eos=True)
    with LLM("m", backend="fake") as free:
        want = [o.outputs[0].token_ids for o in free.generate(PROMPTS[:3], params)]
    fake.factory = lambda: FakeStepEngine(kv_capacity_tokens=90)
    with LLM("m", backend="fake") as llm:
        futures = [llm.generate_async(p, params) for p in PROMPTS[:3]]
        got = [f.result(timeout=30).outputs[0].token_ids for f in futures]
        assert got == want  # preempted and recomputed as a group: the same hypotheses
        assert llm.engine.stats()["num_preemptions_total"] > 0
        wait_idle(llm)
    fake.factory = lambda: FakeStepEngine(kv_capacity_tokens=30)
    with LLM("m", backend="fake") as tiny:
        with pytest.raises(RequestError, match="KV capacity"):
            tiny.generate_async("abcd", params).result(timeout=30)
        wait_idle(tiny)


def test_prompt_logprobs_are_not_duplicated_by_a_preemption_mid_prefill(fake: FakePlugin) -> None:
    prompt = "fghijklmnopqrstuvwfghijklmnop"  # 30 tokens with BOS
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, prompt_logprobs=1)
    with LLM("m", backend="fake") as free:
        want = free.generate(prompt, params)[0]
    fake.factory = lambda: FakeStepEngine(kv_capacity_tokens=64)
    with LLM("m", backend="fake", scheduler={"max_num_batched_tokens": 8}) as llm:
        outs = llm.generate([prompt, prompt, "abc", "xyz"], params)
        assert llm.engine.stats()["num_preemptions_total"] > 0
    for out in outs[:2]:
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids) == 30
        assert out.prompt_logprobs == want.prompt_logprobs
        assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_generate_takes_more_prompts_than_max_waiting(fake: FakePlugin) -> None:
    with LLM("m", backend="fake", scheduler={"max_waiting": 4, "max_num_seqs": 2}) as llm:
        outs = llm.generate([f"{c}{c}" for c in "abcdefghijklmnopqrst"], GREEDY)
        assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 20
        assert [o.prompt for o in outs] == [f"{c}{c}" for c in "abcdefghijklmnopqrst"]


def test_concurrent_requests_with_random_aborts_leave_zero_held(fake: FakePlugin) -> None:
    with LLM("m", backend="fake", scheduler={"max_num_seqs": 16}) as llm:
        rng = np.random.default_rng(1)
        futures = [llm.generate_async(PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=1.0, seed=i, max_new_tokens=int(rng.integers(1, 40)), ignore_eos=True)) for i in range(200)]
        for i in rng.choice(200, 60, replace=False):
            futures[i].cancel()
        done, pending = concurrent.futures.wait([f for f in futures if not f.cancelled()], timeout=60)
        assert not pending
        wait_idle(llm)
