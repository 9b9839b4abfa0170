"""``lmdock.backend.RequestEngineBase`` and ``PoolingEngineBase`` (the kinds declared on the class, the
request-engine contract's optional members with defaults), ``SchedulerBase``, and the adapters that
let an engine or scheduler written without them load as before (``lmdock._engine.adapters``)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import lmdock
import pytest
from fakes import FakeStepEngine, FakeTokenizer
from lmdock import LLM, LoRARequest, SamplingParams, UnsupportedError
from lmdock._engine.adapters import as_request_engine, as_scheduler, engine_kind
from lmdock._plugin import manager as _plugins
from lmdock.backend import (
    BackendSpec,
    CompletionOutput,
    FcfsScheduler,
    PoolingEngineBase,
    RequestEngineBase,
    RequestOutput,
    SchedulerBase,
    StepEngineBase,
)

NO_QUERIES = "the echo engine answers whole requests only"


def _answer(tokenizer: Any, request: Any, sink: Any) -> None:
    """A FAKE request engine's answer: the prompt's tokens reversed, cut at max_tokens."""
    ids = list(request.prompt_token_ids[::-1][: request.params.max_tokens])
    done = CompletionOutput(index=0, text=tokenizer.decode(ids), token_ids=ids, finish_reason="length")
    sink.put(RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids), [done], finished=True))


class Echo(RequestEngineBase):
    """A FAKE request engine on the base (it answers for itself, as vLLM does): only ``submit`` and
    ``abort``, every optional member the base's default."""

    def __init__(self) -> None:
        super().__init__(FakeTokenizer(), max_seq_len=64)

    def submit(self, request: Any, sink: Any) -> None:
        _answer(self.tokenizer, request, sink)

    def abort(self, request_id: str) -> None:
        pass


class LegacyEcho:
    """The same FAKE engine written without the base, with some optional members of its own."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_seq_len = 64
        self.generation_config: dict[str, Any] = {}
        self.calls: list[Any] = []

    def submit(self, request: Any, sink: Any) -> None:
        _answer(self.tokenizer, request, sink)

    def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"num_requests_running": 0}

    def clear_cache(self) -> None:
        self.calls.append("clear")

    def prepare_lora(self, lora: LoRARequest) -> None:
        self.calls.append(lora.name)

    def close(self) -> None:
        self.calls.append("close")


class EchoPlugin:
    """Registers the FAKE request backend "echo"; the engine it loads is ``factory()``."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory
        self.engines: list[Any] = []

    @lmdock.hookimpl
    def lmdock_register_backends(self, register: Any) -> None:
        register(BackendSpec(name="echo", kind="request", plugin_api="1.0", supports=frozenset({"generate", "lora"}),
                             lacks={"next_token_logprobs": NO_QUERIES}, description="FAKE request backend"))

    @lmdock.hookimpl
    def lmdock_load_engine(self, backend: str, model_config: Any, options: Any, quantization: Any, build: Any) -> Any:
        if backend != "echo":
            return None
        self.engines.append(self.factory())
        return self.engines[-1]


@pytest.fixture
def echo(isolated: Any) -> EchoPlugin:
    plugin = EchoPlugin(Echo)
    _plugins.get_registry().add_plugin(plugin, "echo")
    return plugin


def test_each_base_declares_its_kind_and_the_request_base_its_defaults() -> None:
    assert (StepEngineBase.kind, RequestEngineBase.kind, PoolingEngineBase.kind) == ("step", "request", "pooling")
    engine = Echo()
    assert engine.submit_on_loop is False and engine.generation_config == {} and engine.stats() == {}
    engine.clear_cache()
    engine.prepare_lora(LoRARequest("a", path="/nowhere"))  # the default: submit reads it
    assert engine.process_multimodal("abc", None, True) == FakeTokenizer().encode("abc")
    with pytest.raises(UnsupportedError, match="Echo has no next_token_logprobs"):
        engine.next_token_logprobs([1, 2])
    assert as_request_engine(engine) is engine and engine_kind(engine, "step") == "request"


