"""Sinks that carry a request's progress from the engine thread to the caller."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import Callable
from typing import Any

from lmdock._outputs import RequestOutput


class RequestFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """The future of one request: ``.result(timeout)``, ``await .aresult()``, ``.cancel()``.

    Cancelling aborts the request in the engine, which frees its KV state at once.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        super().__init__()
        self.request_id = request_id
        self._abort = abort

    # OutputSink
    def put(self, output: RequestOutput) -> None:
        if output.finished and not self.done():
            self.set_result(output)

    def fail(self, error: BaseException) -> None:
        if not self.done():
            self.set_exception(error)

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
