"""``lmdock.backend.StepEngineBase`` (the step-engine contract's optional members with defaults), the
adapter that gives an engine written without it the same defaults, and ``AdapterCache``."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from fakes import PIECES, FakeStepEngine, FakeTokenizer
from lmdock import LLM, LoRARequest, RequestError, SamplingParams
from lmdock._engine.adapters import as_step_engine
from lmdock.backend import AdapterCache, SeqChunk, StepEngineBase, StepOutput


class BigramOnBase(StepEngineBase):
    """A FAKE step engine on the base, with the FAKE engine's bigram table: it implements only what
    the base requires (``step``, ``release``, ``num_sequences``), so it cannot fork."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(FakeTokenizer(), vocab_size=len(PIECES), max_seq_len=256, eos_token_ids=[2])
        self.table = FakeStepEngine(seed=seed).table
        self.state: dict[int, list[int]] = {}

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        for c in chunks:
            self.state.setdefault(c.seq_id, [])[c.start:] = list(c.token_ids)
        full = {c.seq_id: self.table[list(c.token_ids)] for c in chunks if c.all_logits}
        return StepOutput(np.stack([self.table[self.state[c.seq_id][-1]] for c in chunks]), full)

    def release(self, seq_id: int) -> None:
        self.state.pop(seq_id, None)

    def num_sequences(self) -> int:
        return len(self.state)


def test_the_base_holds_the_contract_fields_and_the_optional_defaults() -> None:
    engine = BigramOnBase()
    assert (engine.vocab_size, engine.max_seq_len, engine.eos_token_ids, engine.generation_config) == (len(PIECES), 256, (2,), {})
    assert engine.kv_capacity_tokens is None and engine.scheduler_limits is None and engine.adapters is None
    assert engine.fork_truncates is True and engine.overlap_host_work is False and engine.max_loras == 0
    assert engine.fork(0, 1, 3) is False and engine.truncate(0, 3) is False
    engine.thread_exit()
    with pytest.raises(RequestError, match=r"lora_request 'a': this step engine \(BigramOnBase\) runs no LoRA adapters; send the request without"):
        engine.prepare_lora(LoRARequest("a", path="/nowhere"))
    assert as_step_engine(engine) is engine


def test_a_subclass_must_implement_step_release_and_num_sequences() -> None:
    bare = StepEngineBase(FakeTokenizer(), vocab_size=4, max_seq_len=8, eos_token_ids=[2])
    for call in (lambda: bare.step([]), lambda: bare.release(0), bare.num_sequences):
        with pytest.raises(NotImplementedError, match="StepEngineBase must implement"):
            call()


def test_an_engine_without_the_base_is_seen_through_it() -> None:
    legacy = FakeStepEngine(kv_capacity_tokens=60)
    seen = as_step_engine(legacy)
    assert isinstance(seen, StepEngineBase) and seen is not legacy
    # its own fields and members, and the base's defaults for the optional ones it lacks
    assert (seen.tokenizer, seen.vocab_size, seen.kv_capacity_tokens, seen.restarts) == (legacy.tokenizer, len(PIECES), 60, 0)
    assert seen.fork_truncates is True and seen.overlap_host_work is False and seen.max_loras == 0
    assert seen.scheduler_limits is None and seen.truncate(0, 1) is False
    seen.thread_exit()
    with pytest.raises(RequestError, match=r"\(FakeStepEngine\) cannot run LoRA adapters \(it has no prepare_lora\)"):
        seen.prepare_lora(LoRARequest("a", path="/nowhere"))
    seen.close()
    assert legacy.closed


