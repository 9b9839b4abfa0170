"""Containment over the FAKE step backend: a failing logits processor, engine step, detokenizer or
backend fails its request (or that step) alone and releases what it held; a backend that keeps failing
is declared dead (docs/engine.md, "Containment")."""

from __future__ import annotations

from typing import Any

import pytest
from engine_checks import GREEDY, PROMPTS, Marker, held, wait_idle
from fakes import PIECES, FakePlugin, FakeStepEngine
from lmdock import (
    LLM,
    BackendError,
    EngineClosedError,
    LmdockError,
    RequestError,
    SamplingParams,
)
from lmdock._plugin import manager as _plugins

pytestmark = pytest.mark.usefixtures("host_overlap")

pytestmark = pytest.mark.usefixtures("host_overlap")


# -- containment ------------------------------------------------------------------------------------


def test_a_failing_logits_processor_fails_its_request_alone(fake: FakePlugin) -> None:
    _plugins.get_registry().add_plugin(Marker("bad"), "bad-processor")
    ok = SamplingParams(temperature=0.7, seed=5, max_new_tokens=8, ignore_eos=True)
    with LLM("m", backend="fake") as llm:
        alone = [llm.generate(p, ok)[0].outputs[0].token_ids for p in PROMPTS]
        futures = [llm.generate_async(p, ok) for p in PROMPTS]
        bad = llm.generate_async("zz", ok.replace(seed=666))
        with pytest.raises(RequestError, match=r"plugin 'bad-processor'.*ZeroDivisionError: boom"):
            bad.result(timeout=10)
        # the others were not touched: same tokens as alone, their seeds' draws not disturbed
        assert [f.result(timeout=10).outputs[0].token_ids for f in futures] == alone
        assert llm.generate("abc", ok)[0].outputs[0].token_ids  # the engine serves on
        wait_idle(llm)


def test_processors_run_in_plugin_registration_order(fake: FakePlugin) -> None:
    calls: list[str] = []
    _plugins.get_registry().add_plugin(Marker("first", calls, None), "first")
    _plugins.get_registry().add_plugin(Marker("second", calls, None), "second")
    with LLM("m", backend="fake") as llm:
        llm.generate("a", SamplingParams(temperature=0.5, seed=1, max_new_tokens=1))
    assert calls == ["first", "second"]


def test_a_failing_engine_step_fails_that_step_only_and_releases_state(fake: FakePlugin) -> None:
    class Flaky(FakeStepEngine):
        fail_next = False

        def step(self, chunks: Any) -> Any:
            for c in chunks:  # take KV state first, as real engines do, then fail
                self.state.setdefault(c.seq_id, [])
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("device lost")
            return super().step(chunks)

    fake.factory = Flaky
    with LLM("m", backend="fake") as llm:
        eng = fake.engines[0]
        eng.fail_next = True  # the very first step of this request fails: its slot must not leak
        with pytest.raises(BackendError, match="device lost"):
            llm.generate("abc", GREEDY)
        assert held(llm) == 0
        assert len(llm.generate(PROMPTS, GREEDY)) == len(PROMPTS)  # and it keeps serving
        wait_idle(llm)


def test_a_backend_that_keeps_failing_is_declared_dead(fake: FakePlugin) -> None:
    class Broken(FakeStepEngine):
        def step(self, chunks: Any) -> Any:
            raise RuntimeError("always")

    fake.factory = Broken
    with LLM("m", backend="fake") as llm:
        for _ in range(3):
            with pytest.raises(BackendError, match="always"):
                llm.generate("abc", GREEDY)
        with pytest.raises(EngineClosedError, match="declared dead"):
            llm.generate("abc", GREEDY)


def test_too_few_rows_from_the_backend_fail_the_step_not_the_engine(fake: FakePlugin) -> None:
    class Short(FakeStepEngine):
        short = True

        def step(self, chunks: Any) -> Any:
            out = super().step(chunks)
            if self.short and len(chunks) > 1:
                self.short = False
                out.last = out.last[:-1]
            return out

    fake.factory = Short
    with LLM("m", backend="fake") as llm:
        with pytest.raises(BackendError, match="shape"):
            llm.generate(PROMPTS[:3], GREEDY)
        assert len(llm.generate(PROMPTS[:3], GREEDY)) == 3
        wait_idle(llm)


def test_a_failing_detokenizer_fails_its_request_alone(fake: FakePlugin) -> None:
    with LLM("m", backend="fake") as llm:
        tokenizer = llm.engine.tokenizer
        original = tokenizer.decode
        poison = PIECES.index("é")

        def decode(ids: Any, skip_special_tokens: bool = False) -> str:
            if poison in list(ids):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
            return original(ids, skip_special_tokens)

        tokenizer.decode = decode  # type: ignore[method-assign]
        good = llm.generate_async("abc", GREEDY.replace(detokenize=False))  # token ids only: never decodes
        bad = llm.generate_async("é", GREEDY)  # its prompt holds the poisoned token
        with pytest.raises(LmdockError, match="UnicodeDecodeError"):
            bad.result(timeout=10)
        assert good.result(timeout=10).finished
        wait_idle(llm)
