"""The generation loop that turns a step engine into a request engine.

One background thread owns the step engine.  Callers submit requests from any thread (typed messages
into ``lmdock._engine.inbox``); each step of the loop is a numbered pipeline (``StepRunner._step``),
a call per step:

1. schedule: the scheduler's plan; release what it preempted, fail what cannot ever fit, and keep
   only live sequences in the plan;
2. run: one engine step over the plan (a failed step fails that step's sequences, nothing else);
3. progress: prompt logprobs and KV progress; finished next-token queries go to the prefix cache,
   computed prompts to the prompt cache, and ``n > 1`` completions fork the first one's prompt;
4. beam search, for beam requests whose beams all have logits (``lmdock._engine.beam_step``);
5. sample (batch-wide; a row whose logits processor fails fails its request alone:
   ``lmdock._engine.sampling``);
6. process outputs: append, detokenize and check stops (``OutputProcessor.process``); free finished
   sequences at once;
7. report: every step for streaming requests, at the end for the others (``Requests.report``).

Overlap (``async_output``, ``lmdock._engine.overlap``): 6-7's text and reports run during the next
``engine.step``; what that step depends on is decided in 6, and pending work is flushed before anything
else touches those requests (aborts, failures, an idle loop, shutdown).

Containment: whatever goes wrong while serving one request fails that request alone, with an error that
names the cause, and releases its state.  Helpers return failures (``lmdock._engine.failures``); the
loop acts on them through ``Requests``.  Only an engine whose steps keep failing
(``max_consecutive_failures`` in a row) is declared dead: every waiter gets the error at once and new
requests are refused with it.  The release rule is in ``lmdock._engine.kv``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from lmdock._engine.adapters import as_scheduler, as_step_engine
from lmdock._engine.beam_step import BeamStepper
from lmdock._engine.biases import bad_words_ids
from lmdock._engine.failures import as_request_error, guard
from lmdock._engine.forward import chunk_for, run_step
from lmdock._engine.inbox import Abort, Add, ClearCache, Inbox, Message, Query
from lmdock._engine.kv import KV
from lmdock._engine.output import OutputProcessor
from lmdock._engine.overlap import DeferredOutput
from lmdock._engine.prompt_caching import PromptCaching
from lmdock._engine.queries import Queries
from lmdock._engine.request_engine import RequestEngineBase
from lmdock._engine.requests import Requests, adapter_names
from lmdock._engine.sampler import LogitsProcessor, Sample, Sampler, host_array
from lmdock._engine.sampling import sample_contained
from lmdock._engine.scheduler import SchedulerBase
from lmdock._engine.sequence import QuerySeq, Req, Seq, live
from lmdock._engine.speculative import Speculation
from lmdock._engine.step_engine import StepEngineBase
from lmdock._engine.validate import check_ids, check_request, compile_constraints, load_lora, prepare_lora
from lmdock._plugin.contract import EngineRequest, OutputSink, SeqChunk
from lmdock._plugin.errors import BackendError, EngineClosedError, RequestError

log = logging.getLogger("lmdock.engine")

#: Consecutive failed engine steps after which the engine is declared dead.
MAX_CONSECUTIVE_FAILURES = 3

#: One step's plan: (sequence, tokens to feed) pairs.
Plan = list[tuple[Any, int]]


class StepRunner(RequestEngineBase):
    """A request engine over a :class:`lmdock.backend.StepEngine` (one written without
    :class:`lmdock.backend.StepEngineBase`, or a scheduler without ``SchedulerBase``, is seen through
    the base: ``lmdock._engine.adapters``).

    ``processors_for(params)`` returns the request's logits processors, each already named after the
    plugin that contributed it (see ``lmdock._plugin.loader``); it is called in the submitting thread, so a
    failing hook fails that request at ``submit``.  ``fill_masks``: a batched mask filler
    (``ConstraintBatch.fill``) from whoever provides the constraints.
    """

    def __init__(
        self,
        engine: StepEngineBase | Any,
        scheduler: SchedulerBase | Any,
        sampler: Sampler,
        processors_for: Callable[[Any], Sequence[LogitsProcessor]] = lambda params: (),
        *,
        max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES,
        constraints_for: Callable[[Any, int], Sequence[Any] | None] | None = None,
        prefix_caching: bool = False,
        async_output: bool | None = None,
        fill_masks: Callable[..., None] | None = None,
        speculative: tuple[Any, Any] | None = None,
    ) -> None:
        self.engine = engine = as_step_engine(engine)
        self.scheduler = scheduler = as_scheduler(scheduler)
        self.tokenizer = engine.tokenizer
        self.max_seq_len = engine.max_seq_len
        self.generation_config = engine.generation_config
        self.sampler = sampler
        self.output = OutputProcessor(engine.tokenizer, engine.eos_token_ids, engine.max_seq_len)
        self.kv = KV(engine, scheduler)
        self.queries = Queries(self.kv, scheduler, self._new_seq_id)
        self.requests = Requests(engine, scheduler, self.kv, self.output, self.queries)
        #: automatic prefix caching of generate prompts (``kv_cache.enable_prefix_caching``)
        self.prompts = PromptCaching(self.kv, scheduler, self._new_seq_id, prefix_caching,
                                     whole=not engine.fork_truncates)
        self.beams = BeamStepper(self.kv, scheduler, self._new_seq_id, engine.eos_token_ids, engine.max_seq_len)
        self._processors_for = processors_for
        #: ``constraints_for(params, n)``: one structured-output constraint per completion, or None
        #: (``lmdock._engine.constraints``); None here: requests with structured_output are refused
        self._constraints_for = constraints_for
        if fill_masks is not None:
            self._fill_masks = fill_masks
        #: speculative decoding: ``speculative = (SpeculativeConfig, proposer)``, or off
        config, proposer = speculative or (None, None)
        budget = scheduler.config.max_num_batched_tokens if scheduler.config is not None else 0
        self.spec = Speculation(engine, config, proposer, budget, self.kv)
        self._max_failures = max_consecutive_failures
        self._failures = 0
        self._preemptions = 0
        self._inbox = Inbox()
        self._next_seq = 0
        self._closed = False
        #: overlap: a helper thread for deferred output work (``async_output``; by default where the
        #: engine's step leaves the GIL and a core free)
        if async_output is None:
            async_output = bool(engine.overlap_host_work)
        self.deferred = DeferredOutput(self.output, async_output)
        self._thread = threading.Thread(target=self._loop, name="lmdock-engine", daemon=True)
        self._thread.start()

    #: A batched mask filler (``ConstraintBatch.fill``); ``fill_masks`` sets it.
    _fill_masks: Callable[..., None] | None = None

    # -- the RequestEngine interface (any thread) ------------------------------------------------

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        processors = check_request(request, self.engine.vocab_size, self.max_seq_len, self._processors_for)
        bad_words = bad_words_ids(request.params.bad_words, self.tokenizer, self.engine.vocab_size)
        constraints = compile_constraints(request, self._constraints_for)
        prepare_lora(self.engine, request)
        self._inbox.post(Add(request, sink, processors, constraints, bad_words))

    def prepare_lora(self, lora: Any) -> None:
        """Load (or check) an adapter ahead of :meth:`submit`, in the caller's (worker) thread, so its
        first use never blocks a server's loop; raises RequestError as ``submit`` would."""
        load_lora(self.engine, lora)

    def process_multimodal(self, text: str, data: Any, add_special_tokens: bool) -> list[int]:
        """A prompt with images as the step engine's processor tokenizes it, off the engine loop."""
        return list(self.engine.process_multimodal(text, data, add_special_tokens))

    def abort(self, request_id: str) -> None:
        self._inbox.post_abort(Abort(request_id))  # dropped while shutting down: that fails it anyway

    def next_token_logprobs(self, token_ids: Sequence[int]) -> concurrent.futures.Future[np.ndarray]:
        """A future of the log-probabilities (float32, [vocab]) of the token after ``token_ids``; queries
        that arrive together run in one batch, and results and KV state go to the prefix cache."""
        ids = list(token_ids)
        if not ids:
            raise RequestError("next_token_logprobs needs at least one token id")
        check_ids(ids, self.engine.vocab_size, self.max_seq_len)
        future: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        self._inbox.post(Query(ids, future))
        return future

    def clear_cache(self) -> None:  # the prefix caches, and the KV state they hold
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._inbox.post(ClearCache(done))
        done.result()

    def close(self) -> None:
        """Stop the loop: requests in flight fail with ``EngineClosedError``; every sequence is
        released; then the engine is closed.  Idempotent."""
        if self._closed:
            return
        self._inbox.shut_down()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._closed = True
        try:
            self.engine.close()
        except Exception:
            log.exception("closing the step engine failed")

    def stats(self) -> dict[str, Any]:
        """Live counts for monitoring (the server's /metrics) and tests; safe from any thread."""
        running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        capacity = self.engine.kv_capacity_tokens
        active = {id(s.req) for s in running if s.req is not None}
        cached = len(self.queries.cache) + self.prompts.held  # the prefix caches hold theirs on purpose
        return {
            "num_requests_running": len(active),
            "num_requests_waiting": len({id(s.req) for s in waiting if s.req is not None} - active),
            "num_sequences_running": len(running),
            "num_sequences_waiting": len(waiting),
            "kv_cache_usage_perc": (sum(s.num_computed for s in running) / capacity) if capacity else 0.0,
            "num_preemptions_total": self._preemptions,
            "num_requests_aborted_total": self.requests.aborted,
            "num_sequences_held": self.engine.num_sequences() - cached,
            "num_sequences_cached": cached,
            "prefix_cache_hit_tokens": self.prompts.hit_tokens,
            "prefix_caching": self.prompts.mode,
            "dead": self._inbox.dead is not None,
            # LoRA (vLLM's lora_requests_info): the adapters of running and waiting requests, by name
            "running_lora_adapters": adapter_names(running),
            "waiting_lora_adapters": adapter_names(waiting),
            "max_lora": int(self.engine.max_loras or 0),
            **self.spec.stats(),
        }

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
            self.spec.close()
            self.deferred.close()
            try:  # per-thread resources the engine made in this thread (MLX streams)
                self.engine.thread_exit()
            except Exception:
                log.exception("the step engine's thread_exit failed")

    def _iterate(self) -> bool:
        messages, closing = self._inbox.wait(self.scheduler.has_work)
        if closing or (messages and any(isinstance(m, Abort) for m in messages)):
            self._flush()  # before an abort or a shutdown touches a request; new requests do not
        for message in messages:
            self._take(message)
        if closing:
            self._die(EngineClosedError("the LLM was shut down"), dead=False)
            return False
        if self.scheduler.has_work():
            self._step()
        self.spec.sweep()  # a draft model's state of sequences that ended goes at once
        if self.deferred.pending is not None and not self.scheduler.has_work():
            self._flush()  # no next step to overlap with
        return self._inbox.dead is None

    def _take(self, message: Message) -> None:
        if isinstance(message, Add):
            self._add(message)
        elif isinstance(message, Abort):
            self.requests.abort(message.request_id)
        elif isinstance(message, Query):
            try:
                self.queries.add(message.token_ids, message.future)
            except Exception as exc:
                message.future.set_exception(as_request_error(exc, "adding the query"))
        else:
            self._clear(message)

    def _add(self, message: Add) -> None:
        try:
            req = self.requests.create(message, self._new_seq_id)
            if message.request.params.prompt_logprobs is None:
                self.prompts.reuse(req.seqs[0])
            self.requests.admit(req)
        except Exception as exc:
            message.refuse(as_request_error(exc, "adding the request"))

    def _clear(self, message: ClearCache) -> None:
        try:
            self.queries.clear()
            self.prompts.drop()
            message.done.set_result(None)
        except Exception as exc:
            message.done.set_exception(exc)

    def _new_seq_id(self) -> int:
        self._next_seq += 1
        return self._next_seq - 1

    def _flush(self) -> None:
        """Run the pending deferred output work now, in the loop thread."""
        self.requests.settle(self.deferred.flush())

    def _die(self, error: BaseException, dead: bool = True) -> None:
        """Fail every waiter with ``error``; with ``dead``, refuse new requests with it too."""
        self._flush()
        for message in self._inbox.close(error, dead):
            message.refuse(error)
        self.requests.end_all(error)
        self.queries.fail_all(error)

    def _release_everything(self) -> None:
        for req in list(self.requests.by_id.values()):
            self.requests.finish(req, "abort", error=EngineClosedError("the LLM was shut down"))
        try:
            self.queries.clear()
            self.prompts.drop()
        except Exception:
            log.exception("clearing the prefix caches failed")

    # -- one step: the pipeline ---------------------------------------------------------------------

    def _step(self) -> None:
        plan = self._schedule()  # 1
        if not plan:
            return
        chunks, out = self._run(plan)  # 2
        if out is None:
            return
        ready, beams, fan = self._progress(plan, chunks, out)  # 3
        if beams:
            self._beam_search(plan, beams, out)  # 4
        verify = self.spec.split(ready)  # speculative verify rows are sampled position by position
        if not ready and not verify:
            return
        texts: list[tuple[Seq, int, bool]] | None = [] if self.deferred.enabled else None
        touched: Collection[Req] = ()
        failures: list[Any] = []
        if ready:
            seqs, samples = self._sample(plan, ready, fan, out)  # 5
            touched, failures = self.output.process(seqs, samples, self.kv, texts)  # 6
        if verify:
            touched, failures = self._verify(plan, verify, out, texts, touched, failures)  # 5-6
        if failures:
            self.requests.fail_each(failures)
        if touched or texts:
            self._report(touched, texts)  # 7

    def _schedule(self) -> Plan:
        """1. The scheduler's plan, less what cannot go on; preempted sequences free their KV state
        (they wait to be recomputed), sequences that can never fit fail."""
        try:
            plan, preempted, failed = self.scheduler.schedule()
        except Exception as exc:
            self._die(BackendError(f"the scheduler failed: {type(exc).__name__}: {exc}"))
            return []
        if failed:
            self._flush()
        if preempted:
            self.prompts.drop()  # KV pressure: cached prompts go before running sequences do
        for seq in preempted:
            self._preemptions += 1
            self.kv.free(seq)  # the scheduler keeps it, waiting, with nothing computed
            if isinstance(seq, Seq):
                seq.beam_lp = None
        for seq, reason in failed:
            self.requests.fail(seq, RequestError(reason))
        plan = [(s, n) for s, n in plan if live(s)]
        if not plan:
            self._flush()
        return plan

    def _run(self, plan: Plan) -> tuple[list[SeqChunk], Any]:
        """2. One engine step, with the last step's deferred output work beside it on the helper
        thread; a failure (or a malformed result) fails this step's sequences alone."""
        chunks = [chunk_for(seq, n) for seq, n in plan]
        self.spec.propose(plan, chunks, self.spec.room(plan, self.scheduler))  # decoding rows may become verify rows
        self.kv.hold(plan)  # the engine may take KV state for them from here on, even if the step fails
        out, failure, errors = self.deferred.beside(run_step, self.engine, chunks)
        if errors:
            self.requests.settle(errors)
        if failure is not None:
            self._step_failed(plan, failure)
            return chunks, None
        self._failures = 0
        return chunks, out

    def _step_failed(self, plan: Plan, exc: Exception) -> None:
        self._failures += 1
        error = BackendError(f"the engine step failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        log.warning("engine step failed (%d in a row): %s", self._failures, exc)
        for seq, _ in plan:
            if live(seq):
                self.requests.fail(seq, error)
        if self._failures >= self._max_failures:
            self._die(BackendError(f"the engine failed {self._failures} steps in a row and is declared dead; last error: {type(exc).__name__}: {exc}"))

    def _progress(self, plan: Plan, chunks: list[SeqChunk], out: Any) -> tuple[list[int], list[int], list[tuple[Seq, int]]]:
        """3. Prompt logprobs and KV progress.  Returns the rows whose next token is due (to sample,
        and those of beam requests), and the completions that share a row's prompt logits (``n > 1``:
        forked this step)."""
        ready: list[int] = []
        beams: list[int] = []
        fan: list[tuple[Seq, int]] = []
        caching = self.prompts.cache is not None  # checked once a step: most steps cache nothing
        for i, (seq, n) in enumerate(plan):
            if chunks[i].all_logits and i not in self.spec.drafts and live(seq):
                self._guard(seq, "recording prompt logprobs", self.output.record_prompt_logprobs, seq, chunks[i], out.full[seq.seq_id])
            if not live(seq):
                continue
            seq.num_computed += n
            if seq.num_computed != len(seq.token_ids):
                continue
            if seq.req is None:
                self._guard(seq, "finishing the query", self.queries.finish, seq, host_array(out.last[i]))
                continue
            (ready if seq.req.beam is None else beams).append(i)
            if caching and self.prompts.wants(seq):
                self.prompts.store(seq)
            if seq.req.followers:
                fan += [(f, i) for f in self.requests.fan_out(seq)]
        return ready, beams, fan

    def _guard(self, seq: Seq | QuerySeq, what: str, fn: Callable[..., Any], *args: Any) -> None:
        failure = guard(seq, what, fn, *args)
        if failure is not None:
            self.requests.fail(*failure)

    def _beam_search(self, plan: Plan, beams: list[int], out: Any) -> None:
        """4. Advance the beam requests of these rows; finish those whose search ended."""
        for req, reason, error in self.beams.step([plan[i][0] for i in beams], host_array(out.last[beams])):
            self.requests.finish(req, reason, error)

    def _sample(self, plan: Plan, ready: list[int], fan: list[tuple[Seq, int]], out: Any) -> tuple[list[Seq], list[Sample | None]]:
        """5. Sample the ready rows, and the forked completions from their first's row."""
        seqs = [plan[i][0] for i in ready]
        if fan:
            seqs += [f for f, _ in fan]
            logits = out.last[ready + [i for _, i in fan]]
        else:  # a whole-batch step needs no gather
            logits = out.last if len(ready) == len(plan) else out.last[ready]
        samples, failures = sample_contained(self.sampler, logits, seqs, self._fill_masks)
        if failures:
            self.requests.fail_each(failures)
        return seqs, samples

    def _verify(self, plan: Plan, rows: list[int], out: Any, texts: list[tuple[Seq, int, bool]] | None,
                touched: Collection[Req], failures: list[Any]) -> tuple[Collection[Req], list[Any]]:
        """5-6 for speculative verify rows (``lmdock._engine.speculative``): their tokens, position by
        position, with the ordinary sampler and output processing."""
        reqs, more = self.spec.verify(
            plan, rows, out.full,
            lambda logits, seqs: sample_contained(self.sampler, logits, seqs, self._fill_masks),
            lambda seqs, samples: self.output.process(seqs, samples, self.kv, texts),
        )
        reqs.update((id(r), r) for r in touched)
        return reqs.values(), failures + more

    def _report(self, touched: Collection[Req], texts: list[tuple[Seq, int, bool]] | None) -> None:
        """7. Report to the sinks; with the overlap, the text and reports of requests without stop
        strings wait for the next engine step."""
        reports = self.requests.report(touched, defer=texts is not None)
        if texts is not None:
            self.requests.settle(self.deferred.defer(texts, reports))
