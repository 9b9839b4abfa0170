"""The requests in flight: add, finish, fail, and report to their sinks.

A request ends once: :meth:`Requests.finish` releases every sequence (``lmdock._engine.kv``) and tells
the sink once, a final output or the error.  A failure names a sequence (:data:`Failure`); a query's
fails that query, a request's fails its whole request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from lmdock._engine.failures import Failure
from lmdock._engine.inbox import Add
from lmdock._engine.kv import KV
from lmdock._engine.output import OutputProcessor
from lmdock._engine.queries import Queries
from lmdock._engine.scheduler import SchedulerBase
from lmdock._engine.sequence import QuerySeq, Req, Seq
from lmdock._llm.streams import safe_fail, safe_put
from lmdock._plugin.contract import StepEngine
from lmdock._plugin.errors import LmdockError


class Requests:
    def __init__(self, engine: StepEngine, scheduler: SchedulerBase, kv: KV, output: OutputProcessor, queries: Queries) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.kv = kv
        self.output = output
        self.queries = queries
        self.by_id: dict[str, Req] = {}
        #: requests ended by an abort (a caller's cancel, a client gone), for stats
        self.aborted = 0

    # -- add ------------------------------------------------------------------------------------------

    def create(self, message: Add, new_seq_id: Callable[[], int]) -> Req:
        """A request and its sequences: one per completion (one for beam search, which forks more)."""
        request = message.request
        req = Req(request, message.sink, message.processors, message.constraints, message.bad_words)
        for index in range(1 if req.beam is not None else request.params.n):
            req.seqs.append(Seq(new_seq_id(), req, index, self.engine))
        # n > 1: the prompt is prefilled once; the other completions fork its KV state (fan_out)
        req.followers = req.seqs[1:]
        return req

    def admit(self, req: Req) -> None:
        """Schedule the request's first sequence; a full queue or a prompt that cannot fit fails it."""
        try:
            for seq in req.seqs[:1]:
                self.scheduler.add(seq)
        except LmdockError as exc:
            for seq in req.seqs:
                self.kv.release(seq)
            safe_fail(req.sink, exc)
            return
        self.by_id[req.request.request_id] = req

    def fan_out(self, first: Seq) -> list[Seq]:
        """The first completion's prompt is computed: the others of its request fork its KV state and
        sample their first token from the same logits (engines that cannot fork prefill them instead)."""
        req = first.req
        assert req is not None  # noqa: S101
        followers, req.followers = req.followers, []
        sharing: list[Seq] = []
        for f in followers:
            if self.kv.fork(first.seq_id, f, first.num_computed):
                sharing.append(f)
                self.scheduler.fork(first, f)
            else:
                self.scheduler.add(f)
        return sharing

    # -- end ------------------------------------------------------------------------------------------

    def finish(self, req: Req, reason: str, error: BaseException | None = None) -> None:
        """End a request: every sequence released, the sink told once (a final output or the error)."""
        if req.done:
            return
        req.done = True
        if req.beam is not None and error is None:
            req.beam.done = True  # report the hypotheses finished so far
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = reason
            self.kv.release(seq)
        self.by_id.pop(req.request.request_id, None)
        if error is not None:
            safe_fail(req.sink, error)
        else:
            safe_put(req.sink, self.output.snapshot(req))

    def abort(self, request_id: str) -> None:
        req = self.by_id.get(request_id)
        if req is not None:
            self.aborted += 1
            self.finish(req, "abort")

    def fail(self, seq: Seq | QuerySeq, error: BaseException) -> None:
        if isinstance(seq, QuerySeq):
            self.queries.fail(seq, error)
        elif seq.req is not None:
            self.finish(seq.req, "abort", error=error)

    def fail_each(self, failures: Iterable[Failure]) -> None:
        for seq, error in failures:
            self.fail(seq, error)

    def settle(self, failures: Iterable[Failure]) -> None:
        """Failures of deferred output work: a request already finished had its final output withheld
        (``lmdock._engine.overlap``), so its sink gets the error instead."""
        for seq, error in failures:
            req = seq.req
            if req is not None and req.done:
                safe_fail(req.sink, error)
            else:
                self.fail(seq, error)

    def end_all(self, error: BaseException) -> None:
        for req in list(self.by_id.values()):
            self.finish(req, "abort", error=error)

    # -- report ---------------------------------------------------------------------------------------

    def report(self, touched: Iterable[Req], defer: bool) -> list[Req]:
        """Tell the sinks of the requests this step touched: every step for streaming requests, at
        the end for the others.  With ``defer``, those without stop strings are returned instead,
        to be reported beside the next step (their text is not pushed yet)."""
        deferred: list[Req] = []
        for req in touched:
            if req.done:  # failed by a sibling completion this step
                continue
            if req.finished:
                req.done = True
                self.by_id.pop(req.request.request_id, None)
            elif not req.request.stream:
                continue
            if defer and not req.seqs[0].stops.stops:
                deferred.append(req)
            else:
                safe_put(req.sink, self.output.snapshot(req))
        return deferred


def adapter_names(seqs: list[Seq]) -> str:
    """The LoRA adapters the sequences' requests run under, by name, sorted and comma-separated."""
    names = {s.req.request.lora_request.name for s in seqs if s.req is not None and s.req.request.lora_request is not None}
    return ",".join(sorted(names))