def test_an_engine_without_the_base_keeps_the_optional_members_it_has() -> None:
    calls: list[Any] = []

    class Legacy(FakeStepEngine):
        fork_truncates = False
        overlap_host_work = True
        scheduler_limits = {"max_num_seqs": 2}
        max_loras = 3

        def thread_exit(self) -> None:
            calls.append("exit")

        def truncate(self, seq_id: int, length: int) -> bool:
            calls.append(("truncate", seq_id, length))
            return True

        def prepare_lora(self, lora: LoRARequest) -> None:
            calls.append(lora.name)

    seen = as_step_engine(Legacy())
    assert (seen.fork_truncates, seen.overlap_host_work, seen.scheduler_limits, seen.max_loras) == (False, True, {"max_num_seqs": 2}, 3)
    seen.thread_exit()
    assert seen.truncate(4, 2) is True
    seen.prepare_lora(LoRARequest("a", path="/nowhere"))
    assert calls == ["exit", ("truncate", 4, 2), "a"]


def test_an_engine_on_the_base_that_cannot_fork_gives_what_a_legacy_engine_gives(fake: Any) -> None:
    """Same table, same tokens and logprobs (n = 3 completions, prompt logprobs): an engine on the base
    (its default ``fork``: False, the core computes each completion's prompt itself) and the legacy
    FAKE engine through the adapter."""
    params = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, seed=5, logprobs=2, prompt_logprobs=1)
    outputs = []
    for factory in (BigramOnBase, FakeStepEngine):
        fake.factory = factory
        with LLM("m", backend="fake") as llm:
            out = llm.generate(["abc", "xyz"], params)
            outputs.append([[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in out])
            assert llm.stats()["num_sequences_held"] == 0 and llm.stats()["max_lora"] == 0
    assert outputs[0] == outputs[1]
    assert all(len(o) == 3 for o in outputs[0])


class Recorded(AdapterCache[str]):
    """A FAKE adapter cache: an adapter is its name; names starting with "bad" cannot load."""

    def load(self, lora: LoRARequest) -> str:
        if lora.name.startswith("bad"):
            raise RequestError(f"lora_request {lora.name!r}: cannot load")
        return lora.name


def _lora(name: str) -> LoRARequest:
    return LoRARequest(name, path=f"/adapters/{name}")


def test_adapter_cache_loads_once_and_evicts_the_least_recently_used_but_the_steps() -> None:
    cache = Recorded(max_loras=2)
    assert not cache and cache.max_loras == 2 and Recorded().max_loras == 8  # the default
    a, b, c = _lora("a"), _lora("b"), _lora("c")
    for lora in (a, b, a, c):
        cache.prepare(lora)
    assert cache.loads == 3 and list(cache.loaded) == [b.key, a.key, c.key]
    cache.evict(keep=[b.key])  # b is the least recently used, but the step runs it
    assert list(cache.loaded) == [b.key, c.key]
    cache.evict(keep=[])  # within max_loras: nothing to do
    assert list(cache.loaded) == [b.key, c.key]
    cache.prepare(a)  # evicted: loaded again
    assert cache.loads == 4
    with pytest.raises(RequestError, match="'bad': cannot load"):
        cache.prepare(_lora("bad"))
    assert _lora("bad").key not in cache.loaded and cache.loads == 4


def test_adapter_cache_groups_a_forwards_rows_by_adapter() -> None:
    cache = Recorded()
    a, b = _lora("a"), _lora("b")
    assert cache.groups([None, b, a, b, None]) == [("b", [1, 3]), ("a", [2])]
    assert cache.groups([a, a]) == [("a", None)]  # every row: no row index needed
    assert cache.groups([None, None]) == []
    assert list(cache.loaded) == [b.key, a.key]  # grouping loads and marks them used


def test_adapter_cache_loads_an_adapter_once_under_concurrent_prepares() -> None:
    started = threading.Barrier(8)

    class Slow(Recorded):
        def load(self, lora: LoRARequest) -> str:
            threading.Event().wait(0.01)  # a disk read: the other threads arrive meanwhile
            return super().load(lora)

    cache = Slow()

    def prepare() -> None:
        started.wait()
        cache.prepare(_lora("a"))

    threads = [threading.Thread(target=prepare) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.loads == 1