def test_a_subclass_must_implement_submit_abort_and_embed() -> None:
    bare = RequestEngineBase(None, max_seq_len=8)
    with pytest.raises(NotImplementedError, match="RequestEngineBase must implement submit"):
        bare.submit(None, None)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="RequestEngineBase must implement abort"):
        bare.abort("r")
    with pytest.raises(UnsupportedError, match="has no tokenizer to read a prompt with images"):
        bare.process_multimodal("a", None, True)
    with pytest.raises(NotImplementedError, match="PoolingEngineBase must implement embed"):
        PoolingEngineBase().embed([], "MEAN")


def test_an_engine_without_a_base_has_its_kind_told_from_its_members() -> None:
    pooling = SimpleNamespace(embed=lambda batch, pooling_type: None, task="embed")
    assert engine_kind(pooling, "step") == "pooling" and engine_kind(pooling, "request") == "pooling"
    assert engine_kind(FakeStepEngine(), "request") == "step"
    assert engine_kind(LegacyEcho(), "step") == "request"
    assert engine_kind(SimpleNamespace(), "request") == "request"  # nothing to tell: what the backend declares


def test_a_request_engine_without_the_base_loads_through_the_adapter_and_answers_alike(echo: EchoPlugin) -> None:
    params = SamplingParams(max_tokens=3)
    with LLM("m", backend="echo") as llm:
        on_base = [o.outputs[0].token_ids for o in llm.generate(["abc", "xyz"], params)]
        assert llm.engine is echo.engines[-1] and llm.stats() == {}
        llm.clear_cache()  # the default: nothing held
    echo.factory = LegacyEcho
    with LLM("m", backend="echo") as llm:
        legacy = echo.engines[-1]
        assert isinstance(llm.engine, RequestEngineBase) and llm.engine is not legacy
        assert [o.outputs[0].token_ids for o in llm.generate(["abc", "xyz"], params)] == on_base
        assert on_base[0] == FakeTokenizer().encode("abc")[::-1][:3]
        assert llm.stats() == {"num_requests_running": 0} and llm.engine.submit_on_loop is False
        llm.clear_cache()
        assert llm.generate("abc", params, lora_request=LoRARequest("ad", path="/nowhere"))[0].outputs[0].token_ids == on_base[0]
        with pytest.raises(UnsupportedError, match=f"backend 'echo' has no next_token_logprobs: {NO_QUERIES}"):
            llm.next_token_logprobs_sync([1, 2])
    assert legacy.calls == ["clear", "close"]


def test_the_facade_passes_a_lora_request_to_prepare_lora_before_a_stream(echo: EchoPlugin) -> None:
    import asyncio

    echo.factory = LegacyEcho

    async def run(llm: LLM) -> list[int]:
        request = llm.make_request("abc", SamplingParams(max_tokens=2), lora_request=LoRARequest("ad", path="/nowhere"))
        stream = await llm.open_stream(request)
        return [t for out in [o async for o in stream] for t in out.outputs[0].token_ids]

    with LLM("m", backend="echo") as llm:
        assert asyncio.run(run(llm)) == FakeTokenizer().encode("abc")[::-1][:2]
        assert echo.engines[-1].calls == ["ad"]


class BareFifo:
    """A FAKE scheduler written without ``SchedulerBase``: FCFS's planning, and none of the optional
    members (no ``fork``, ``capacity``, ``reclaim``, ``running``)."""

    def __init__(self, inner: FcfsScheduler) -> None:
        self.inner = inner

    def add(self, seq: Any) -> None:
        self.inner.add(seq)

    def remove(self, seq: Any) -> None:
        self.inner.remove(seq)

    def schedule(self) -> Any:
        return self.inner.schedule()

    def has_work(self) -> bool:
        return self.inner.has_work()


