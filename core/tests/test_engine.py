"""The core's generation loop over the FAKE step backend: batching, stopping, streaming, aborts."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
from fakes import PIECES, FakePlugin, FakeStepEngine, FakeTokenizer
from lmdock import LLM, QueueFullError, RequestError, SamplingParams, SchedulerConfig
from lmdock import hookimpl as lmdock_hookimpl
from lmdock._engine.detok import IncrementalDetokenizer
from lmdock.backend import FcfsScheduler

pytestmark = pytest.mark.usefixtures("host_overlap")

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def tok(piece: str) -> int:
    return PIECES.index(piece)


def scripted(pieces: list[str]) -> FakeStepEngine:
    """An engine whose n-th generated token is pieces[n], for a prompt of BOS and one token."""

    def logits(tokens: list[int]) -> np.ndarray:
        out = np.zeros(len(PIECES), dtype=np.float32)
        n_out = len(tokens) - 2
        out[tok(pieces[min(n_out, len(pieces) - 1)])] = 10.0
        return out

    return FakeStepEngine(logits_fn=logits)


def greedy_reference(engine: FakeStepEngine, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(engine.logits_fn(toks).argmax()))
    return toks[len(prompt):]


def test_greedy_follows_the_model(fake: FakePlugin) -> None:
    with LLM("m", backend="fake") as llm:
        out = llm.generate("abc", GREEDY)[0]
        ref = greedy_reference(fake.engines[0], out.prompt_token_ids, 12)
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == FakeTokenizer().decode(ref, skip_special_tokens=True)
        assert out.finished and out.outputs[0].finish_reason == "length"


PROMPTS = ["a", "bb", "cde", "hello world", "xyz", "ab ab", "q", "the cat", "z", "mm", "lorem ipsum", "k", "no", "yes", "ok.", "fin!"]


def test_batched_equals_alone_greedy_and_seeded(fake: FakePlugin) -> None:
    # The engine is held while a batch is submitted: requests go in one at a time, and the engine
    # thread, taking the first ones alone, finished them before the last arrived (2 batches in 300).
    gate = threading.Event()

    def held() -> FakeStepEngine:
        engine = FakeStepEngine()
        table = engine.table
        engine.logits_fn = lambda toks: (gate.wait(10), table[toks[-1]].copy())[1]
        return engine

    fake.factory = held
    with LLM("m", backend="fake", scheduler={"max_num_seqs": 16}) as llm:
        for params in (GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=10, ignore_eos=True)):
            gate.clear()
            futures = [llm.generate_async(p, params) for p in PROMPTS]
            gate.set()
            batched = [f.result(timeout=30).outputs[0].token_ids for f in futures]
            alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
            assert batched == alone
        assert fake.engines[0].max_live == 16  # they really ran together


def test_argmax_next_marks_exactly_the_rows_whose_next_token_is_the_argmax(fake: FakePlugin) -> None:
    """SeqChunk.argmax_next lets an engine run the next forward ahead from the argmax: the FAKE
    engine checks that every promised token is the one fed next, and counts the promises."""
    def promises(params: SamplingParams, prompts: list[str] = PROMPTS[:4]) -> int:
        before = fake.engines[0].promises
        llm.generate(prompts, params)
        return fake.engines[0].promises - before

    with LLM("m", backend="fake", scheduler={"max_num_seqs": 16}) as llm:
        assert promises(GREEDY) == 4 * 12  # one per token sampled: the prefill's and each decode's
        assert promises(SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=2)) == 4 * 12
        assert promises(SamplingParams(temperature=0, max_new_tokens=8, min_new_tokens=5, ignore_eos=True)) == 4 * 3
        assert promises(SamplingParams(temperature=0.9, seed=1, max_new_tokens=8, ignore_eos=True)) == 0
        assert promises(SamplingParams(temperature=0, repetition_penalty=1.3, max_new_tokens=8, ignore_eos=True)) == 0
        assert promises(SamplingParams(beam_width=2, n=2, max_new_tokens=6), ["ab"]) == 0
        assert promises(SamplingParams(temperature=0, max_new_tokens=16), PROMPTS) > 0  # EOS ends some early
        assert fake.engines[0].broken == []
        assert fake.engines[0].promised == {}  # every sequence released, its last promise with it


def test_continuous_batching_respects_max_num_seqs_and_chunks_prefill(fake: FakePlugin) -> None:
    long_prompt = "abcdefghijklmnopqrstuvwxyz" * 2
    with LLM("m", backend="fake") as free:
        want = [o.outputs[0].token_ids for o in free.generate([long_prompt, *PROMPTS[:5]], GREEDY)]
    with LLM("m", backend="fake", scheduler={"max_num_seqs": 2, "max_num_batched_tokens": 8}) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([long_prompt, *PROMPTS[:5]], GREEDY)]
        assert fake.engines[-1].max_live <= 2
    assert got == want


def test_kv_capacity_preempts_newest_and_recomputes(fake: FakePlugin) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    with LLM("m", backend="fake") as free:
        want = [o.outputs[0].token_ids for o in free.generate(PROMPTS[:6], params)]
    fake.factory = lambda: FakeStepEngine(kv_capacity_tokens=60)
    with LLM("m", backend="fake") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], params)]
        eng = fake.engines[-1]
    assert got == want
    assert eng.restarts > 0  # some sequences were preempted and recomputed
    assert eng.max_tokens <= 60


def test_waiting_queue_refuses_when_full() -> None:
    class S:
        def __init__(self) -> None:
            self.token_ids, self.num_computed, self.seq_id = [1, 2], 0, 0

    sched = FcfsScheduler(SchedulerConfig(max_waiting=2), max_seq_len=64, kv_capacity_tokens=None)
    sched.add(S())
    sched.add(S())
    with pytest.raises(QueueFullError, match="max_waiting"):
        sched.add(S())


def test_stop_string_spanning_tokens(fake: FakePlugin) -> None:
    fake.factory = lambda: scripted(["ab", "cde", "xyz", "a", "b"])
    with LLM("m", backend="fake") as llm:
        out = llm.generate("q", SamplingParams(temperature=0, max_new_tokens=10, stop=["bcd"]))[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == ("a", "stop", "bcd")
        assert out.token_ids == [tok("ab"), tok("cde")]
        kept = llm.generate("q", SamplingParams(temperature=0, max_new_tokens=10, stop=["dex"], include_stop_str_in_output=True))[0].outputs[0]
        assert kept.text == "abcdex"


def test_stop_token_ids_and_eos(fake: FakePlugin) -> None:
    fake.factory = lambda: scripted(["a", "b", "c", "</s>", "d"])
    with LLM("m", backend="fake") as llm:
        out = llm.generate("q", SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[tok("c")]))[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == ("ab", "stop", tok("c"))
        eos = llm.generate("q", SamplingParams(temperature=0, max_new_tokens=10))[0].outputs[0]
        assert (eos.text, eos.finish_reason, eos.token_ids[-1]) == ("abc", "stop", 2)
        ignored = llm.generate("q", SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))[0].outputs[0]
        assert (len(ignored.token_ids), ignored.finish_reason) == (6, "length")
        assert 2 in ignored.token_ids


def test_min_new_tokens_holds_off_eos(fake: FakePlugin) -> None:
    fake.factory = lambda: scripted(["</s>"])
    with LLM("m", backend="fake") as llm:
        out = llm.generate("q", SamplingParams(temperature=0, max_new_tokens=20, min_new_tokens=5))[0].outputs[0]
        assert len(out.token_ids) == 6 and 2 not in out.token_ids[:5] and out.token_ids[5] == 2
        assert out.finish_reason == "stop"


def test_n_completions_are_independent_and_seeded(fake: FakePlugin) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_new_tokens=8, ignore_eos=True)
    with LLM("m", backend="fake") as llm:
        a = llm.generate("abc", params)[0]
        b = llm.generate("abc", params)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_streamed_deltas_join_to_generate_text(fake: FakePlugin) -> None:
    params = SamplingParams(temperature=0.8, seed=3, max_new_tokens=25, stop=["xq", "zz"])

    async def collect(llm: LLM) -> list[str]:
        return [d async for d in llm.stream_generate("hello", params)]

    with LLM("m", backend="fake") as llm:
        deltas = asyncio.run(collect(llm))
        final = llm.generate("hello", params)[0].outputs[0].text
        assert "".join(deltas) == final
        snaps = list(llm.stream("hello", params))
        assert snaps[-1].finished and snaps[-1].outputs[0].text == final


def test_aborted_streams_leave_no_state(fake: FakePlugin) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)

    async def cancel_many(llm: LLM) -> None:
        for _ in range(200):
            agen = llm.stream_generate("abc", params)
            await agen.__anext__()
            await agen.aclose()

    with LLM("m", backend="fake", build={"max_seq_len": 256}) as llm:
        asyncio.run(cancel_many(llm))
        out = llm.generate("abc", GREEDY)[0]  # the next request runs
        assert len(out.outputs[0].token_ids) == 12
        stats = llm.engine.stats()
        assert _idle(stats)
        assert fake.engines[0].state == {}


def test_future_result_aresult_and_cancel(fake: FakePlugin) -> None:
    with LLM("m", backend="fake") as llm:
        fut = llm.generate_async("abc", GREEDY)
        assert fut.result(timeout=10).outputs[0].token_ids
        assert asyncio.run(llm.generate_async("abc", GREEDY).aresult()).finished

        async def many() -> list:
            return await asyncio.gather(*(llm.generate_async(p, GREEDY).aresult() for p in PROMPTS))

        assert len(asyncio.run(many())) == 16


def test_bad_request_fails_alone(fake: FakePlugin) -> None:
    with LLM("m", backend="fake") as llm:
        with pytest.raises(RequestError, match="prompt is empty"):
            llm.generate("", GREEDY)
        with pytest.raises(RequestError, match="context is 256"):
            llm.generate([1] * 300, GREEDY)
        with pytest.raises(RequestError, match="outside the vocabulary"):
            llm.generate([[1, 99999]], GREEDY)
        with pytest.raises(RequestError, match="prompt 1: "):
            llm.generate(["ab", ""], GREEDY)
        assert llm.generate("ab", GREEDY)[0].finished


def test_engine_failure_fails_its_batch_and_the_engine_carries_on(fake: FakePlugin) -> None:
    def poisoned(tokens: list[int]) -> np.ndarray:
        if tokens[-1] == tok("!"):
            raise RuntimeError("device lost")
        return np.eye(len(PIECES), dtype=np.float32)[tok("a")] * 5

    fake.factory = lambda: FakeStepEngine(logits_fn=poisoned)
    with LLM("m", backend="fake") as llm:
        with pytest.raises(Exception, match="engine step failed: RuntimeError: device lost"):
            llm.generate("a!", GREEDY)
        assert llm.generate("ab", GREEDY)[0].outputs[0].text == "a" * 12


def test_logprobs_and_prompt_logprobs(fake: FakePlugin) -> None:
    with LLM("m", backend="fake") as llm:
        out = llm.generate("abc", SamplingParams(temperature=0, max_new_tokens=3, logprobs=2, prompt_logprobs=1, ignore_eos=True))[0]
        table = fake.engines[0].table.astype(np.float64)
        lsm = table - np.log(np.exp(table).sum(axis=1, keepdims=True))
        ids = out.prompt_token_ids
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for i in range(1, len(ids)):
            assert out.prompt_logprobs[i][ids[i]].logprob == pytest.approx(lsm[ids[i - 1], ids[i]], abs=1e-5)
        toks = ids + out.outputs[0].token_ids
        for j, pos in enumerate(out.outputs[0].logprobs):
            t = toks[len(ids) + j]
            assert pos[t].rank == 1 and pos[t].logprob == pytest.approx(lsm[toks[len(ids) + j - 1], t], abs=1e-5)
            assert len(pos) == 2
        assert out.outputs[0].cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)))


def test_default_sampling_params_layering(fake: FakePlugin, isolated: Path) -> None:
    def engine() -> FakeStepEngine:
        e = FakeStepEngine()
        e.generation_config = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 33, "bos_token_id": 1}
        return e

    fake.factory = engine
    (isolated / "lmdock.toml").write_text('[models.f]\nmodel = "m"\nbackend = "fake"\n[models.f.sampling]\ntop_p = 0.5\n')
    with LLM("f") as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_p, d.max_new_tokens) == (0.6, 0.5, 33)
        assert llm._params({"temperature": 0.1}).temperature == 0.1
        assert llm._params({"temperature": 0.1}).top_p == 0.5


def test_chat_needs_a_template(fake: FakePlugin) -> None:
    with LLM("m", backend="fake") as llm:
        with pytest.raises(RequestError, match="no chat template"):
            llm.chat([{"role": "user", "content": "hi"}])
        out = llm.chat([{"role": "user", "content": "abc"}], GREEDY, chat_template="{{ messages }}")
        assert out[0].prompt == "abc" and out[0].prompt_token_ids == FakeTokenizer().encode("abc", add_special_tokens=False)


def test_shutdown_is_idempotent(fake: FakePlugin) -> None:
    llm = LLM("m", backend="fake")
    llm.shutdown()
    llm.shutdown()
    assert fake.engines[0].closed
    with pytest.raises(Exception, match="shut down"):
        llm.generate("ab")


class ByteTokenizer:
    """Tokens are single bytes: a multi-byte character spans tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_never_emits_half_a_character() -> None:
    text = "aé😀b"
    detok = IncrementalDetokenizer(ByteTokenizer(), [], skip_special_tokens=False)  # type: ignore[arg-type]
    deltas = [detok.push(b) for b in text.encode()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text


def test_next_token_logprobs_batches_and_caches(fake: FakePlugin) -> None:
    with LLM("m", backend="fake") as llm:
        eng = fake.engines[0]
        table = eng.table.astype(np.float64)
        lsm = table - np.log(np.exp(table).sum(axis=1, keepdims=True))
        prefixes = [[1, tok("a")], [1, tok("b")], [1, tok("a"), tok("c")], [1, tok("z")]]

        async def many() -> np.ndarray:
            return await llm.batch_next_token_logprobs(prefixes)

        steps = eng.steps
        got = asyncio.run(many())
        for row, p in zip(got, prefixes):
            np.testing.assert_allclose(row, lsm[p[-1]], atol=1e-5)
        assert eng.steps - steps <= 2  # the four queries ran together, not one by one
        steps = eng.steps
        again = llm.next_token_logprobs_sync([1, tok("a"), tok("c")])
        assert eng.steps == steps  # a cache hit runs no step
        np.testing.assert_array_equal(again, got[2])
        # an extension of a cached prefix forks its KV state: only the new token is fed
        ext = llm.next_token_logprobs_sync([1, tok("a"), tok("c"), tok("d")])
        np.testing.assert_allclose(ext, lsm[tok("d")], atol=1e-5)
        llm.clear_cache()
        assert eng.state == {}
        with pytest.raises(RequestError, match="outside the vocabulary"):
            llm.next_token_logprobs_sync([1, 10_000])


def test_beam_search_returns_ranked_hypotheses_and_frees_state(fake: FakePlugin) -> None:
    def eos_later(tokens: list[int]) -> np.ndarray:
        out = fake.engines[0].table[tokens[-1]].copy() if fake.engines else np.zeros(len(PIECES), np.float32)
        if len(tokens) >= 5:
            out[2] = out.max() + 1.0  # EOS becomes likely after a few tokens
        return out

    fake.factory = lambda: FakeStepEngine(logits_fn=eos_later)
    with LLM("m", backend="fake") as llm:
        out = llm.generate("ab", SamplingParams(beam_width=3, n=3, max_new_tokens=8))[0]
        assert out.finished and len(out.outputs) == 3
        scores = [o.cumulative_logprob / len(o.token_ids) for o in out.outputs]
        assert scores == sorted(scores, reverse=True)
        assert any(o.finish_reason == "stop" and o.token_ids[-1] == 2 for o in out.outputs)
        assert _idle(llm.engine.stats())
        assert fake.engines[0].state == {}
        with pytest.raises(RequestError, match="beam search"):
            llm.generate("ab", SamplingParams(beam_width=2, stop=["x"]))


def test_plugin_logits_processors_and_sampler_override(fake: FakePlugin) -> None:
    from lmdock._plugin import manager as _plugins
    from lmdock.backend import ReferenceSampler

    banned = tok("a")

    class BanA:
        @lmdock_hookimpl
        def lmdock_logits_processors(self, params):  # type: ignore[no-untyped-def]
            def ban(token_ids: list[int], logits: np.ndarray) -> np.ndarray:
                logits[banned] = -np.inf
                return logits

            return [ban]

    class CountingSampler(ReferenceSampler):
        calls = 0

        def sample(self, logits, rows):  # type: ignore[no-untyped-def]
            CountingSampler.calls += 1
            return super().sample(logits, rows)

    class Native:
        @lmdock_hookimpl(tryfirst=True)
        def lmdock_make_sampler(self, backend, model_config):  # type: ignore[no-untyped-def]
            return CountingSampler() if backend == "fake" else None

    fake.factory = lambda: scripted(["a", "b"])  # the model wants "a" first
    reg = _plugins.get_registry()
    reg.add_plugin(BanA(), "ban-a")
    reg.add_plugin(Native(), "native-sampler")
    with LLM("m", backend="fake") as llm:
        out = llm.generate("q", SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))[0].outputs[0]
    assert banned not in out.token_ids  # the processor ran, even on a greedy request
    assert CountingSampler.calls == 3  # the plugin's sampler replaced the reference one


