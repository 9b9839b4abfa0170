"""Prefix caching for an engine that forks a cached prompt whole but refuses some shorter prefixes of
it (lmdock-hf's sliding-window layers keep only their window: a copy is good only where the window
the next token needs is still held).  A refused fork is a cache miss; caching stays on.  FAKE engine
(core plumbing only)."""

from __future__ import annotations

from typing import Any

from fakes import FakePlugin, FakeStepEngine
from lmdock import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


class WindowForking(FakeStepEngine):
    """Forks only where the source stands at most one position past ``length`` (a ring of its window)."""

    refused = 0

    def fork(self, src: int, dst: int, length: int) -> bool:
        if length < len(self.state[src]) - 1:
            self.refused += 1
            return False
        self.state[dst] = list(self.state[src][:length])
        return True


def _run(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def test_a_refused_prefix_is_a_miss_and_caching_stays_on(fake: FakePlugin) -> None:
    first = [3 + i % 20 for i in range(24)]
    partial = first[:12] + [30, 31, 32]  # shares 12 of the cached 24: the engine refuses that fork
    extending = first + [33, 34]  # extends all of the cached prompt: the fork stands where it stands
    fake.factory = WindowForking
    with LLM("m", backend="fake", kv_cache={"enable_prefix_caching": False}) as off:
        want = _run(off, [first, partial, extending])
    with LLM("m", backend="fake") as on:
        got = [*_run(on, [first, partial])]
        assert fake.engines[-1].refused == 1 and on.stats()["prefix_cache_hit_tokens"] == 0
        got += _run(on, [extending])
        stats = on.stats()
    assert got == want
    assert stats["prefix_caching"] == "prefixes" and stats["prefix_cache_hit_tokens"] == len(first)
