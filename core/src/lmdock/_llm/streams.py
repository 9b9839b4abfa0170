"""A request's outputs on their way from the engine thread to the caller: :class:`RequestStream`,
the one stream every reader uses (``LLM.stream`` / ``stream_generate``, a streaming
:class:`RequestFuture`, ``lmdock serve``'s routes, its Ray replicas), and the future of one request."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
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


class RequestStream:
    """One request's snapshots (or its error), from the engine thread to one reader: the engine's sink
    (``put`` / ``fail``) on one side; on the other ``for out in stream`` (a thread) or ``async for out
    in stream`` (any event loop, known only when it starts reading).  The last snapshot is finished.

    ``merge``: snapshots are cumulative, so when several wait (the reader fell behind the engine) only
    the newest is read, as vLLM's output collector merges the outputs its consumer has not taken; a
    lagging reader (``lmdock serve`` under load) then gets fewer, fuller snapshots instead of falling
    further behind.  ``skipped(out)`` sees each snapshot merged away (the server's metrics count it).
    Without ``merge`` every snapshot is read (the Python API's iterators: TensorRT-LLM's contract).

    Closing the stream before its last output (leaving the loop, cancelling the task, :meth:`close`)
    aborts the request: ``abort(request_id)``, which frees its KV state at once.
    """

    def __init__(self, request_id: str, abort: Callable[[str], Any], *, merge: bool = False,
                 skipped: Callable[[RequestOutput], Any] | None = None, alive: Callable[[], bool] | None = None) -> None:
        self.request_id = request_id
        self._abort = abort
        self._merge = merge
        self._skipped = skipped
        self._alive = alive  # a synchronous reader stops waiting once it says False (the LLM shut down)
        self._lock = threading.Lock()
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: threading.Event | tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self.done = False  # the last output or the error was read, or the stream was closed

    # -- the engine's side (OutputSink) ---------------------------------------------------------

    def put(self, output: RequestOutput) -> None:
        self._push(output)

    def fail(self, error: BaseException) -> None:
        self._push(error)

    def _push(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if isinstance(waiter, threading.Event):
            waiter.set()
        elif waiter is not None:
            loop, fut = waiter
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # the reader's loop is closed: nobody is listening any more
                pass

    # -- the reader's side ------------------------------------------------------------------------

    def _take(self) -> Any:
        """The next item (under the lock, with one waiting): the newest snapshot where merging."""
        item = self._items.popleft()
        while self._merge and self._items and not isinstance(item, BaseException) and not item.finished:
            if self._skipped is not None:
                self._skipped(item)
            item = self._items.popleft()
        return item

    async def aget(self) -> Any:
        """The next snapshot or error, waiting on the running loop."""
        while True:
            with self._lock:
                if self._items:
                    return self._take()
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                self._waiter = (loop, fut)
            await fut

    def get(self, timeout: float | None = None) -> Any:
        """The next snapshot or error, waiting this thread; ``queue.Empty`` after ``timeout`` seconds."""
        while True:
            with self._lock:
                if self._items:
                    return self._take()
                event = threading.Event()
                self._waiter = event
            if not event.wait(timeout):
                raise queue.Empty

    def _read(self, item: Any) -> RequestOutput:
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item  # type: ignore[no-any-return]

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.done:
                yield self._read(await self.aget())
        finally:
            self.close()

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            while not self.done:
                yield self._read(self._next())
        finally:
            self.close()

    def _next(self) -> Any:
        """The next item of a synchronous read; never waits past the ``alive`` check saying False."""
        from lmdock._plugin.errors import EngineClosedError

        while True:
            try:
                return self.get(timeout=0.5)
            except queue.Empty:
                if self._alive is not None and not self._alive():
                    raise EngineClosedError("the LLM was shut down while the stream was waiting") from None

    def close(self) -> None:
        """Abort the request unless its last output was read.  Idempotent."""
        if not self.done:
            self.done = True
            self._abort(self.request_id)


async def submit_from_loop(engine: Any, request: Any, sink: Any) -> None:
    """Submit ``request`` from an event loop; one with a grammar on a thread, where the engine compiles
    it (checked already, but a big one still takes a while), so the loop does not wait for it.  An
    engine whose ``submit`` must run on the loop and compiles nothing there says so:
    ``submit_on_loop = True`` (lmdock serve's Ray front end, whose replicas compile)."""
    if request.params.structured_output is None or engine.submit_on_loop:
        engine.submit(request, sink)
        return
    done = asyncio.ensure_future(asyncio.to_thread(engine.submit, request, sink))
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:  # the reader left while it compiled: abort it once it is in
        done.add_done_callback(lambda f: f.cancelled() or f.exception() or engine.abort(request.request_id))
        raise


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


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
        # leaving the stream early cancels this future, which aborts the request
        self._stream = RequestStream(request_id, lambda _: self.cancel()) if streaming else None

    # OutputSink.  A cancel (from another thread) can land between a done() check and the set, so
    # the set itself is the check: an InvalidStateError means the future was already settled.
    def put(self, output: RequestOutput) -> None:
        if self._stream is not None:
            self._stream.put(output)
        if output.finished:
            try:
                self.set_result(output)
            except concurrent.futures.InvalidStateError:
                pass

    def fail(self, error: BaseException) -> None:
        if self._stream is not None:
            self._stream.fail(error)
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
        if self._stream is None:
            yield await self.aresult()
            return
        async for out in self._stream:
            yield out
