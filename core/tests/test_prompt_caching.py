"""Cached prompts give way before a request that fits the KV capacity is preempted or failed
(issue 28: a beam request needing 152 of 160 tokens failed against "the KV capacity (130 tokens)"
while a 30-token prompt sat in the prefix cache).  FAKE engine (core plumbing only)."""

from __future__ import annotations

from typing import Any

from fakes import FakePlugin, FakeStepEngine
from lmdock import LLM, SamplingParams
from lmdock._engine.prefix_cache import PromptCache

CAPACITY = 160


class Forking(FakeStepEngine):
    def __init__(self) -> None:
        super().__init__(kv_capacity_tokens=CAPACITY)

    def fork(self, src: int, dst: int, length: int) -> bool:
        self.state[dst] = list(self.state[src][:length])
        return True


def _run(llm: LLM, first: list[int], beam_prompt: list[int], beam: SamplingParams) -> Any:
    llm.generate([first], SamplingParams(temperature=0, max_new_tokens=1))  # its prompt stays cached
    return llm.generate([beam_prompt], beam)[0]


def test_a_beam_request_that_fits_evicts_the_cached_prompt(fake: FakePlugin) -> None:
    fake.factory = Forking
    first = [3 + i % 30 for i in range(30)]  # 30 tokens, cached after the request
    beam_prompt = [30, 29, 28, 27, 26, 25, 24, 23]
    beam = SamplingParams(beam_width=4, max_new_tokens=30, ignore_eos=True)  # 4 x 38 = 152 of 160
    with LLM("m", backend="fake", kv_cache={"enable_prefix_caching": False}) as off:
        want = _run(off, first, beam_prompt, beam)
    with LLM("m", backend="fake") as on:
        got = _run(on, first, beam_prompt, beam)
        peak = fake.engines[-1].max_tokens
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert all(c.finish_reason == "length" for c in got.outputs)
    assert peak <= CAPACITY  # the engine never held more than it has


def test_a_long_prompt_that_fits_the_capacity_is_admitted(fake: FakePlugin) -> None:
    """A prompt longer than what the cache leaves, shorter than the capacity, is not refused."""
    fake.factory = Forking
    with LLM("m", backend="fake") as llm:
        llm.generate([[3 + i % 30 for i in range(60)]], SamplingParams(temperature=0, max_new_tokens=1))  # 60 cached
        out = llm.generate([[33 - i % 30 for i in range(150)]], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_eviction_takes_least_recently_used_prompts_first() -> None:
    cache = PromptCache()
    cache.insert([1, 2, 3], 10)
    cache.insert([4, 5], 11)
    cache.insert([6, 7, 8, 9], 12)
    cache.lookup([1, 2, 3, 99])  # 10 is used again: 11 is now the oldest
    evicted, freed = cache.evict(3)
    assert evicted == [11, 12] and freed == 6
    assert cache.lookup([1, 2]) == (10, 2) and len(cache) == 1
    assert cache.evict(100) == ([10], 3) and len(cache) == 0
