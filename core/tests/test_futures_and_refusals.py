"""Futures, streams and refusals: a future safe against a concurrent cancel, a stream that ends when
the engine dies, and what beam search, option validation and plugin names refuse."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from engine_checks import Marker
from fakes import FakePlugin, FakeStepEngine
from lmdock import (
    LLM,
    ConfigError,
    LmdockError,
    PluginError,
    RequestError,
    SamplingParams,
)
from lmdock import hookimpl as lmdock_hookimpl
from lmdock._llm.outputs import RequestOutput
from lmdock._llm.streams import RequestFuture
from lmdock._plugin import manager as _plugins
from lmdock.backend import BackendSpec

pytestmark = pytest.mark.usefixtures("host_overlap")

pytestmark = pytest.mark.usefixtures("host_overlap")


def test_request_future_is_safe_against_a_concurrent_cancel() -> None:
    final = RequestOutput("r", None, [1], [], True)
    errors: list[BaseException] = []
    for _ in range(300):
        fut = RequestFuture("r", lambda rid: None)
        barrier = threading.Barrier(2)

        def settle(f: RequestFuture = fut, b: threading.Barrier = barrier) -> None:
            b.wait()
            try:
                f.put(final)
                f.fail(RuntimeError("late"))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=settle)
        t.start()
        barrier.wait()
        fut.cancel()
        t.join()
    assert errors == []


def test_a_stream_ends_when_the_engine_dies(fake: FakePlugin) -> None:
    class DiesMidway(FakeStepEngine):
        def step(self, chunks: Any) -> Any:
            if self.steps >= 3:
                raise RuntimeError("gone")
            return super().step(chunks)

    fake.factory = DiesMidway
    with LLM("m", backend="fake") as llm:
        result: list[Any] = []

        def consume() -> None:
            try:
                for _ in llm.stream("abc", SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True)):
                    pass
            except LmdockError as exc:
                result.append(exc)

        t = threading.Thread(target=consume)
        t.start()
        t.join(timeout=10)
        assert not t.is_alive(), "the stream hung after the engine failed"
        assert result and "gone" in str(result[0])


def test_beam_search_refuses_what_it_does_not_honour(fake: FakePlugin) -> None:
    with LLM("m", backend="fake") as llm:
        for field, value in (("repetition_penalty", 1.3), ("presence_penalty", 0.5), ("min_p", 0.1), ("logprobs", 1)):
            with pytest.raises(RequestError, match=field):
                llm.generate("ab", SamplingParams(beam_width=2, **{field: value}))
        _plugins.get_registry().add_plugin(Marker("p", None, None), "some-processor")
        with pytest.raises(RequestError, match="some-processor"):
            llm.generate("ab", SamplingParams(beam_width=2))


def test_options_over_a_config_entry_are_validated(fake: FakePlugin, isolated: Any) -> None:
    (isolated / "lmdock.toml").write_text('[models.m]\nmodel = "m"\nbackend = "fake"\n')
    with pytest.raises(ConfigError, match=r"build\.dtype"):
        LLM("m", build={"dtype": "bogus"})
    with pytest.raises(ConfigError, match="nonsense"):
        LLM("m", build={"nonsense": 1})
    with pytest.raises(ConfigError, match="max_num_seqs"):
        LLM("m", scheduler={"max_num_seqs": 0})
    with pytest.raises(ConfigError, match="colour"):
        LLM("m", colour="blue")
    with LLM("m", scheduler={"max_num_seqs": 3}) as llm:  # valid overrides still apply
        assert llm.model_config.scheduler.max_num_seqs == 3


def test_two_plugins_declaring_one_backend_name_are_reported(isolated: Any) -> None:
    class Twin:
        def __init__(self, label: str) -> None:
            self.label = label

        @lmdock_hookimpl
        def lmdock_register_backends(self, register: Any) -> None:
            register(BackendSpec(name="twin", kind="step", plugin_api="1.0", description=self.label))

    reg = _plugins.get_registry()
    reg.add_plugin(Twin("first"), "plugin-a")
    reg.add_plugin(Twin("second"), "plugin-b")
    assert reg.backend("twin").description == "first"
    clash = [b for b in reg.broken.values() if b.name == "plugin-b"]
    assert clash and "already registered" in clash[0].error and "plugin-a" in clash[0].error
    assert isinstance(PluginError("x"), LmdockError)