def test_a_scheduler_without_the_base_gets_the_defaults_and_ignores_what_it_cannot_take() -> None:
    from lmdock._config.model import SchedulerConfig

    bare = BareFifo(FcfsScheduler(SchedulerConfig(), max_seq_len=64, kv_capacity_tokens=None))
    seen = as_scheduler(bare)
    assert isinstance(seen, SchedulerBase) and as_scheduler(bare.inner) is bare.inner
    assert (seen.capacity, seen.reclaim, seen.config, tuple(seen.running), tuple(seen.waiting)) == (None, None, None, (), ())
    seen.capacity = 10
    seen.reclaim = lambda tokens: 0
    assert not hasattr(bare, "capacity") and not hasattr(bare, "reclaim")  # it has neither: nothing was set on it
    child = SimpleNamespace(seq_id=1, token_ids=[1], num_computed=0)
    seen.fork(SimpleNamespace(), child)  # the default: a new arrival
    assert list(bare.inner.waiting) == [child]

    asks = SimpleNamespace(capacity=5, reclaim=None, add=lambda s: None)
    seen = as_scheduler(asks)
    seen.capacity, seen.reclaim = 3, print
    assert (asks.capacity, asks.reclaim) == (3, print)  # it has both: the core sets them


class BareFifoPlugin:
    @lmdock.hookimpl
    def lmdock_make_scheduler(self, config: Any, max_seq_len: int, kv_capacity_tokens: int | None) -> Any:
        return BareFifo(FcfsScheduler(config, max_seq_len, kv_capacity_tokens)) if config.policy == "bare-fifo" else None


def test_the_loop_runs_a_scheduler_without_the_base_as_it_runs_fcfs(fake: Any) -> None:
    """Same tokens with n = 3 completions (each forked from the first one's prompt, so ``fork``'s
    default is used): the FCFS scheduler, and the same planning through the adapter."""
    _plugins.get_registry().add_plugin(BareFifoPlugin(), "bare-fifo")
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=3)
    outputs: list[Sequence[Any]] = []
    for policy in ("fcfs", "bare-fifo"):
        with LLM("m", backend="fake", scheduler={"policy": policy}) as llm:
            outputs.append([[c.token_ids for c in o.outputs] for o in llm.generate(["abc", "xyz"], params)])
            assert llm.stats()["num_sequences_held"] == 0
    assert outputs[0] == outputs[1] and all(len(o) == 3 for o in outputs[0])


def test_a_prompt_with_images_goes_through_the_engines_process_multimodal(monkeypatch: pytest.MonkeyPatch) -> None:
    """``lmdock._llm.multimodal.prepare`` asks the facade's engine for the prompt's ids: a request
    engine's default tokenizes the text as it is, an engine's own ``process_multimodal`` (an adapted
    one's too) expands it; a step engine without one is refused with the base's reason.  (The images'
    decoding, which needs pillow, is replaced by a FAKE here.)"""
    from lmdock._engine.adapters import as_step_engine
    from lmdock._llm import multimodal

    monkeypatch.setattr(multimodal, "multimodal_data", lambda values, where, limits: ("DATA", len(values)))
    vision = SimpleNamespace(name="v", capability=lambda name: (True, ""))
    assert multimodal.prepare(Echo(), vision, "abc", [b"png"], True) == (FakeTokenizer().encode("abc"), ("DATA", 1))

    class Expanding(LegacyEcho):
        def process_multimodal(self, text: str, data: Any, add_special_tokens: bool) -> list[int]:
            return [9] * data[1] + self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    assert multimodal.prepare(as_request_engine(Expanding()), vision, "ab", [b"1", b"2"], False)[0] == [9, 9, *FakeTokenizer().encode("ab", False)]
    with pytest.raises(UnsupportedError, match=r"this step engine \(FakeStepEngine\) cannot read images"):
        as_step_engine(FakeStepEngine()).process_multimodal("ab", None, True)

    class Seeing(FakeStepEngine):
        def process_multimodal(self, text: str, data: Any, add_special_tokens: bool) -> tuple[int, ...]:
            return (7, *self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    assert as_step_engine(Seeing()).process_multimodal("ab", None, False) == [7, *FakeTokenizer().encode("ab", False)]
