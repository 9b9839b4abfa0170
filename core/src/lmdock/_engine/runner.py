"""The generation loop that turns a step engine into a request engine.

One background thread owns the step engine.  Callers submit requests from any thread; each loop
iteration: (1) takes new requests and aborts from the inbox, (2) asks the scheduler for a plan,
(3) runs one engine step over it, (4) samples for every sequence whose tokens are all computed,
(5) appends tokens, detokenizes, checks stop conditions, releases finished sequences at once, and
(6) reports to the sinks: every step for streaming requests, at the end for the others.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lmdock._contract import EngineRequest, OutputSink, SeqChunk, StepEngine
from lmdock._engine.beam import BeamSearch
from lmdock._engine.detok import IncrementalDetokenizer, StopStrings
from lmdock._engine.prefix_cache import PrefixCache
from lmdock._engine.sampler import LogitsProcessor, Sample, Sampler, SampleRow, log_softmax
from lmdock._engine.scheduler import Scheduler
from lmdock._errors import EngineClosedError, LmdockError, RequestError
from lmdock._outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput

log = logging.getLogger("lmdock.engine")


def _deliver(sink: OutputSink, item: RequestOutput | BaseException) -> None:
    """Report to a sink; a sink that raises must not take the engine down with it."""
    try:
        if isinstance(item, BaseException):
            sink.fail(item)
        else:
            sink.put(item)
    except Exception:
        log.exception("an output sink raised; the request's caller will not see this result")


class _Seq:
    """One completion of a request: its tokens, KV progress, sampling state and text."""

    def __init__(self, seq_id: int, req: _Req, index: int, engine: StepEngine, processors: Sequence[LogitsProcessor]) -> None:
        params = req.request.params
        self.seq_id = seq_id
        self.req = req
        self.index = index
        self.token_ids = list(req.request.prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        self.num_computed = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        seed = np.random.default_rng() if params.seed is None else np.random.default_rng([params.seed, index])
        self.row = SampleRow(params, self.token_ids, self.prompt_len, seed, engine.eos_token_ids, processors)
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.detok = (
            IncrementalDetokenizer(engine.tokenizer, self.token_ids, params.skip_special_tokens)
            if params.detokenize
            else None
        )
        self.stops = StopStrings(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.beam_lp: np.ndarray | None = None  # beam search: this step's log-softmax, awaiting the others
        if params.beam_width > 1:
            self.cumulative_logprob = 0.0

    def fork(self, seq_id: int) -> _Seq:
        """A copy for another beam; KV state is the caller's business."""
        child = copy.copy(self)
        child.seq_id = seq_id
        child.token_ids = list(self.token_ids)
        child.beam_lp = None
        return child

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def visible_text(self) -> str:
        if self.finish_reason is not None or not self.stops.stops:
            return self.text
        return self.text[: max(0, len(self.text) - self.stops.holdback)]


class _Req:
    def __init__(self, request: EngineRequest, sink: OutputSink) -> None:
        self.request = request
        self.sink = sink
        self.seqs: list[_Seq] = []
        p = request.params
        self.beam = BeamSearch(p.beam_width, p.length_penalty, p.early_stopping) if p.beam_width > 1 else None
        want = request.params.prompt_logprobs
        self.prompt_logprobs: list[PositionLogprobs | None] | None = [None] if want is not None else None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class _QuerySeq:
    """A next-token-logprobs query: prefilled, never sampled; its KV state goes to the prefix cache."""

    req = None
    index = 0

    def __init__(self, seq_id: int, token_ids: list[int]) -> None:
        self.seq_id = seq_id
        self.token_ids = token_ids
        self.num_computed = 0
        self.futures: list[concurrent.futures.Future[np.ndarray]] = []


