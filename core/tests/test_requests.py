"""lmdock._engine.requests: a request is created with one sequence per completion, admitted through the
scheduler, fanned out, and ended once (every sequence released, the sink told once), over a recording KV
stand-in and the FAKE step engine's tokenizer (core plumbing only: ``fakes.py``)."""

from __future__ import annotations

from itertools import count
from typing import Any

import pytest
from fakes import FakeStepEngine
from lmdock import QueueFullError, RequestError, RequestOutput, SamplingParams, SchedulerConfig
from lmdock._engine.inbox import Add
from lmdock._engine.output import OutputProcessor
from lmdock._engine.requests import Requests
from lmdock._engine.scheduler import FcfsScheduler
from lmdock._plugin.contract import EngineRequest


class Sink:
    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.errors: list[BaseException] = []

    def put(self, output: RequestOutput) -> None:
        self.outputs.append(output)

    def fail(self, error: BaseException) -> None:
        self.errors.append(error)


class RecordingKV:
    """What the requests ask of the KV state: releases (each must happen once) and forks."""

    def __init__(self, can_fork: bool = True) -> None:
        self.released: list[int] = []
        self.forked: list[tuple[int, int]] = []
        self.can_fork = can_fork

    def release(self, seq: Any) -> None:
        if not seq.held:
            return  # as kv.KV: a sequence that holds nothing has nothing to release
        seq.held = False
        self.released.append(seq.seq_id)

    def fork(self, parent: int, child: Any, length: int) -> bool:
        if self.can_fork:
            self.forked.append((parent, child.seq_id))
            child.held = True
        return self.can_fork


def setup(kv: RecordingKV | None = None, **config: int) -> tuple[Requests, FcfsScheduler, RecordingKV]:
    engine = FakeStepEngine()
    scheduler = FcfsScheduler(SchedulerConfig(**config), max_seq_len=64, kv_capacity_tokens=None)
    kv = kv or RecordingKV()
    output = OutputProcessor(engine.tokenizer, engine.eos_token_ids, max_seq_len=64)
    return Requests(engine, scheduler, kv, output, queries=None), scheduler, kv  # type: ignore[arg-type]


def add(requests: Requests, request_id: str, params: SamplingParams, ids: count) -> tuple[Any, Sink]:
    sink = Sink()
    message = Add(EngineRequest(request_id, "ab", [5, 6], params), sink, processors=(), constraints=None)
    req = requests.create(message, lambda: next(ids))
    requests.admit(req)
    return req, sink


def test_n_completions_admit_the_first_and_fork_the_others_once_its_prompt_is_computed() -> None:
    requests, scheduler, kv = setup()
    req, _ = add(requests, "r", SamplingParams(n=3), count())
    assert [s.index for s in req.seqs] == [0, 1, 2] and list(scheduler.waiting) == [req.seqs[0]]
    first = req.seqs[0]
    scheduler.schedule()
    first.held, first.num_computed = True, 2
    assert requests.fan_out(first) == req.seqs[1:]
    assert kv.forked == [(first.seq_id, req.seqs[1].seq_id), (first.seq_id, req.seqs[2].seq_id)]
    assert scheduler.running[0] is first and set(scheduler.running) == set(req.seqs)  # the forks run beside the first


def test_an_engine_that_cannot_fork_prefills_the_others() -> None:
    requests, scheduler, _ = setup(RecordingKV(can_fork=False))
    req, _ = add(requests, "r", SamplingParams(n=2), count())
    scheduler.schedule()
    assert requests.fan_out(req.seqs[0]) == [] and list(scheduler.waiting) == [req.seqs[1]]


def test_a_full_queue_fails_the_request_at_admission_and_keeps_nothing() -> None:
    requests, _, _ = setup(max_waiting=1)
    ids = count()
    add(requests, "a", SamplingParams(), ids)
    req, sink = add(requests, "b", SamplingParams(), ids)
    assert len(sink.errors) == 1 and isinstance(sink.errors[0], QueueFullError)
    assert "b" not in requests.by_id and "a" in requests.by_id


def test_an_abort_ends_the_request_once_releasing_every_sequence() -> None:
    requests, _, kv = setup()
    req, sink = add(requests, "r", SamplingParams(n=2), count())
    for s in req.seqs:
        s.held = True
    requests.abort("r")
    requests.abort("r")  # a second abort finds nothing
    assert sorted(kv.released) == sorted(s.seq_id for s in req.seqs) and requests.aborted == 1
    assert len(sink.outputs) == 1 and [o.finish_reason for o in sink.outputs[0].outputs] == ["abort", "abort"]
    requests.finish(req, "abort")  # ended once: the sink hears nothing more
    assert len(sink.outputs) == 1 and not sink.errors


def test_a_failure_goes_to_the_sink_as_the_error() -> None:
    requests, _, _ = setup()
    req, sink = add(requests, "r", SamplingParams(), count())
    error = RequestError("boom")
    requests.fail(req.seqs[0], error)
    assert sink.errors == [error] and not sink.outputs and req.done


@pytest.mark.parametrize("stream", [False, True])
def test_report_tells_a_streaming_request_every_step_and_the_others_at_the_end(stream: bool) -> None:
    requests, _, _ = setup()
    req, sink = add(requests, "r", SamplingParams(max_new_tokens=2), count())
    req.request = EngineRequest("r", "ab", [5, 6], req.request.params, stream=stream)
    seq = req.seqs[0]
    seq.token_ids.append(7)
    requests.report([req], defer=False)
    assert len(sink.outputs) == (1 if stream else 0)
    seq.finish_reason = "length"
    requests.report([req], defer=False)
    assert sink.outputs[-1].finished and "r" not in requests.by_id