def test_progress_bar_only_when_asked_or_on_a_terminal(fake: FakePlugin, capsys: pytest.CaptureFixture[str]) -> None:
    with LLM("m", backend="fake") as llm:
        llm.generate(PROMPTS, GREEDY)
        assert capsys.readouterr().err == ""  # not a terminal
        llm.generate(PROMPTS, GREEDY, use_tqdm=True)
        err = capsys.readouterr().err
        assert "Processed prompts" in err and "16/16" in err


def test_a_sink_whose_listener_is_gone_does_not_stop_the_engine(fake: FakePlugin) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)

    async def leave_early(llm: LLM) -> None:
        agen = llm.stream_generate("abc", params)
        await agen.__anext__()
        await agen.aclose()  # the abort reaches the engine after this event loop has closed

    with LLM("m", backend="fake", build={"max_seq_len": 256}) as llm:
        for _ in range(20):
            asyncio.run(leave_early(llm))

        class Broken:
            def put(self, output: object) -> None:
                raise RuntimeError("listener crashed")

            fail = put

        from lmdock.backend import EngineRequest

        llm.engine.submit(EngineRequest("broken", None, [1, 3], GREEDY), Broken())
        assert llm.generate("ab", GREEDY)[0].finished  # the engine still serves


def test_structured_output_is_refused_where_the_backend_cannot_constrain(fake: FakePlugin) -> None:
    with LLM("m", backend="fake") as llm:
        params = SamplingParams(max_new_tokens=3, structured_output={"regex": "[a-z]+"})
        with pytest.raises(RequestError, match="structured_output: backend 'fake' cannot constrain"):
            llm.generate("hello", params)
        assert llm.generate("hello", SamplingParams(max_new_tokens=3))[0].outputs[0].token_ids  # still serves


