"""Sinks that carry a request's progress from the engine thread to the caller."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
from collections.abc import Callable
from typing import Any

from lmdock._outputs import RequestOutput

log = logging.getLogger("lmdock")


def safe_put(sink: Any, output: RequestOutput) -> bool:
    """Deliver ``output`` to ``sink``; a sink whose listener is gone (a closed event loop, a settled
    future, a raising callback) must never stop the engine that feeds it.  False if the sink raised."""
    try:
        sink.put(output)
        return True
    except Exception:  # noqa: BLE001 - the listener's failure is the listener's
        log.debug("a sink refused an output", exc_info=True)
        return False


def safe_fail(sink: Any, error: BaseException) -> bool:
    """Fail ``sink`` with ``error``, under the same rule as :func:`safe_put`."""
    try:
        sink.fail(error)
        return True
    except Exception:  # noqa: BLE001
        log.debug("a sink refused an error", exc_info=True)
        return False


class RequestFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """The future of one request: ``.result(timeout)``, ``await .aresult()``, ``.cancel()``.

    Cancelling aborts the request in the engine, which frees its KV state at once.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        super().__init__()
        self.request_id = request_id
        self._abort = abort

    # OutputSink.  A cancel (from another thread) can land between a done() check and the set, so
    # the set itself is the check: an InvalidStateError means the future was already settled.
    def put(self, output: RequestOutput) -> None:
        if output.finished:
            try:
                self.set_result(output)
            except concurrent.futures.InvalidStateError:
                pass

    def fail(self, error: BaseException) -> None:
        try:
            self.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self._abort(self.request_id)
        return cancelled

    async def aresult(self) -> RequestOutput:
        """Wait without blocking the event loop."""
        return await asyncio.wrap_future(self)


class QueueSink:
    """Puts every snapshot (or the error) on a thread-safe queue, for synchronous streaming."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Any] = queue.Queue()

    def put(self, output: RequestOutput) -> None:
        self.queue.put(output)

    def fail(self, error: BaseException) -> None:
        self.queue.put(error)


class AsyncQueueSink:
    """Puts every snapshot (or the error) on an asyncio queue of the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, output: RequestOutput) -> None:
        self._send(output)

    def fail(self, error: BaseException) -> None:
        self._send(error)

    def _send(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass
