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
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("lmdock.engine")


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
