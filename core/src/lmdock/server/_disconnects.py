"""A client gone, or the server's drain run out: the work of its request cancelled (which aborts its
engine requests), answered 499 or 503."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from lmdock.server._errors import APIError, as_api_error
from lmdock.server._state import state_of


async def wait_disconnect(request: Request) -> None:
    """Return once the client has closed the connection."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def cut_error(request: Request) -> APIError:
    """The 503 of a request cut by shutdown (``shutdown_timeout`` passed), with Retry-After."""
    return as_api_error(asyncio.CancelledError(), state_of(request).retry_after)


async def unless_disconnected(request: Request, work: Any) -> Any:
    """Await ``work``; if the client goes first, cancel it (aborting its engine requests) and stop; if
    the server's drain runs out first (:attr:`ServerState.cut`), cancel it and answer 503."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request))
    cut = asyncio.ensure_future(state_of(request).cut.wait())
    try:
        await asyncio.wait({task, watch, cut}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watch.done() and not watch.cancelled()  # else this route itself was cancelled (shutdown)
        was_cut = cut.done() and not cut.cancelled()
        watch.cancel()
        cut.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if gone:
                raise APIError(499, "the client closed the connection")
            if was_cut:
                raise cut_error(request)
    return task.result()
