"""Prompt prefixes shared over the FAKE step backend: n completions prefill once and fork, automatic
prefix caching reuses shared prefixes and drops them under KV pressure."""

from __future__ import annotations

from typing import Any

import pytest
from engine_checks import PROMPTS, wait_idle
from fakes import FakePlugin, FakeStepEngine
from lmdock import (
    LLM,
    SamplingParams,
)

pytestmark = pytest.mark.usefixtures("host_overlap")

pytestmark = pytest.mark.usefixtures("host_overlap")


def test_n_completions_prefill_the_prompt_once_and_fork(fake: FakePlugin) -> None:
    class Forking(FakeStepEngine):
        fed = 0

        def step(self, chunks: Any) -> Any:
            self.fed += sum(len(c.token_ids) for c in chunks)
            return super().step(chunks)

        def fork(self, src: int, dst: int, length: int) -> bool:
            self.state[dst] = list(self.state[src][:length])
            return True

    params = SamplingParams(n=4, temperature=1.0, seed=3, max_new_tokens=6, ignore_eos=True)
    prompt = "hello world the cat"
    with LLM("m", backend="fake") as plain:  # the fake cannot fork: every completion prefills
        want = [o.token_ids for o in plain.generate(prompt, params)[0].outputs]
    fake.factory = Forking
    with LLM("m", backend="fake") as llm:
        out = llm.generate(prompt, params)[0]
        eng = fake.engines[-1]
        assert [o.token_ids for o in out.outputs] == want
        prompt_len = len(out.prompt_token_ids)
        assert eng.fed == prompt_len + 4 * 5  # one prefill, then 5 decode tokens per completion
        wait_idle(llm)


class ForkingCounter(FakeStepEngine):
    """The FAKE engine with fork (a copy of the sequence's tokens) and a count of tokens fed."""

    fed = 0

    def step(self, chunks: Any) -> Any:
        self.fed += sum(len(c.token_ids) for c in chunks)
        return super().step(chunks)

    def fork(self, src: int, dst: int, length: int) -> bool:
        self.state[dst] = list(self.state[src][:length])
        return True


def test_automatic_prefix_caching_reuses_shared_prompt_prefixes(fake: FakePlugin) -> None:
    prefix = "the cat sat on the mat and the dog ran in the park "
    prompts = [prefix + s for s in ("a", "bb", "xyz", "q")]
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    fake.factory = ForkingCounter
    with LLM("m", backend="fake", kv_cache={"enable_prefix_caching": False}) as off:
        want = [off.generate(p, params)[0].outputs[0].token_ids for p in prompts]
        fed_off = fake.engines[-1].fed
    with LLM("m", backend="fake") as on:  # kv_cache.enable_prefix_caching defaults to true
        got = [on.generate(p, params)[0].outputs[0].token_ids for p in prompts]
        eng = fake.engines[-1]
        stats = on.engine.stats()
        assert got == want
        shared = len(on.tokenizer.encode(prefix))
        assert stats["prefix_cache_hit_tokens"] >= 3 * (shared - 1)
        assert eng.fed <= fed_off - 3 * (shared - 1)
        assert stats["num_sequences_held"] == 0 and stats["num_sequences_cached"] > 0
        on.clear_cache()
        assert eng.num_sequences() == 0


def test_prefix_cache_is_dropped_under_kv_pressure(fake: FakePlugin) -> None:
    fake.factory = lambda: ForkingCounter(kv_capacity_tokens=60)
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    with LLM("m", backend="fake") as free:
        want = [o.outputs[0].token_ids for o in free.generate(PROMPTS[:6], params)]
    fake.factory = lambda: ForkingCounter(kv_capacity_tokens=60)
    with LLM("m", backend="fake") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], params)]
        assert llm.engine.stats()["num_preemptions_total"] > 0
        assert got == want
        wait_idle(llm)
