"""Host work that runs while the engine computes (vLLM v1's async output processing is the model).

A step's detokenization and output delivery are not needed to launch the next step: only the sampled
tokens and the stops that need no text (EOS, stop token ids, length) are.  When the step engine
computes outside the GIL and leaves a CPU core free (``StepEngine.overlap_host_work``: its forward
runs on an accelerator), or ``[scheduler] async_output = true`` says so, the runner hands that work
to one helper thread right before the next ``engine.step`` and waits for it right after, so it costs
the loop nothing while the forward runs.  Requests with stop strings are not deferred: their stop
decision needs the text at once.

Where the forward uses every core (ONNX Runtime, torch and MLX on a CPU start one thread per core),
the helper competes with it: on a 2-core machine ONNX Runtime's decode step took 321 -> 411 us with
the helper beside it, and the hand-off itself ~11 us, so the default there is off.

:class:`DeferredOutput` holds the deferred work of the last step and runs it beside the next one;
:class:`HostWorker` is the helper thread.  Failures go back to the loop (``Requests.settle``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeAlias

from lmdock._engine.failures import Failure, as_request_error
from lmdock._engine.output import OutputProcessor
from lmdock._engine.sequence import Req, Seq
from lmdock._llm.streams import safe_put

log = logging.getLogger("lmdock.engine")

#: A step's output work goes to the helper thread only when it has at least this many texts to
#: detokenize and outputs to report; less does not pay for the hand-off (~10-20 us,
#: ``benchmarks/engine_overhead.py --compute-us``).
MIN_DEFERRED = 4

#: Deferred work: (sequence, token, stopped by a token) to detokenize, then requests to report.
Job: TypeAlias = "tuple[list[tuple[Seq, int, bool]], list[Req]]"


class DeferredOutput:
    """The deferred half of steps 6-7 (detokenize, then report) for requests without stop strings."""

    def __init__(self, output: OutputProcessor, enabled: bool) -> None:
        self.output = output
        self.enabled = enabled
        self.worker: HostWorker | None = HostWorker() if enabled else None
        #: the last step's work, run during the next engine step, or flushed
        self.pending: Job | None = None

    def defer(self, texts: list[tuple[Seq, int, bool]], reports: list[Req]) -> list[Failure]:
        """Keep a step's work for the next engine step, or do it now when it is too little to pay
        for the hand-off (``MIN_DEFERRED``)."""
        if len(texts) + len(reports) >= MIN_DEFERRED:
            self.pending = (texts, reports)
            return []
        return self.emit((texts, reports)) if texts or reports else []

    def beside(self, step: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None, list[Failure]]:
        """Run ``step(*args)`` (the engine step) with the pending work on the helper thread beside it:
        ``(its result or None, what it raised or None, the pending work's failures)``.  Whatever
        happened, the helper is done before this returns."""
        job, self.pending = self.pending, None
        failures: list[Failure] = []
        if job is not None:
            assert self.worker is not None  # noqa: S101 - only the overlap defers work
            self.worker.start(lambda: failures.extend(self.emit(job)))
        try:
            return step(*args), None, failures
        except Exception as exc:
            return None, exc, failures
        finally:
            if job is not None:
                self.worker.wait()  # type: ignore[union-attr]

    def flush(self) -> list[Failure]:
        """Run the pending work now, in the loop thread."""
        job, self.pending = self.pending, None
        return self.emit(job) if job is not None else []

    def emit(self, job: Job) -> list[Failure]:
        """Detokenize, then report (on the helper thread, or inline when flushed).  Touches only these
        requests' text and sinks; a request whose text failed gets no report, its failure instead."""
        texts, reports = job
        push = self.output.push_text
        failed: dict[int, Failure] = {}
        for seq, token, by_token in texts:
            try:
                push(seq, token, by_token)
            except Exception as exc:
                failed.setdefault(id(seq.req), (seq, as_request_error(exc, "detokenizing")))
        snapshot = self.output.snapshot
        for req in reports:
            if id(req) not in failed:
                safe_put(req.sink, snapshot(req))
        return list(failed.values())

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class HostWorker:
    """One daemon thread that runs a job while the loop thread runs the engine step.

    ``start(job)`` then ``wait()``, strictly in pairs, from the loop thread only: at most one job is
    ever in flight, so the two threads never touch the same request at the same time.
    """

    def __init__(self, name: str = "lmdock-output") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def wait(self) -> None:
        self._done.get()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # a job catches its own errors; this is a bug, never a hang
                log.exception("deferred output work failed")
            finally:
                self._done.put(None)
