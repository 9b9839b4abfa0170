"""Engine reliability over the FAKE step backend: one bad request fails alone, KV state is released
exactly once on every path, nothing hangs (issue: engine reliability).  Each test here failed on the
loop before the rewrite."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import numpy as np
import pytest
from fakes import PIECES, FakePlugin, FakeStepEngine
from lmdock import (
    LLM,
    BackendError,
    ConfigError,
    EngineClosedError,
    LmdockError,
    PluginError,
    RequestError,
    SamplingParams,
    _plugins,
)
from lmdock import hookimpl as lmdock_hookimpl
from lmdock._llm.outputs import RequestOutput
from lmdock._llm.streams import RequestFuture
from lmdock.backend import BackendSpec

pytestmark = pytest.mark.usefixtures("host_overlap")

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


# -- the release rule and the scheduler ---------------------------------------------------------------


def test_aborts_at_every_stage_leave_nothing_held(fake: FakePlugin) -> None:
    with LLM("m", backend="fake", scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 8}) as llm:
        rng = np.random.default_rng(0)
        futures = []
        for i in range(60):
            fut = llm.generate_async("abcdefghij"[: 1 + i % 10], SamplingParams(temperature=1.0, seed=i, max_new_tokens=30, n=1 + i % 2))
            futures.append(fut)
            if rng.random() < 0.4:
                time.sleep(float(rng.random()) * 0.002)
                fut.cancel()
        for fut in futures:
            if not fut.cancelled():
                fut.result(timeout=20)
        wait_idle(llm)


def test_scheduler_failure_releases_siblings(fake: FakePlugin) -> None:
    fake.factory = lambda: FakeStepEngine(kv_capacity_tokens=40)
    with LLM("m", backend="fake") as llm:
        with pytest.raises(RequestError, match="KV capacity"):
            llm.generate("abc", SamplingParams(n=2, temperature=1.0, seed=1, max_new_tokens=100, ignore_eos=True))
        wait_idle(llm)
        assert llm.generate("abc", GREEDY)[0].finished


def test_beam_search_under_a_kv_budget_finishes_or_fails_never_hangs(fake: FakePlugin) -> None:
    params = SamplingParams(beam_width=4, max_new_tokens=20, ignore_eos=True)
    with LLM("m", backend="fake") as free:
        want = [o.outputs[0].token_ids for o in free.generate(PROMPTS[:3], params)]
    fake.factory = lambda: FakeStepEngine(kv_capacity_tokens=90)
    with LLM("m", backend="fake") as llm:
        futures = [llm.generate_async(p, params) for p in PROMPTS[:3]]
        got = [f.result(timeout=30).outputs[0].token_ids for f in futures]
        assert got == want  # preempted and recomputed as a group: the same hypotheses
        assert llm.engine.stats()["num_preemptions_total"] > 0
        wait_idle(llm)
    fake.factory = lambda: FakeStepEngine(kv_capacity_tokens=30)
    with LLM("m", backend="fake") as tiny:
        with pytest.raises(RequestError, match="KV capacity"):
            tiny.generate_async("abcd", params).result(timeout=30)
        wait_idle(tiny)


def test_prompt_logprobs_are_not_duplicated_by_a_preemption_mid_prefill(fake: FakePlugin) -> None:
    prompt = "fghijklmnopqrstuvwfghijklmnop"  # 30 tokens with BOS
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, prompt_logprobs=1)
    with LLM("m", backend="fake") as free:
        want = free.generate(prompt, params)[0]
    fake.factory = lambda: FakeStepEngine(kv_capacity_tokens=64)
    with LLM("m", backend="fake", scheduler={"max_num_batched_tokens": 8}) as llm:
        outs = llm.generate([prompt, prompt, "abc", "xyz"], params)
        assert llm.engine.stats()["num_preemptions_total"] > 0
    for out in outs[:2]:
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids) == 30
        assert out.prompt_logprobs == want.prompt_logprobs
        assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_generate_takes_more_prompts_than_max_waiting(fake: FakePlugin) -> None:
    with LLM("m", backend="fake", scheduler={"max_waiting": 4, "max_num_seqs": 2}) as llm:
        outs = llm.generate([f"{c}{c}" for c in "abcdefghijklmnopqrst"], GREEDY)
        assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 20
        assert [o.prompt for o in outs] == [f"{c}{c}" for c in "abcdefghijklmnopqrst"]


# -- futures, streams and refusals ---------------------------------------------------------------------


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


def test_concurrent_requests_with_random_aborts_leave_zero_held(fake: FakePlugin) -> None:
    with LLM("m", backend="fake", scheduler={"max_num_seqs": 16}) as llm:
        rng = np.random.default_rng(1)
        futures = [llm.generate_async(PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=1.0, seed=i, max_new_tokens=int(rng.integers(1, 40)), ignore_eos=True)) for i in range(200)]
        for i in rng.choice(200, 60, replace=False):
            futures[i].cancel()
        done, pending = concurrent.futures.wait([f for f in futures if not f.cancelled()], timeout=60)
        assert not pending
        wait_idle(llm)


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
