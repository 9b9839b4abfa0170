"""The generation loop that turns a step engine into a request engine.

One background thread owns the step engine.  Callers submit requests from any thread; each step of
the loop is a numbered pipeline (``StepRunner._step``):

1. schedule: the scheduler's plan, and the sequences it preempted or cannot ever fit;
2. release what was preempted, fail what cannot fit, and keep only live sequences in the plan;
3. one engine step over the plan (a failed step fails that step's sequences, nothing else);
4. prompt logprobs, and KV progress; finished next-token queries go to the prefix cache;
5. beam search for beam requests whose beams all have logits;
6. sampling (batch-wide; a row whose logits processor fails fails its request alone);
7. append, detokenize and check stops (``OutputProcessor``); release finished sequences at once;
8. report: every step for streaming requests, at the end for the others.

Overlap (``async_output``): on an engine whose step leaves the GIL and a CPU core free, the detokenization
and reports of requests without stop strings are deferred from 7-8 to a helper thread that runs
them during the next step's ``engine.step`` (``lmdock._engine.overlap``).  What the next step
depends on (the token, EOS, stop token ids, length) is still decided in 7; pending work is flushed
before anything else touches those requests (aborts, failures, an idle loop, shutdown).

Containment: whatever goes wrong while serving one request fails that request alone, with an error that
names the cause, and releases its state.  Only an engine whose steps keep failing
(``max_consecutive_failures`` in a row) is declared dead: every waiter gets the error at once and new
requests are refused with it.  The release rule is in ``lmdock._engine.sequence``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lmdock._contract import EngineRequest, OutputSink, SeqChunk, StepEngine
from lmdock._engine.beam import UNSUPPORTED_WITH_BEAMS, beam_choices
from lmdock._engine.constraints import apply_masks
from lmdock._engine.output import OutputProcessor
from lmdock._engine.overlap import HostWorker
from lmdock._engine.prefix_cache import PromptCache
from lmdock._engine.queries import Queries
from lmdock._engine.sampler import LogitsProcessor, Sample, Sampler, log_softmax
from lmdock._engine.scheduler import Scheduler
from lmdock._engine.sequence import QuerySeq, Req, Seq
from lmdock._errors import BackendError, EngineClosedError, LmdockError, RequestError
from lmdock._sinks import safe_fail, safe_put

log = logging.getLogger("lmdock.engine")

#: Consecutive failed engine steps after which the engine is declared dead.
MAX_CONSECUTIVE_FAILURES = 3
#: Overlap: a step's output work goes to the helper thread only when it has at least this many
#: texts to detokenize and outputs to report; less does not pay for the hand-off (~10-20 us,
#: ``benchmarks/engine_overhead.py --compute-us``).
MIN_DEFERRED = 4


class StepRunner:
    """A :class:`lmdock.backend.RequestEngine` over a :class:`lmdock.backend.StepEngine`.

    ``processors_for(params)`` returns the request's logits processors, each already named after the
    plugin that contributed it (see ``lmdock._loader``); it is called in the submitting thread, so a
    failing hook fails that request at ``submit``.
    """

    def __init__(
        self,
        engine: StepEngine,
        scheduler: Scheduler,
        sampler: Sampler,
        processors_for: Callable[[Any], Sequence[LogitsProcessor]] = lambda params: (),
        *,
        max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES,
        constraints_for: Callable[[Any, int], Sequence[Any] | None] | None = None,
        prefix_caching: bool = False,
        async_output: bool | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_seq_len = engine.max_seq_len
        self.generation_config = engine.generation_config
        self.scheduler = scheduler
        self.sampler = sampler
        self.output = OutputProcessor(engine.tokenizer, engine.eos_token_ids, engine.max_seq_len)
        self.queries = Queries(engine, scheduler, self._new_seq_id, self._release)
        #: automatic prefix caching of generate prompts (``kv_cache.enable_prefix_caching``); turned off
        #: for good the first time the engine cannot fork
        self.prompt_cache: PromptCache | None = PromptCache() if prefix_caching else None
        self._processors_for = processors_for
        #: ``constraints_for(params, n)``: one structured-output constraint per completion, or None
        #: (``lmdock._engine.constraints``); None here: requests with structured_output are refused
        self._constraints_for = constraints_for
        self._max_failures = max_consecutive_failures
        self._failures = 0
        self._preemptions = 0
        self._inbox: deque[tuple[str, Any]] = deque()
        self._cv = threading.Condition()
        self._reqs: dict[str, Req] = {}
        self._next_seq = 0
        self._closing = False
        self._closed = False
        self._dead: BaseException | None = None
        #: overlap: a helper thread for deferred output work (``async_output``; by default where the
        #: engine's step leaves the GIL and a core free)
        if async_output is None:
            async_output = bool(getattr(engine, "overlap_host_work", False))
        self._worker: HostWorker | None = HostWorker() if async_output else None
        #: the last step's deferred work: (seq, token, stopped by token) to detokenize, then requests
        #: to report; run during the next engine step, or flushed
        self._pending: tuple[list[tuple[Seq, int, bool]], list[Req]] | None = None
        self._thread = threading.Thread(target=self._loop, name="lmdock-engine", daemon=True)
        self._thread.start()

    # -- the RequestEngine interface (any thread) ------------------------------------------------

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        processors = self._validate(request)
        constraints = self._constraints(request)
        self._post("add", (request, sink, processors, constraints))

    def abort(self, request_id: str) -> None:
        with self._cv:
            if self._closing:
                return  # shutdown fails whatever is in flight
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    def next_token_logprobs(self, token_ids: Sequence[int]) -> concurrent.futures.Future[np.ndarray]:
        """A future of the log-probabilities (float32, [vocab]) of the token after ``token_ids``.

        Queries that arrive together run in one batch; results and KV state go to the prefix cache.
        """
        ids = list(token_ids)
        if not ids:
            raise RequestError("next_token_logprobs needs at least one token id")
        self._check_ids(ids)
        future: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        self._post("query", (ids, future))
        return future

    def clear_cache(self) -> None:
        """Drop the prefix cache (results and the KV state it holds)."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._post("clear", done)
        done.result()

    def close(self) -> None:
        """Stop the loop: requests in flight fail with ``EngineClosedError``; every sequence is
        released; then the engine is closed.  Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closing = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._closed = True
        try:
            self.engine.close()
        except Exception:
            log.exception("closing the step engine failed")

    def stats(self) -> dict[str, Any]:
        """Live counts for monitoring (the server's /metrics) and tests; safe from any thread."""
        running = list(getattr(self.scheduler, "running", ()))
        waiting = list(getattr(self.scheduler, "waiting", ()))
        capacity = getattr(self.engine, "kv_capacity_tokens", None)
        held = getattr(self.engine, "num_sequences", None)
        active = {id(s.req) for s in running if s.req is not None}
        return {
            "num_requests_running": len(active),
            "num_requests_waiting": len({id(s.req) for s in waiting if s.req is not None} - active),
            "num_sequences_running": len(running),
            "num_sequences_waiting": len(waiting),
            "kv_cache_usage_perc": (sum(s.num_computed for s in running) / capacity) if capacity else 0.0,
            "num_preemptions_total": self._preemptions,
            # sequences held for requests; the prefix caches hold theirs on purpose
            "num_sequences_held": (held() - self._cache_held()) if callable(held) else None,
            "num_sequences_cached": self._cache_held(),
            "prefix_cache_hit_tokens": self.prompt_cache.hit_tokens if self.prompt_cache is not None else 0,
            "dead": self._dead is not None,
        }

    def _cache_held(self) -> int:
        n = len(self.queries.cache)
        return n + (len(self.prompt_cache) if self.prompt_cache is not None else 0)

    def _post(self, kind: str, item: Any) -> None:
        with self._cv:
            if self._dead is not None:
                raise EngineClosedError(f"the engine is dead: {self._dead}")
            if self._closing:
                raise EngineClosedError("this LLM was shut down; create a new one")
            self._inbox.append((kind, item))
            self._cv.notify()

    def _validate(self, request: EngineRequest) -> list[LogitsProcessor]:
        ids, p = request.prompt_token_ids, request.params
        if not ids:
            raise RequestError("the prompt is empty: give at least one token or a non-empty string")
        if len(ids) >= self.max_seq_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but the model's context is {self.max_seq_len}; "
                "shorten the prompt to leave room for the output"
            )
        self._check_ids(ids)
        vocab = self.engine.vocab_size
        if p.stop and not p.detokenize:
            raise RequestError("stop strings need detokenize=True; use stop_token_ids instead")
        bad_stop = next((t for t in p.stop_token_ids if not 0 <= t < vocab), None)
        if bad_stop is not None:
            raise RequestError(f"stop_token_ids: {bad_stop} is outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and k > vocab:
                raise RequestError(f"{name}={k} is larger than the vocabulary ({vocab})")
        try:
            processors = list(self._processors_for(p))
        except LmdockError:
            raise
        except Exception as exc:
            raise RequestError(f"a plugin's lmdock_logits_processors hook failed: {type(exc).__name__}: {exc}") from exc
        if p.beam_width > 1:
            bad = [name for name, neutral in UNSUPPORTED_WITH_BEAMS.items() if getattr(p, name) not in (neutral, None)]
            if processors:
                bad.append("logits processors from " + ", ".join(sorted({getattr(x, "plugin", "a plugin") for x in processors})))
            if bad:
                raise RequestError(
                    f"beam search (beam_width={p.beam_width}) does not honour {', '.join(bad)}; "
                    "remove them, or sample instead of beam search"
                )
        return processors

    def _constraints(self, request: EngineRequest) -> Sequence[Any] | None:
        """Compile the request's structured output (in the caller's thread): a bad schema fails here."""
        so = request.params.structured_output
        if so is None:
            return None
        if self._constraints_for is None:
            raise RequestError("structured_output: this engine has no grammar engine; pip install llguidance")
        return self._constraints_for(request.params, request.params.n)

    def _check_ids(self, ids: Sequence[int]) -> None:
        vocab = self.engine.vocab_size
        bad = next((t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)), None)
        if bad is not None:
            raise RequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) > self.max_seq_len:
            raise RequestError(f"{len(ids)} tokens exceed the model's context ({self.max_seq_len})")

    # -- the loop (engine thread) -----------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as exc:  # a bug in the loop itself: fail everything loudly, never hang
            error = EngineClosedError(f"the engine loop stopped: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._die(error)
            log.exception("the engine loop stopped")
        finally:
            self._release_everything()
            if self._worker is not None:
                self._worker.close()
            # optional: per-thread resources the engine made in this thread (MLX streams)
            thread_exit = getattr(self.engine, "thread_exit", None)
            if thread_exit is not None:
                try:
                    thread_exit()
                except Exception:
                    log.exception("the step engine's thread_exit failed")

    def _iterate(self) -> bool:
        with self._cv:
            while not self._inbox and not self.scheduler.has_work() and not self._closing:
                self._cv.wait()
            inbox, self._inbox = self._inbox, deque()
            closing = self._closing
        if closing or any(kind == "abort" for kind, _ in inbox):
            self._flush()  # before an abort or a shutdown touches a request; new requests do not
        for kind, item in inbox:
            self._take(kind, item)
        if closing:
            self._die(EngineClosedError("the LLM was shut down"), dead=False)
            return False
        if self.scheduler.has_work():
            self._step()
        if self._pending is not None and not self.scheduler.has_work():
            self._flush()  # no next step to overlap with
        return self._dead is None

    def _take(self, kind: str, item: Any) -> None:
        if kind == "add":
            request, sink, processors, constraints = item
            try:
                self._add(request, sink, processors, constraints)
            except Exception as exc:
                safe_fail(sink, _as_request_error(exc, "adding the request"))
        elif kind == "abort":
            req = self._reqs.get(item)
            if req is not None:
                self._finish(req, "abort")
        elif kind == "query":
            ids, future = item
            try:
                self.queries.add(ids, future)
            except Exception as exc:
                future.set_exception(_as_request_error(exc, "adding the query"))
        else:  # "clear"
            try:
                self.queries.clear()
                self._drop_prompt_cache()
                item.set_result(None)
            except Exception as exc:
                item.set_exception(exc)

    def _new_seq_id(self) -> int:
        self._next_seq += 1
        return self._next_seq - 1

    def _add(self, request: EngineRequest, sink: OutputSink, processors: Sequence[LogitsProcessor], constraints: Sequence[Any] | None = None) -> None:
        req = Req(request, sink, processors, constraints)
        for index in range(1 if req.beam is not None else request.params.n):
            req.seqs.append(Seq(self._new_seq_id(), req, index, self.engine))
        # n > 1: the prompt is prefilled once; the other completions fork its KV state (_fan_out)
        req.followers = req.seqs[1:]
        if self.prompt_cache is not None and request.params.prompt_logprobs is None:
            self._reuse_prefix(req.seqs[0])
        try:
            for seq in req.seqs[:1]:
                self.scheduler.add(seq)
        except LmdockError as exc:
            for seq in req.seqs:
                self._release(seq)
            safe_fail(sink, exc)
            return
        self._reqs[request.request_id] = req

    # -- ending sequences and requests: the release rule -------------------------------------------

    def _release(self, seq: Seq | QuerySeq) -> None:
        """Take the sequence out of the scheduler and free its KV state, exactly once."""
        self.scheduler.remove(seq)
        seq.num_computed = 0
        self._free(seq)

    def _free(self, seq: Seq | QuerySeq) -> None:
        if seq.held:
            seq.held = False
            try:
                self.engine.release(seq.seq_id)
            except Exception:
                log.exception("the step engine failed to release sequence %s", seq.seq_id)

    def _finish(self, req: Req, reason: str, error: BaseException | None = None) -> None:
        """End a request: every sequence released, the sink told once (a final output or the error)."""
        if req.done:
            return
        req.done = True
        if req.beam is not None and error is None:
            req.beam.done = True  # report the hypotheses finished so far
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = reason
            self._release(seq)
        self._reqs.pop(req.request.request_id, None)
        if error is not None:
            safe_fail(req.sink, error)
        else:
            safe_put(req.sink, self.output.snapshot(req))

    def _fail(self, seq: Seq | QuerySeq, error: BaseException) -> None:
        if isinstance(seq, QuerySeq):
            self.queries.fail(seq, error)
        elif seq.req is not None:
            self._finish(seq.req, "abort", error=error)

    def _die(self, error: BaseException, dead: bool = True) -> None:
        """Fail every waiter with ``error``; with ``dead``, refuse new requests with it too."""
        self._flush()
        with self._cv:
            self._closing = True
            if dead:
                self._dead = error
            inbox, self._inbox = self._inbox, deque()
        for kind, item in inbox:
            if kind == "add":
                safe_fail(item[1], error)
            elif kind == "query":
                _settle(item[1], error)
            elif kind == "clear":
                _settle(item, error)
        for req in list(self._reqs.values()):
            self._finish(req, "abort", error=error)
        self.queries.fail_all(error)

    def _release_everything(self) -> None:
        for req in list(self._reqs.values()):
            self._finish(req, "abort", error=EngineClosedError("the LLM was shut down"))
        try:
            self.queries.clear()
            self._drop_prompt_cache()
        except Exception:
            log.exception("clearing the prefix caches failed")

    # -- one step: the pipeline ---------------------------------------------------------------------

    def _step(self) -> None:
        # 1. schedule
        try:
            plan, preempted, failed = self.scheduler.schedule()
        except Exception as exc:
            self._die(BackendError(f"the scheduler failed: {type(exc).__name__}: {exc}"))
            return
        # 2. release what was preempted (recomputed later), fail what can never fit
        if failed:
            self._flush()
        if preempted:
            self._drop_prompt_cache()  # KV pressure: cached prompts go before running sequences do
        for seq in preempted:
            self._preemptions += 1
            self._free(seq)  # the scheduler keeps it, waiting, with nothing computed
            if isinstance(seq, Seq):
                seq.beam_lp = None
        for seq, reason in failed:
            self._fail(seq, RequestError(reason))
        plan = [(s, n) for s, n in plan if _live(s)]
        if not plan:
            self._flush()
            return
        # 3. one engine step
        chunks = []
        for seq, n in plan:
            chunks.append(self._chunk(seq, n))
            seq.held = True  # the engine may take KV state for it from here on, even if the step fails
        out = self._engine_step(plan, chunks)
        if out is None:
            return
        # 4. prompt logprobs and KV progress
        ready: list[int] = []
        fan: list[tuple[Seq, int]] = []  # completions that share this step's prompt logits
        for i, (seq, n) in enumerate(plan):
            if chunks[i].all_logits and _live(seq):
                self._guard(seq, "recording prompt logprobs", self.output.record_prompt_logprobs, seq, chunks[i], out.full[seq.seq_id])
            if not _live(seq):
                continue
            seq.num_computed += n
            if seq.num_computed != len(seq.token_ids):
                continue
            if seq.req is None:
                self._guard(seq, "finishing the query", self.queries.finish, seq, out.last[i])
            else:
                ready.append(i)
                if self.prompt_cache is not None and seq.index == 0 and seq.num_output == 0 and not seq.req.cached:
                    self._cache_prompt(seq)
                if seq.req.followers:
                    fan += [(f, i) for f in self._fan_out(seq)]
        # 5. beam search
        if any(plan[i][0].req.beam is not None for i in ready):
            beams = [i for i in ready if plan[i][0].req.beam is not None]
            self._beam_steps([plan[i][0] for i in beams], out.last[beams])
            ready = [i for i in ready if plan[i][0].req.beam is None]
        if not ready:
            return
        # 6. sample (a whole-batch step needs no gather)
        seqs = [plan[i][0] for i in ready]
        if fan:
            seqs += [f for f, _ in fan]
            samples = self._sample(out.last[ready + [i for _, i in fan]], seqs)
        else:
            samples = self._sample(out.last if len(ready) == len(plan) else out.last[ready], seqs)
        # 7. append, detokenize, stop (the text of requests without stop strings: deferred, see Overlap)
        touched: dict[int, Req] = {}
        append, append_token = self.output.append, self.output.append_token
        texts: list[tuple[Seq, int, bool]] | None = [] if self._worker is not None else None
        for seq, sample in zip(seqs, samples):
            req = seq.req
            if sample is None or req.done or seq.finish_reason is not None:
                continue
            try:
                if seq.constraint is not None:
                    seq.constraint.accept(sample.token)
                if texts is not None and not seq.stops.stops:
                    by_token = append_token(seq, sample)
                    if seq.detok is not None:
                        texts.append((seq, sample.token, by_token))
                else:
                    append(seq, sample)
                if seq.finish_reason is None and seq.constraint is not None and seq.constraint.is_complete():
                    seq.finish_reason = "stop"  # the grammar can take no more tokens
            except Exception as exc:
                self._fail(seq, _as_request_error(exc, "structured output" if seq.constraint is not None else "detokenizing and checking stops"))
                continue
            if seq.finish_reason is not None:
                self._release(seq)
                touched[id(req)] = req
            elif req.request.stream:
                touched[id(req)] = req
        # 8. report
        reports: list[Req] = []
        for req in touched.values():
            if req.done:  # failed by a sibling completion in 7
                continue
            if req.finished:
                req.done = True
                self._reqs.pop(req.request.request_id, None)
            elif not req.request.stream:
                continue
            if texts is not None and not req.seqs[0].stops.stops:
                reports.append(req)
            else:
                safe_put(req.sink, self.output.snapshot(req))
        if texts is not None and len(texts) + len(reports) >= MIN_DEFERRED:
            self._pending = (texts, reports)
        elif texts or reports:  # too little to pay for the hand-off: now
            self._settle(self._emit((texts or [], reports)))

    def _engine_step(self, plan: list[tuple[Any, int]], chunks: list[SeqChunk]) -> Any:
        """Run the engine, with the last step's deferred output work beside it on the helper thread;
        a failure (or a malformed result) fails this step's sequences alone."""
        job, self._pending = self._pending, None
        errors: list[tuple[Seq, LmdockError]] = []
        if job is not None:
            assert self._worker is not None  # noqa: S101 - only the overlap defers work
            self._worker.start(lambda: errors.extend(self._emit(job)))
        failure: Exception | None = None
        try:
            out = self.engine.step(chunks)
            _check_output(out, chunks, self.engine.vocab_size)
        except Exception as exc:
            failure = exc
        finally:  # whatever happened, the helper is done before the loop goes on
            if job is not None:
                self._worker.wait()  # type: ignore[union-attr]
        self._settle(errors)
        if failure is not None:
            self._step_failed(plan, failure)
            return None
        self._failures = 0
        return out

    def _step_failed(self, plan: list[tuple[Any, int]], exc: Exception) -> None:
        self._failures += 1
        error = BackendError(f"the engine step failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        log.warning("engine step failed (%d in a row): %s", self._failures, exc)
        for seq, _ in plan:
            if _live(seq):
                self._fail(seq, error)
        if self._failures >= self._max_failures:
            self._die(BackendError(f"the engine failed {self._failures} steps in a row and is declared dead; last error: {type(exc).__name__}: {exc}"))

    # -- overlap: deferred output work ------------------------------------------------------------

    def _emit(self, job: tuple[list[tuple[Seq, int, bool]], list[Req]]) -> list[tuple[Seq, LmdockError]]:
        """Detokenize, then report: the deferred half of steps 7-8 (on the helper thread, or inline
        when flushed).  Touches only these requests' text and sinks; failures go back to the loop."""
        texts, reports = job
        push = self.output.push_text
        failed: dict[int, tuple[Seq, LmdockError]] = {}
        for seq, token, by_token in texts:
            try:
                push(seq, token, by_token)
            except Exception as exc:
                failed.setdefault(id(seq.req), (seq, _as_request_error(exc, "detokenizing")))
        snapshot = self.output.snapshot
        for req in reports:
            if id(req) not in failed:
                safe_put(req.sink, snapshot(req))
        return list(failed.values())

    def _settle(self, errors: list[tuple[Seq, LmdockError]]) -> None:
        for seq, error in errors:
            req = seq.req
            if req is not None and req.done:  # finished, its final output withheld: the error instead
                safe_fail(req.sink, error)
            else:
                self._fail(seq, error)

    def _flush(self) -> None:
        """Run the pending deferred work now, in the loop thread."""
        job, self._pending = self._pending, None
        if job is not None:
            self._settle(self._emit(job))

    def _sample(self, logits: np.ndarray, seqs: list[Seq]) -> list[Sample | None]:
        """Sample the batch at once; if that raises, row by row, so a failing row (its logits
        processor, say) fails its request alone.  Rows draw from their own generators, so the rows
        that succeed get the same tokens either way."""
        # Rows with logits processors run plugin code that may raise after other rows have drawn:
        # their generators are saved first so a retry row by row draws the same numbers.
        saved = [(s.row, s.row.rng.bit_generator.state) for s in seqs if not s.row.params.greedy] if any(s.row.processors for s in seqs) else None
        if any(s.constraint is not None for s in seqs):
            try:
                logits = apply_masks(logits, [s.constraint for s in seqs], self._fill_masks)
            except Exception:  # one constraint's failure: find it row by row
                logits = self._masks_row_by_row(logits, seqs)
        try:
            return list(self.sampler.sample(logits, [s.row for s in seqs]))
        except Exception:
            for row, state in saved or ():
                row.rng.bit_generator.state = state
        out: list[Sample | None] = []
        for i, seq in enumerate(seqs):
            try:
                out.append(self.sampler.sample(logits[i : i + 1], [seq.row])[0])
            except Exception as exc:
                self._fail(seq, _as_request_error(exc, "sampling"))
                out.append(None)
        return out

    #: A batched mask filler (``ConstraintBatch.fill``), set by whoever provides the constraints.
    _fill_masks: Callable[..., None] | None = None

    def _masks_row_by_row(self, logits: np.ndarray, seqs: list[Seq]) -> np.ndarray:
        cons: list[Any] = []
        for seq in seqs:
            c = seq.constraint
            if c is not None:
                try:
                    apply_masks(logits[:1], [c])
                except Exception as exc:
                    self._fail(seq, _as_request_error(exc, "structured output"))
                    c = None
            cons.append(c)
        return apply_masks(logits, cons)

    def _guard(self, seq: Seq | QuerySeq, what: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self._fail(seq, _as_request_error(exc, what))

    def _chunk(self, seq: Seq | QuerySeq, n: int) -> SeqChunk:
        start = seq.num_computed
        req = seq.req
        want_all = (
            req is not None
            and req.prompt_logprobs is not None
            and seq.index == 0
            and len(req.prompt_logprobs) < seq.prompt_len
            and start < seq.prompt_len
        )
        ahead = seq.argmax_from is not None and start + n == len(seq.token_ids) and seq.num_output >= seq.argmax_from
        return SeqChunk(seq.seq_id, seq.token_ids[start : start + n], start, want_all, ahead)

    # -- automatic prefix caching --------------------------------------------------------------------

    def _reuse_prefix(self, seq: Seq) -> None:
        """Fork the KV state of the longest prefix the prompt shares with a cached one (at least one
        prompt token is left to compute: its logits start the output)."""
        assert self.prompt_cache is not None  # noqa: S101
        src, length = self.prompt_cache.lookup(seq.token_ids)
        length = min(length, seq.prompt_len - 1)
        if src is None or length <= 0:
            return
        if self.engine.fork(src, seq.seq_id, length):
            seq.held = True
            seq.num_computed = length
            self.prompt_cache.hit_tokens += length
        else:
            self._drop_prompt_cache(disable=True)

    def _cache_prompt(self, seq: Seq) -> None:
        assert self.prompt_cache is not None and seq.req is not None  # noqa: S101
        seq.req.cached = True
        cache_id = self._new_seq_id()
        try:
            forked = self.engine.fork(seq.seq_id, cache_id, seq.prompt_len)
        except Exception:
            log.exception("forking a prompt into the prefix cache failed; prefix caching is off")
            forked = False
        if not forked:
            self._drop_prompt_cache(disable=True)
            return
        for old in self.prompt_cache.insert(seq.token_ids[: seq.prompt_len], cache_id):
            self.engine.release(old)
        self._reserve_cache_capacity()

    def _reserve_cache_capacity(self) -> None:
        """Cached prompts hold KV state the scheduler does not see: it plans within what they leave.
        The cache gives way (is dropped) before that would leave less than half the capacity."""
        capacity = getattr(self.engine, "kv_capacity_tokens", None)
        if capacity is None or not hasattr(self.scheduler, "capacity") or self.prompt_cache is None:
            return
        cached = self.prompt_cache.tokens
        if cached > capacity // 2:
            self._drop_prompt_cache()
            cached = 0
        self.scheduler.capacity = capacity - cached

    def _drop_prompt_cache(self, disable: bool = False) -> None:
        if self.prompt_cache is None:
            return
        for seq_id in self.prompt_cache.clear():
            try:
                self.engine.release(seq_id)
            except Exception:
                log.exception("the step engine failed to release cached sequence %s", seq_id)
        if disable:
            self.prompt_cache = None
        capacity = getattr(self.engine, "kv_capacity_tokens", None)
        if capacity is not None and hasattr(self.scheduler, "capacity"):
            self.scheduler.capacity = capacity

    def _fan_out(self, first: Seq) -> list[Seq]:
        """The first completion's prompt is computed: the others of its request fork its KV state and
        sample their first token from the same logits (engines that cannot fork prefill them instead)."""
        req = first.req
        assert req is not None  # noqa: S101
        followers, req.followers = req.followers, []
        sharing: list[Seq] = []
        for f in followers:
            if self.engine.fork(first.seq_id, f.seq_id, first.num_computed):
                f.held = True
                f.num_computed = first.num_computed
                sharing.append(f)
                if hasattr(self.scheduler, "fork"):
                    self.scheduler.fork(first, f)
                else:
                    self.scheduler.add(f)
            else:
                self.scheduler.add(f)
        return sharing

    # -- beam search --------------------------------------------------------------------------------

    def _beam_steps(self, seqs: list[Seq], logits: np.ndarray) -> None:
        lps = log_softmax(logits)
        reqs: dict[int, Req] = {}
        for seq, lp in zip(seqs, lps):
            seq.beam_lp = lp
            reqs[id(seq.req)] = seq.req
        for req in reqs.values():
            live = [s for s in req.seqs if s.finish_reason is None]
            if req.done or not all(s.beam_lp is not None for s in live):
                continue
            try:
                self._beam_step(req, live)
            except Exception as exc:
                self._finish(req, "abort", error=_as_request_error(exc, "beam search"))

    def _beam_step(self, req: Req, live: list[Seq]) -> None:
        """Advance one beam request once every live beam has its logits."""
        assert req.beam is not None  # noqa: S101 - only called for beam requests
        children = beam_choices(req.beam, req.request.params, live, self.engine.eos_token_ids, self.max_seq_len)
        for seq, mine in zip(live, children):
            seq.beam_lp = None
            for c in mine[1:]:  # extra children copy the parent's KV state before it moves on
                child = seq.fork(self._new_seq_id())
                forked = seq.held and self.engine.fork(seq.seq_id, child.seq_id, seq.num_computed)
                child.held = bool(forked)
                child.num_computed = seq.num_computed if forked else 0
                child.token_ids.append(c.token)
                child.cumulative_logprob = c.logprob
                req.seqs.append(child)
                if hasattr(self.scheduler, "fork"):  # optional: keeps the new beam beside its parent
                    self.scheduler.fork(seq, child)
                else:
                    self.scheduler.add(child)
            if mine:
                seq.token_ids.append(mine[0].token)
                seq.cumulative_logprob = mine[0].logprob
            else:
                seq.finish_reason = "pruned"
                self._release(seq)
        req.seqs = [s for s in req.seqs if s.finish_reason != "pruned"]
        if req.beam.done:
            self._finish(req, "length")


def _live(seq: Seq | QuerySeq) -> bool:
    """Still to be computed: not finished, and (for a request's sequence) its request not ended."""
    if isinstance(seq, QuerySeq):
        return not seq.done
    return seq.finish_reason is None and seq.req is not None and not seq.req.done


def _check_output(out: Any, chunks: list[SeqChunk], vocab: int) -> None:
    last = getattr(out, "last", None)
    shape = getattr(last, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != len(chunks) or shape[1] < vocab:
        raise BackendError(f"the backend returned logits of shape {shape} for {len(chunks)} chunks and a vocabulary of {vocab}")
    for c in chunks:
        if c.all_logits and c.seq_id not in out.full:
            raise BackendError(f"the backend returned no full logits for sequence {c.seq_id}, which asked for them")


def _as_request_error(exc: BaseException, what: str) -> LmdockError:
    if isinstance(exc, LmdockError):
        return exc
    error = RequestError(f"{what} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _settle(fut: concurrent.futures.Future, error: BaseException) -> None:
    try:
        fut.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
