"""Sinks that carry a request's progress from the engine thread to the caller."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from lmdock._llm.outputs import RequestOutput

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
    """The future of one request: ``.result(timeout)``, ``await .aresult()`` (or ``await fut``),
    ``.cancel()``, and ``async for out in fut`` (TensorRT-LLM's): every cumulative snapshot when the
    request streams (``generate_async(..., streaming=True)``), else the final output once.

    Cancelling aborts the request in the engine, which frees its KV state at once.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None], *, streaming: bool = False) -> None:
        super().__init__()
        self.request_id = request_id
        self._abort = abort
        self._snapshots = _Snapshots() if streaming else None

    # OutputSink.  A cancel (from another thread) can land between a done() check and the set, so
    # the set itself is the check: an InvalidStateError means the future was already settled.
    def put(self, output: RequestOutput) -> None:
        if self._snapshots is not None:
            self._snapshots.push(output)
        if output.finished:
            try:
                self.set_result(output)
            except concurrent.futures.InvalidStateError:
                pass

    def fail(self, error: BaseException) -> None:
        if self._snapshots is not None:
            self._snapshots.push(error)
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

    def __await__(self) -> Any:
        return self.aresult().__await__()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Each snapshot as it comes (streaming), else the final output; leaving the loop early aborts
        the request."""
        if self._snapshots is None:
            yield await self.aresult()
            return
        finished = False
        try:
            while True:
                item = await self._snapshots.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.cancel()


class _Snapshots:
    """A streaming future's snapshots, from the engine thread to one async reader on any event loop
    (the loop is the reader's, known only when it starts reading)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    def push(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, fut = waiter
            try:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
            except RuntimeError:  # the reader's loop is closed: nobody is listening any more
                pass

    async def get(self) -> Any:
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                self._waiter = (loop, fut)
            await fut


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
