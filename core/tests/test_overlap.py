"""Overlap of the loop's output work with the engine step (``lmdock._engine.overlap``), over the FAKE
step backend: the work really runs on the helper thread while ``step`` computes, outputs are the same
as without it, streams stay in order, and a failure there fails its request alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from fakes import PIECES, FakePlugin, FakeStepEngine, FakeTokenizer
from lmdock import LLM, RequestError, SamplingParams
from lmdock._plugin.contract import SeqChunk, StepOutput


def tok(piece: str) -> int:
    return PIECES.index(piece)


class Beside:
    """One job handed to the helper right before a step: it may start once the step has ``began``,
    and the step lasts until it is ``done``."""

    def __init__(self) -> None:
        self.began, self.done = threading.Event(), threading.Event()


class TimedEngine(FakeStepEngine):
    """Steps say when they run (``stepping``) and leave the GIL (a 2 ms sleep); decode calls are
    logged with their thread and whether a step was running.

    A step with a job beside it (``beside``, set by :func:`handing_worker` as the job is handed over)
    lets the job start once the step has begun and returns once the job is done, instead of sleeping a
    fixed time: on a correct runner the job then runs inside the step whatever the machine's speed
    (with a 2 ms step alone, the result hung on the helper thread being scheduled within those 2 ms)."""

    overlap_host_work = True

    def __init__(self) -> None:
        super().__init__()
        self.stepping = False
        self.beside: Beside | None = None
        self.decodes: list[tuple[str, bool]] = []
        engine = self

        class Logged(FakeTokenizer):
            def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
                engine.decodes.append((threading.current_thread().name, engine.stepping))
                return super().decode(token_ids, skip_special_tokens)

        self.tokenizer = Logged()

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        beside, self.beside = self.beside, None
        self.stepping = True
        try:
            if beside is None:
                time.sleep(0.002)
            else:
                beside.began.set()
                beside.done.wait(10)
            return super().step(chunks)
        finally:
            self.stepping = False


def handing_worker(plugin: FakePlugin) -> type:
    """The overlap's helper thread, telling the newest engine of ``plugin`` about each job it is handed
    (``TimedEngine.beside``).  A job waits for its step to begin, at most 10 s once: a runner that ran
    the job before or after the step, not beside it, fails at once after that."""
    from lmdock._engine.overlap import HostWorker

    late: list[bool] = []

    class HandingWorker(HostWorker):
        def start(self, job: Callable[[], None]) -> None:
            beside = plugin.engines[-1].beside = Beside()

            def run() -> None:
                try:
                    if not late and not beside.began.wait(10):
                        late.append(True)
                    job()
                finally:
                    beside.done.set()

            super().start(run)

    return HandingWorker


def test_output_work_runs_on_the_helper_while_the_engine_steps(isolated: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdock._plugin import manager as _plugins

    inline_plugin = FakePlugin()
    _plugins.get_registry().add_plugin(inline_plugin, "fake")
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    prompts = ["ab", "cde", "xyz", "hello"]
    with LLM("m", backend="fake") as llm:
        reference = [(o.outputs[0].text, o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    _plugins.reset_registry()
    plugin = FakePlugin(factory=TimedEngine)
    _plugins.get_registry().add_plugin(plugin, "fake")
    monkeypatch.setattr("lmdock._engine.overlap.HostWorker", handing_worker(plugin))
    with LLM("m", backend="fake") as llm:
        outs = llm.generate(prompts, params)
        engine = plugin.engines[0]
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs] == reference
    on_helper = [stepping for name, stepping in engine.decodes if name == "lmdock-output"]
    assert on_helper, "no detokenization ran on the helper thread"
    # every job the helper was handed ran while the engine step beside it computed
    assert all(on_helper), f"{on_helper.count(False)} of {len(on_helper)} decodes on the helper ran outside an engine step"


@pytest.mark.usefixtures("host_overlap")
def test_streams_grow_in_order_and_end_with_the_final_output(fake: FakePlugin) -> None:
    params = SamplingParams(temperature=0.9, seed=5, n=2, max_new_tokens=30)
    prompts = ["ab", "hello", "xyz"]
    seen: dict[str, list] = {}

    def consume(llm: LLM, prompt: str) -> None:
        seen[prompt] = list(llm.stream(prompt, params))

    with LLM("m", backend="fake") as llm:
        threads = [threading.Thread(target=consume, args=(llm, p)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        finals = llm.generate(prompts, params)
        assert fake.engines[0].num_sequences() == 0
    for prompt, final in zip(prompts, finals):
        outs = seen[prompt]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        for i in range(2):
            texts = [o.outputs[i].text for o in outs]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
        assert [c.text for c in outs[-1].outputs] == [c.text for c in final.outputs]
        assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in final.outputs]


class PoisonTokenizer(FakeTokenizer):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if tok("é") in token_ids:
            raise ValueError("cannot decode é")
        return super().decode(token_ids, skip_special_tokens)


def poisoned(at: int) -> FakeStepEngine:
    """After a prompt ending in "x" the ``at``-th new token is "é" (which the tokenizer cannot
    decode); otherwise every token is "a"."""

    def logits(tokens: list[int]) -> np.ndarray:
        out = np.zeros(len(PIECES), dtype=np.float32)
        x = tok("x")
        n_out = len(tokens) - tokens.index(x) - 1 if x in tokens else -1
        out[tok("é") if n_out == at - 1 else tok("a")] = 10.0
        return out

    engine = FakeStepEngine(logits_fn=logits)
    engine.tokenizer = PoisonTokenizer()
    return engine


@pytest.mark.usefixtures("host_overlap")
@pytest.mark.parametrize("at", [3, 8], ids=["midway", "last-token"])
def test_a_detokenizer_failure_fails_its_request_alone(isolated: object, at: int) -> None:
    from lmdock._plugin import manager as _plugins

    plugin = FakePlugin(factory=lambda: poisoned(at))
    _plugins.get_registry().add_plugin(plugin, "fake")
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    with LLM("m", backend="fake") as llm:  # four requests: enough for the hand-off (MIN_DEFERRED)
        good = [llm.generate_async(p, params) for p in ("y", "ab", "cde")]
        bad = llm.generate_async("x", params)
        with pytest.raises(RequestError, match="detokeniz.*cannot decode"):
            bad.result(timeout=30)
        assert [g.result(timeout=30).outputs[0].text for g in good] == ["a" * 8] * 3
        assert llm.generate("y", params)[0].outputs[0].text == "a" * 8
        assert plugin.engines[0].num_sequences() == 0


@pytest.mark.parametrize(("engine_says", "setting", "on_helper"), [(True, None, True), (False, None, False), (False, True, True), (True, False, False)])
def test_scheduler_async_output_overrides_the_engine(isolated: object, engine_says: bool, setting: bool | None, on_helper: bool) -> None:
    from lmdock._plugin import manager as _plugins

    class Engine(TimedEngine):
        overlap_host_work = engine_says

    plugin = FakePlugin(factory=Engine)
    _plugins.get_registry().add_plugin(plugin, "fake")
    scheduler = {} if setting is None else {"scheduler": {"async_output": setting}}
    with LLM("m", backend="fake", **scheduler) as llm:
        llm.generate(["ab", "cde", "xyz", "hello"], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    names = {name for name, _ in plugin.engines[0].decodes}
    assert ("lmdock-output" in names) is on_helper, names