class StepRunner:
    """A :class:`lmdock.backend.RequestEngine` over a :class:`lmdock.backend.StepEngine`."""

    def __init__(
        self,
        engine: StepEngine,
        scheduler: Scheduler,
        sampler: Sampler,
        processors_for: Callable[[Any], Sequence[LogitsProcessor]] = lambda params: (),
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_seq_len = engine.max_seq_len
        self.generation_config = engine.generation_config
        self.scheduler = scheduler
        self.sampler = sampler
        self._processors_for = processors_for
        self._inbox: deque[tuple[str, Any]] = deque()
        self._cv = threading.Condition()
        self._reqs: dict[str, _Req] = {}
        self._queries: dict[tuple[int, ...], _QuerySeq] = {}
        self.prefix_cache = PrefixCache()
        self._next_seq = 0
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="lmdock-engine", daemon=True)
        self._thread.start()

    # -- the RequestEngine interface (any thread) ------------------------------------------------

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        self._validate(request)
        with self._cv:
            if self._closing:
                raise EngineClosedError("this LLM was shut down; create a new one")
            self._inbox.append(("add", (request, sink)))
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
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

    def _post(self, kind: str, item: Any) -> None:
        with self._cv:
            if self._closing:
                raise EngineClosedError("this LLM was shut down; create a new one")
            self._inbox.append((kind, item))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closing = True
            self._cv.notify()
        self._thread.join()
        self._closed = True
        self.engine.close()

    def stats(self) -> dict[str, int]:
        """Live counts: requests, and sequences waiting and running (for tests and monitoring)."""
        sched = self.scheduler
        return {
            "requests": len(self._reqs),
            "waiting": len(getattr(sched, "waiting", ())),
            "running": len(getattr(sched, "running", ())),
        }

    def _validate(self, request: EngineRequest) -> None:
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
        if p.beam_width > 1 and (p.stop or p.logprobs is not None):
            raise RequestError("beam search returns whole hypotheses: stop strings and logprobs are not available with it")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and k > vocab:
                raise RequestError(f"{name}={k} is larger than the vocabulary ({vocab})")

    def _check_ids(self, ids: Sequence[int]) -> None:
        vocab = self.engine.vocab_size
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise RequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) > self.max_seq_len:
            raise RequestError(f"{len(ids)} tokens exceed the model's context ({self.max_seq_len})")

    # -- the loop (engine thread) -----------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as exc:  # a bug in the loop: fail every request loudly, never hang
            error = EngineClosedError(f"the engine loop stopped: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            with self._cv:
                self._closing = True
                inbox, self._inbox = self._inbox, deque()
            for kind, item in inbox:
                if kind == "add":
                    _deliver(item[1], error)
                elif kind in ("query", "clear"):
                    (item[1] if kind == "query" else item).set_exception(error)
            for req in list(self._reqs.values()):
                _deliver(req.sink, error)
            self._reqs.clear()
            for query in self._queries.values():
                for fut in query.futures:
                    fut.set_exception(error)
            self._queries.clear()
            raise
        finally:
            # optional: per-thread resources the engine made in this thread (MLX streams)
            thread_exit = getattr(self.engine, "thread_exit", None)
            if thread_exit is not None:
                thread_exit()

    def _iterate(self) -> bool:
        with self._cv:
            while not self._inbox and not self.scheduler.has_work() and not self._closing:
                self._cv.wait()
            inbox, self._inbox = self._inbox, deque()
            closing = self._closing
        for kind, item in inbox:
            if kind == "add":
                self._add(*item)
            elif kind == "abort":
                self._abort(item)
            elif kind == "query":
                self._add_query(*item)
            else:  # "clear"
                for seq_id in self.prefix_cache.clear():
                    self.engine.release(seq_id)
                item.set_result(None)
        if closing:
            for req in list(self._reqs.values()):
                self._finish_request(req, "abort", error=EngineClosedError("the LLM was shut down"))
            for query in self._queries.values():
                for fut in query.futures:
                    fut.set_exception(EngineClosedError("the LLM was shut down"))
            return False
        if self.scheduler.has_work():
            self._step()
        return True

    def _add(self, request: EngineRequest, sink: OutputSink) -> None:
        req = _Req(request, sink)
        processors = self._processors_for(request.params)
        for index in range(1 if req.beam is not None else request.params.n):
            req.seqs.append(_Seq(self._next_seq, req, index, self.engine, processors))
            self._next_seq += 1
        try:
            for seq in req.seqs:
                self.scheduler.add(seq)
        except LmdockError as exc:
            for seq in req.seqs:
                self.scheduler.remove(seq)
            _deliver(sink, exc)
            return
        self._reqs[request.request_id] = req

    def _add_query(self, ids: list[int], future: concurrent.futures.Future[np.ndarray]) -> None:
        key = tuple(ids)
        if key in self._queries:  # the same prefix is already being computed
            self._queries[key].futures.append(future)
            return
        result, src, length = self.prefix_cache.lookup(ids)
        if result is not None:
            future.set_result(result.copy())
            return
        query = _QuerySeq(self._next_seq, ids)
        self._next_seq += 1
        query.futures.append(future)
        if src is not None and length < len(ids) and self.engine.fork(src, query.seq_id, length):
            query.num_computed = length
        try:
            self.scheduler.add(query)
        except LmdockError as exc:
            if query.num_computed:
                self.engine.release(query.seq_id)
            future.set_exception(exc)
            return
        self._queries[key] = query

    def _finish_query(self, query: _QuerySeq, logits: np.ndarray) -> None:
        self.scheduler.remove(query)
        result = log_softmax(logits[None, :])[0]
        del self._queries[tuple(query.token_ids)]
        for seq_id in self.prefix_cache.insert(query.token_ids, result, query.seq_id):
            self.engine.release(seq_id)
        for fut in query.futures:
            fut.set_result(result.copy())

    def _abort(self, request_id: str) -> None:
        req = self._reqs.get(request_id)
        if req is not None:
            self._finish_request(req, "abort")

    def _finish_request(self, req: _Req, reason: str, error: BaseException | None = None) -> None:
        if req.beam is not None:
            req.beam.done = True  # report the hypotheses finished so far
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = reason
            self._release(seq)
        self._reqs.pop(req.request.request_id, None)
        if error is not None:
            _deliver(req.sink, error)
        else:
            _deliver(req.sink, self._snapshot(req))

    def _release(self, seq: _Seq) -> None:
        self.scheduler.remove(seq)
        if seq.num_computed:
            self.engine.release(seq.seq_id)
            seq.num_computed = 0

    def _step(self) -> None:
        plan, preempted, failed = self.scheduler.schedule()
        for seq in preempted:
            self.engine.release(seq.seq_id)  # scheduler already reset num_computed
        for seq, reason in failed:
            if isinstance(seq, _QuerySeq):
                self._fail_query(seq, RequestError(reason))
            else:
                self._finish_request(seq.req, "abort", error=RequestError(reason))
        if not plan:
            return
        chunks = [self._chunk(seq, n) for seq, n in plan]
        try:
            out = self.engine.step(chunks)
        except Exception as exc:  # the engine failed this batch: fail its requests, keep serving
            error = LmdockError(f"engine step failed: {type(exc).__name__}: {exc}")
            for seq, _ in plan:
                if isinstance(seq, _QuerySeq):
                    self._fail_query(seq, error)
            for req in {id(s.req): s.req for s, _ in plan if s.req is not None}.values():
                self._finish_request(req, "abort", error=error)
            return
        ready: list[int] = []
        for i, (seq, n) in enumerate(plan):
            if chunks[i].all_logits:
                self._record_prompt_logprobs(seq, chunks[i], out.full[seq.seq_id])
            seq.num_computed += n
            if seq.num_computed != len(seq.token_ids):
                continue
            if isinstance(seq, _QuerySeq):
                self._finish_query(seq, out.last[i])
            else:
                ready.append(i)
        beams = [i for i in ready if plan[i][0].req.beam is not None]
        if beams:
            self._beam_steps(plan, beams, out.last)
            ready = [i for i in ready if plan[i][0].req.beam is None]
        if not ready:
            return
        seqs = [plan[i][0] for i in ready]
        samples = self.sampler.sample(out.last[ready], [s.row for s in seqs])
        touched: dict[int, _Req] = {}
        for seq, sample in zip(seqs, samples):
            self._append(seq, sample)
            touched[id(seq.req)] = seq.req
        for req in touched.values():
            if req.finished:
                self._reqs.pop(req.request.request_id, None)
                _deliver(req.sink, self._snapshot(req))
            elif req.request.stream:
                _deliver(req.sink, self._snapshot(req))

    def _beam_steps(self, plan: list[tuple[Any, int]], rows: list[int], logits: np.ndarray) -> None:
        lps = log_softmax(logits[rows])
        reqs: dict[int, _Req] = {}
        for i, lp in zip(rows, lps):
            seq = plan[i][0]
            seq.beam_lp = lp
            reqs[id(seq.req)] = seq.req
        for req in reqs.values():
            live = [s for s in req.seqs if s.finish_reason is None]
            if all(s.beam_lp is not None for s in live):
                self._beam_step(req, live)

    def _beam_step(self, req: _Req, live: list[_Seq]) -> None:
        """Advance one beam request once every live beam has its logits."""
        beam = req.beam
        assert beam is not None  # noqa: S101 - only called for beam requests
        params = req.request.params
        lps = np.stack([s.beam_lp for s in live])
        ends = np.zeros(lps.shape[1], dtype=bool)
        ends[list(params.stop_token_ids)] = True
        if not params.ignore_eos:
            ends[list(self.engine.eos_token_ids)] = True
        n_out = live[0].num_output
        if n_out < params.min_new_tokens:
            lps[:, ends] = -np.inf
        limit = params.max_new_tokens
        at_limit = (limit is not None and n_out + 1 >= limit) or len(live[0].token_ids) + 1 >= self.max_seq_len
        outputs = [s.token_ids[s.prompt_len :] for s in live]
        running = np.array([s.cumulative_logprob or 0.0 for s in live])
        choices = beam.step(outputs, running, lps, ends, at_limit)
        children: dict[int, list[Any]] = {}
        for c in choices:
            children.setdefault(c.beam, []).append(c)
        for b, seq in enumerate(live):
            seq.beam_lp = None
            mine = children.get(b, [])
            for c in mine[1:]:  # extra children copy the parent's KV state before it moves on
                child = seq.fork(self._next_seq)
                self._next_seq += 1
                child.num_computed = seq.num_computed if self.engine.fork(seq.seq_id, child.seq_id, seq.num_computed) else 0
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
        if beam.done:
            for seq in req.seqs:
                seq.finish_reason = seq.finish_reason or "length"
                self._release(seq)
            self._reqs.pop(req.request.request_id, None)
            _deliver(req.sink, self._snapshot(req))

    def _fail_query(self, query: _QuerySeq, error: BaseException) -> None:
        self.scheduler.remove(query)
        self._queries.pop(tuple(query.token_ids), None)
        if query.num_computed:
            self.engine.release(query.seq_id)
        for fut in query.futures:
            fut.set_exception(error)

    def _chunk(self, seq: _Seq, n: int) -> SeqChunk:
        start = seq.num_computed
        want_all = (
            seq.req is not None
            and seq.req.prompt_logprobs is not None
            and seq.index == 0
            and len(seq.req.prompt_logprobs) < seq.prompt_len
        )
        return SeqChunk(seq.seq_id, seq.token_ids[start : start + n], start, want_all)

    def _record_prompt_logprobs(self, seq: _Seq, chunk: SeqChunk, full: np.ndarray) -> None:
        plp = seq.req.prompt_logprobs
        assert plp is not None  # noqa: S101 - guarded by the caller
        k = seq.req.request.params.prompt_logprobs or 0
        rows = [i for i in range(len(chunk.token_ids)) if chunk.start + i + 1 < seq.prompt_len]
        if not rows:
            return
        lps = log_softmax(full[rows])
        for r, lp in zip(rows, lps):
            target = seq.token_ids[chunk.start + r + 1]
            plp.append(self._position_logprobs(target, lp, k))

    def _position_logprobs(self, token: int, lp: np.ndarray, k: int) -> PositionLogprobs:
        decode = self.tokenizer.decode
        entry = {token: Logprob(float(lp[token]), int((lp > lp[token]).sum()) + 1, decode([token]))}
        if k:
            top = np.argsort(-lp, kind="stable")[:k]
            for rank, t in enumerate(top, start=1):
                entry.setdefault(int(t), Logprob(float(lp[t]), rank, decode([int(t)])))
        return entry

    def _append(self, seq: _Seq, sample: Sample) -> None:
        tok = sample.token
        params = seq.row.params
        seq.token_ids.append(tok)
        if seq.logprobs is not None and sample.logprob is not None:
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sample.logprob
            seq.logprobs.append(self._sample_logprobs(sample))
        past_min = seq.num_output >= params.min_new_tokens
        if past_min and not params.ignore_eos and tok in self.engine.eos_token_ids:
            seq.finish_reason = "stop"
        elif past_min and tok in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        by_token = seq.finish_reason is not None
        if seq.detok is not None and (not by_token or params.include_stop_str_in_output):
            delta = seq.detok.push(tok)
            seq.text = seq.detok.text
            hit = seq.stops.find(seq.text, len(delta)) if past_min and not by_token else None
            if hit is not None:
                seq.text, stop = hit
                seq.finish_reason, seq.stop_reason = "stop", stop
        if seq.finish_reason is None:
            limit = params.max_new_tokens
            if (limit is not None and seq.num_output >= limit) or len(seq.token_ids) >= self.max_seq_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self._release(seq)

    def _sample_logprobs(self, sample: Sample) -> PositionLogprobs:
        decode = self.tokenizer.decode
        entry = {sample.token: Logprob(sample.logprob or 0.0, sample.rank, decode([sample.token]))}
        for rank, (t, lp) in enumerate(sample.top, start=1):
            entry.setdefault(t, Logprob(lp, rank, decode([t])))
        return entry

    def _beam_outputs(self, req: _Req) -> list[CompletionOutput]:
        assert req.beam is not None  # noqa: S101
        p = req.request.params
        eos = set(self.engine.eos_token_ids) | set(p.stop_token_ids)
        outs = []
        for index, hyp in enumerate(req.beam.hyps[: p.n]):
            text = self.tokenizer.decode(hyp.token_ids, skip_special_tokens=p.skip_special_tokens) if p.detokenize else ""
            ended = bool(hyp.token_ids) and hyp.token_ids[-1] in eos
            outs.append(CompletionOutput(index, text, hyp.token_ids, hyp.logprob, None, "stop" if ended else "length"))
        return outs

    def _snapshot(self, req: _Req) -> RequestOutput:
        if req.beam is not None:
            return RequestOutput(
                request_id=req.request.request_id,
                prompt=req.request.prompt,
                prompt_token_ids=list(req.request.prompt_token_ids),
                outputs=self._beam_outputs(req) if req.beam.done else [],
                finished=req.beam.done,
                prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            )
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.visible_text(),
                token_ids=s.token_ids[s.prompt_len :],
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in req.seqs
        ]
        return RequestOutput(
            request_id=req.request.request_id,
            prompt=req.request.prompt,
            prompt_token_ids=list(req.request.prompt_token_ids),
            outputs=outs,
            finished=req.finished,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        )
