"""lmdock-trtllm's request plumbing (submit / abort / close in any order) over a FAKE TensorRT-LLM.

TensorRT-LLM cannot be installed here, so ``tensorrt_llm`` is a FAKE module with the two things the
engine touches (``SamplingParams`` and an ``LLM`` whose ``generate_async`` returns a result handle with
``aresult()`` and ``abort()``).  It tests lmdock's bookkeeping, not TensorRT-LLM.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from typing import Any

import pytest
from lmdock import EngineClosedError, SamplingParams
from lmdock.backend import EngineRequest
from lmdock_trtllm._engine import TrtllmEngine


class FakeResult:
    def __init__(self, llm: FakeTrtLLM, ids: list[int]) -> None:
        self.llm, self.ids = llm, ids
        self.event = asyncio.Event()
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True
        self.event.set()

    async def aresult(self) -> Any:
        await self.event.wait()
        reason = "cancelled" if self.aborted else "length"
        out = types.SimpleNamespace(index=0, text="x", token_ids=[5], cumulative_logprob=None, logprobs=None,
                                    finish_reason=reason, stop_reason=None, prompt_logprobs=None)
        return types.SimpleNamespace(outputs=[out], finished=True)


class FakeTrtLLM:
    """A FAKE of tensorrt_llm.LLM: requests finish only when released (or aborted)."""

    def __init__(self) -> None:
        self.results: list[FakeResult] = []
        self.created = threading.Event()
        self.shutdowns = 0

    def generate_async(self, ids: list[int], sampling_params: Any, streaming: bool) -> FakeResult:
        r = FakeResult(self, ids)
        self.results.append(r)
        self.created.set()
        return r

    def shutdown(self) -> None:
        self.shutdowns += 1


class Sink:
    def __init__(self) -> None:
        self.items: list[Any] = []
        self.done = threading.Event()

    def put(self, out: Any) -> None:
        self.items.append(out)
        if out.finished:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.items.append(error)
        self.done.set()


@pytest.fixture()
def engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake_module = types.ModuleType("tensorrt_llm")
    fake_module.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt_llm", fake_module)
    eng = TrtllmEngine(FakeTrtLLM(), "current", 512, {})
    yield eng
    eng.close()


def _request(rid: str) -> EngineRequest:
    return EngineRequest(rid, None, [1, 2, 3], SamplingParams(max_new_tokens=4))


def test_close_fails_requests_in_flight(engine: TrtllmEngine) -> None:
    sinks = [Sink() for _ in range(3)]
    for i, sink in enumerate(sinks):
        engine.submit(_request(f"r{i}"), sink)
    assert engine._llm.created.wait(5)
    engine.close()
    for sink in sinks:
        assert sink.done.wait(5), "a request in flight was left waiting by close()"
        assert isinstance(sink.items[-1], EngineClosedError)
    with pytest.raises(EngineClosedError):
        engine.submit(_request("late"), Sink())


def test_abort_before_the_result_handle_exists_is_not_lost(engine: TrtllmEngine) -> None:
    # the abort reaches the engine's loop before the coroutine that creates the handle has run
    gate = threading.Event()
    engine._loop.call_soon_threadsafe(gate.wait)  # hold the loop so submit's coroutine waits behind it
    sink = Sink()
    engine.submit(_request("r"), sink)
    engine.abort("r")
    gate.set()
    assert sink.done.wait(5), "the aborted request never finished"
    out = sink.items[-1]
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not [r for r in engine._llm.results if not r.aborted], "TensorRT-LLM kept generating an aborted request"


def test_abort_while_running_gives_a_final_abort_output(engine: TrtllmEngine) -> None:
    sink = Sink()
    engine.submit(_request("r"), sink)
    assert engine._llm.created.wait(5)
    engine.abort("r")
    assert sink.done.wait(5)
    assert sink.items[-1].outputs[0].finish_reason == "abort"


def test_a_sink_that_raises_does_not_stop_other_requests(engine: TrtllmEngine) -> None:
    class Raising(Sink):
        def put(self, out: Any) -> None:
            raise RuntimeError("listener gone")

    engine.submit(_request("bad"), Raising())
    good = Sink()
    engine.submit(_request("good"), good)
    for r in list(engine._llm.results):
        engine._loop.call_soon_threadsafe(r.event.set)
    import time

    deadline = time.time() + 5
    while len(engine._llm.results) < 2 and time.time() < deadline:
        time.sleep(0.01)
    for r in engine._llm.results:
        engine._loop.call_soon_threadsafe(r.event.set)
    assert good.done.wait(5)
    assert good.items[-1].finished