def test_token_biases_are_refused_where_the_backend_lacks_the_capability(fake: FakePlugin) -> None:
    with LLM("m", backend="fake") as llm:
        for field, value in (("logit_bias", {3: -100}), ("allowed_token_ids", (3, 4)), ("bad_words", ("ab",))):
            with pytest.raises(RequestError, match=rf"^{field}: backend 'fake' cannot bias or ban tokens"):
                llm.generate("hello", SamplingParams(max_new_tokens=3, **{field: value}))


def _idle(stats: dict) -> bool:
    """Nothing running or waiting, and the backend holds no sequence."""
    return (stats["num_sequences_running"], stats["num_sequences_waiting"], stats["num_sequences_held"]) == (0, 0, 0)


def test_sampling_params_and_make_request_are_what_generate_runs(fake: FakePlugin) -> None:
    """The public calls a front end (lmdock serve, lmdock batch) builds requests with."""
    from lmdock import ConfigError
    from lmdock._llm.streams import RequestStream

    with LLM("m", backend="fake") as llm:
        params = llm.sampling_params({"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert params == llm.get_default_sampling_params().replace(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        assert llm.sampling_params(None) == llm.get_default_sampling_params() and llm.sampling_params(GREEDY) is GREEDY
        with pytest.raises(ConfigError, match="temperature"):
            llm.sampling_params({"temperature": -1})
        request = llm.make_request("abc", params, stream=True)
        assert request.stream and request.params == params and request.prompt == "abc"
        assert llm.make_request("abc", params, add_special_tokens=False).prompt_token_ids != request.prompt_token_ids
        with pytest.raises(RequestError, match="empty"):
            llm.make_request("", params)
        stream = RequestStream(request.request_id, llm.engine.abort)
        llm.engine.submit(request, stream)
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(stream.get(timeout=30))
        assert outs[-1].outputs[0].token_ids == llm.generate("abc", params)[0].outputs[0].token_ids
