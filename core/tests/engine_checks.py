"""What the engine-loop suites over the FAKE step backend share: a greedy request, prompts, how to see
what the engine holds, and a plugin whose logits processor fails on purpose."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from lmdock import LLM, SamplingParams
from lmdock import hookimpl as lmdock_hookimpl

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
PROMPTS = ["a", "bb", "cde", "hello world", "xyz", "ab ab", "q", "the cat"]


def held(llm: LLM) -> int:
    return llm.engine.engine.num_sequences()


def wait_idle(llm: LLM, timeout: float = 5.0) -> dict:
    deadline = time.time() + timeout
    while True:
        s = llm.engine.stats()
        if (s["num_sequences_running"], s["num_sequences_waiting"], s["num_sequences_held"]) == (0, 0, 0):
            return s
        if time.time() > deadline:
            raise AssertionError(f"the engine is not idle: {s}")
        time.sleep(0.01)


class Marker:
    """A plugin whose logits processor raises for requests with seed 666 (and records call order)."""

    def __init__(self, name: str, calls: list[str] | None = None, fail_seed: int | None = 666) -> None:
        self.name, self.calls, self.fail_seed = name, calls, fail_seed

    @lmdock_hookimpl
    def lmdock_logits_processors(self, params: SamplingParams) -> Any:
        def proc(token_ids: list[int], logits: np.ndarray) -> np.ndarray:
            if self.calls is not None:
                self.calls.append(self.name)
            if params.seed == self.fail_seed:
                raise ZeroDivisionError("boom")
            return logits

        return [proc]

