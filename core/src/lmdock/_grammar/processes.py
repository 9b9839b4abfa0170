"""A small pool of grammar-check worker processes (``lmdock._grammar.worker``), one per process.

A check takes an idle worker (waiting while all are busy), sends it the job and waits for the reply
until the deadline.  A worker that dies (a native crash: a stack overflow in llguidance, an abort on
memory) or misses the deadline is killed and replaced by a fresh one on the next check; the request
gets the reason.  Workers start on first use (``python -m lmdock._grammar.worker``: spawned, so they
inherit no lock of this threaded process and do not re-run a user's ``__main__``) and keep the
tokenizers they were sent, so a tokenizer is sent to each worker once.
"""

from __future__ import annotations

import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from lmdock._grammar.worker import recv, send

#: Worker processes: half the cores, 1 to 4 (a check is one core's work; the engine needs the rest).
WORKERS = max(1, min(4, (os.cpu_count() or 2) // 2))
#: Seconds one check may take in a worker (compile and the first steps) before it is refused.
DEADLINE_S = 10.0


class WorkerFailed(Exception):
    """The worker died or missed the deadline (``reason`` says which); it has been replaced."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Worker:
    """One worker process and the tokenizer keys it holds."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "lmdock._grammar.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True, start_new_session=True)
        self.tokenizers: set[str] = set()

    def ask(self, job: tuple[Any, ...], deadline: float) -> Any:
        """Send ``job``; its reply, or WorkerFailed (then this worker is dead)."""
        try:
            send(self.proc.stdin, job)  # type: ignore[arg-type]
        except OSError:
            raise self._failed("died") from None
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise self._failed("timeout")
        try:
            return recv(self.proc.stdout)  # type: ignore[arg-type]
        except (EOFError, OSError):
            raise self._failed("died") from None

    def _failed(self, how: str) -> WorkerFailed:
        self.kill()
        if how == "timeout":
            return WorkerFailed("timeout")
        code = self.proc.returncode
        what = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
        return WorkerFailed(f"it crashed the grammar compiler ({what})")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:
                pass

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class GrammarPool:
    """``check(key, spec, fields)``: run one grammar check in a worker (see the module's docstring)."""

    def __init__(self, size: int = WORKERS, deadline_s: float = DEADLINE_S) -> None:
        self.size = size
        self.deadline_s = deadline_s
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(size):
            self._idle.put(None)  # a place for a worker, started when first taken
        #: workers started so far (replacements included) and checks run: tests and metrics read them
        self.started = 0
        self.checks = 0
        self._lock = threading.Lock()

    def check(self, key: str, spec: Any, fields: dict[str, Any]) -> str | None:
        """None if the grammar passed, else the reason it was refused (WorkerFailed's included)."""
        worker = self._take()
        try:
            reply = self._ask(worker, key, spec, fields)
        except WorkerFailed as exc:
            self._idle.put(None)  # dead: its place gets a fresh worker on next use
            return f"it did not compile within {self.deadline_s:g} s" if exc.reason == "timeout" else exc.reason
        except BaseException:  # interrupted mid-job: its reply would answer the next job
            worker.kill()
            self._idle.put(None)
            raise
        self._idle.put(worker)
        kind, message = reply
        return None if kind == "ok" else message

    def _ask(self, worker: _Worker, key: str, spec: Any, fields: dict[str, Any]) -> Any:
        deadline = time.monotonic() + self.deadline_s
        with self._lock:
            self.checks += 1
        reply = worker.ask((key, None, fields), deadline) if key in worker.tokenizers else ("need_tokenizer", None)
        if reply[0] == "need_tokenizer":
            reply = worker.ask((key, spec() if callable(spec) else spec, fields), deadline)
            worker.tokenizers.add(key)
        return reply

    def _take(self) -> _Worker:
        worker = self._idle.get()
        if worker is not None and worker.alive:
            return worker
        try:
            fresh = _Worker()
        except BaseException:
            self._idle.put(None)
            raise
        with self._lock:
            self.started += 1
        return fresh

    def workers(self) -> list[_Worker]:
        """The idle workers now (for tests: one may be killed to see it replaced)."""
        return [w for w in list(self._idle.queue) if w is not None]

    def close(self) -> None:
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


_shared: GrammarPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> GrammarPool:
    """The process's pool (created on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = GrammarPool()
        return _shared
