"""``tensorrt_llm.LLM`` as an lmdock request engine.

TensorRT-LLM schedules and samples for itself.  Requests go to ``LLM.generate_async`` on an asyncio
loop in a background thread (its results are async iterables when ``streaming=True``); each result
is converted to lmdock's ``RequestOutput`` and reported to the request's sink.  Abort calls
``result.abort()``; close calls ``LLM.shutdown()``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from lmdock import BackendError, EngineClosedError, ModelConfig, RequestError, UnsupportedError
from lmdock.backend import (
    CompletionOutput,
    EngineRequest,
    Logprob,
    OutputSink,
    RequestEngineBase,
    RequestOutput,
    read_model_json,
    safe_fail,
    safe_put,
)

from lmdock_trtllm._refs import materialize
from lmdock_trtllm._translate import Api, sampling_kwargs

_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}


def _llm_class(api: Api) -> Any:
    if api == "legacy":
        try:
            from tensorrt_llm._tensorrt_engine import LLM  # releases 1.0-1.2

            return LLM
        except ImportError:
            pass
    from tensorrt_llm import LLM

    return LLM


class TrtllmEngine(RequestEngineBase):
    def __init__(self, llm: Any, api: Api, max_seq_len: int, generation_config: dict[str, Any], guided_backend: str | None = None,
                 vocab_size: int | None = None) -> None:
        self._llm = llm
        self.guided_backend = guided_backend
        self.vocab_size = vocab_size  # the logits' width, for logit_bias and allowed_token_ids
        self.api = api
        self.tokenizer = getattr(llm, "tokenizer", None)
        self.max_seq_len = max_seq_len
        self.generation_config = generation_config
        self._results: dict[str, Any] = {}
        #: requests in flight (submitted, not yet finished or failed) and their sinks
        self._sinks: dict[str, OutputSink] = {}
        #: aborts that arrived before TensorRT-LLM's result handle existed
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lmdock-trtllm", daemon=True)
        self._thread.start()
        self._closed = False

    @classmethod
    def load(cls, mc: ModelConfig, api: Api, llm_kwargs: dict[str, Any]) -> TrtllmEngine:
        kwargs = materialize(llm_kwargs)
        try:
            llm = _llm_class(api)(**kwargs)
        except ValueError as exc:  # unknown or invalid arguments, checked before anything loads
            raise BackendError(f"TensorRT-LLM refused the configuration of {mc.model!r}: {exc}") from exc
        max_seq_len = int(getattr(getattr(llm, "args", None), "max_seq_len", None) or llm_kwargs.get("max_seq_len") or 0) or _context(mc.model)
        return cls(llm, api, max_seq_len, read_model_json(mc.model, "generation_config.json"), llm_kwargs.get("guided_decoding_backend"),
                   read_model_json(mc.model, "config.json").get("vocab_size"))

    # -- the RequestEngine interface ------------------------------------------------------------

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        if not request.prompt_token_ids:
            raise RequestError("the prompt is empty: give at least one token or a non-empty string")
        if len(request.prompt_token_ids) >= self.max_seq_len:
            raise RequestError(f"the prompt has {len(request.prompt_token_ids)} tokens but the model's context is {self.max_seq_len}")
        try:
            kwargs = sampling_kwargs(request.params, prompt_len=len(request.prompt_token_ids), max_seq_len=self.max_seq_len,
                                     guided_backend=self.guided_backend, vocab_size=self.vocab_size)
        except UnsupportedError as exc:
            raise RequestError(str(exc)) from None
        from tensorrt_llm import SamplingParams

        params = SamplingParams(**materialize(kwargs))
        with self._lock:  # close() fails whatever is registered here: a submit never slips past it
            if self._closed:
                raise EngineClosedError("this LLM was shut down; create a new one")
            self._sinks[request.request_id] = sink
        asyncio.run_coroutine_threadsafe(self._run(request, params, sink), self._loop)

    async def _run(self, request: EngineRequest, params: Any, sink: OutputSink) -> None:
        rid = request.request_id
        try:
            if self._take_abort(rid):
                self._done(rid, sink, _aborted(request))
                return
            result = self._llm.generate_async(list(request.prompt_token_ids), sampling_params=params, streaming=request.stream)
            self._results[rid] = result
            if self._take_abort(rid):  # aborted while the handle was being made
                result.abort()
            if request.stream:
                async for out in result:
                    converted = self._convert(request, out)
                    if converted.finished:
                        self._done(rid, sink, converted)
                    else:
                        safe_put(sink, converted)
            else:
                self._done(rid, sink, self._convert(request, await result.aresult()))
        except Exception as exc:
            self._done(rid, sink, BackendError(f"TensorRT-LLM failed request {rid}: {type(exc).__name__}: {exc}"))
        finally:
            self._results.pop(rid, None)
            with self._lock:
                if self._sinks.pop(rid, None) is not None:  # ended without a final output
                    safe_fail(sink, BackendError(f"TensorRT-LLM ended request {rid} without a final output"))

    def _take_abort(self, rid: str) -> bool:
        with self._lock:
            if rid in self._aborted:
                self._aborted.discard(rid)
                return True
            return False

    def _done(self, rid: str, sink: OutputSink, item: RequestOutput | BaseException) -> None:
        """The request's last word: a final output or an error, once (close may have failed it already)."""
        with self._lock:
            if self._sinks.pop(rid, None) is None:
                return
        if isinstance(item, BaseException):
            safe_fail(sink, item)
        else:
            safe_put(sink, item)

    def abort(self, request_id: str) -> None:
        def _abort() -> None:
            result = self._results.get(request_id)
            if result is not None:
                result.abort()
            else:
                with self._lock:
                    if request_id in self._sinks:
                        self._aborted.add(request_id)

        if not self._closed:
            self._loop.call_soon_threadsafe(_abort)

    def close(self) -> None:
        """Fail every request in flight with EngineClosedError, then shut TensorRT-LLM down."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            inflight, self._sinks = self._sinks, {}
        error = EngineClosedError("the LLM was shut down")
        for sink in inflight.values():
            safe_fail(sink, error)
        try:
            self._llm.shutdown()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    # -- conversion -----------------------------------------------------------------------------

    def _convert(self, request: EngineRequest, out: Any) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=c.index,
                text=c.text or "",
                token_ids=list(c.token_ids or []),
                cumulative_logprob=c.cumulative_logprob,
                logprobs=_logprobs(c.logprobs),
                finish_reason=_FINISH.get(c.finish_reason, c.finish_reason),
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
        prompt_lp = _logprobs(out.outputs[0].prompt_logprobs) if out.outputs else None
        if prompt_lp is not None:
            prompt_lp = [None, *prompt_lp][: len(request.prompt_token_ids)]
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids), outputs, bool(out.finished), prompt_lp)


def _aborted(request: EngineRequest) -> RequestOutput:
    return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                         [CompletionOutput(0, "", [], None, None, "abort")], True, None)


def _logprobs(value: Any) -> list[dict[int, Logprob]] | None:
    """TensorRT-LLM's TokenLogprobs (list of {token_id: Logprob(logprob, rank)}) -> lmdock's."""
    if not value:
        return None
    if isinstance(value[0], float):  # the simple format: the chosen token's logprob only
        return None
    return [{int(t): Logprob(float(lp.logprob), getattr(lp, "rank", None)) for t, lp in pos.items()} for pos in value]


def _context(model: str) -> int:
    return int(read_model_json(model, "config.json").get("max_position_embeddings") or 2048)
