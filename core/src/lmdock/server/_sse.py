"""Streamed responses: chunks as server-sent events, then ``[DONE]``; an error mid-stream, or the end
of the server's drain, as an error event; the request's admission released however the stream ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from lmdock.server._admission import Admission
from lmdock.server._disconnects import cut_error, wait_disconnect
from lmdock.server._errors import APIError, as_api_error, body_for
from lmdock.server._state import state_of

DONE = "data: [DONE]\n\n"


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def error_event(request: Request, err: APIError) -> str:
    """An error sent mid-stream, in the dialect of the API that was called (``_errors.body_for``)."""
    return sse(body_for(request.scope, err.status, err.message, err.param, err.code))


async def _events(request: Request, chunks: AsyncIterator[dict[str, Any]], admission: Admission, retry: int) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - an error mid-stream goes to the client as an event
        yield error_event(request, as_api_error(exc, retry))
    finally:
        admission.release()
    yield DONE


def sse_response(request: Request, chunks: AsyncIterator[dict[str, Any]], admission: Admission, retry: int) -> StreamingResponse:
    """``chunks`` as server-sent events, then ``[DONE]``; an error mid-stream is sent as an error
    event, and so is the end of the server's drain (:attr:`ServerState.cut`: a 503 to retry); the
    admission is released when the stream ends however it ends."""
    events = _events(request, chunks, admission, retry)
    state = state_of(request)

    async def body() -> AsyncIterator[str]:
        # Our own watcher as well as Starlette's: a client gone while nothing is sent (queued, or
        # between tokens) still aborts the request at once.
        gen = events.__aiter__()
        watch = asyncio.ensure_future(wait_disconnect(request))
        cut = asyncio.ensure_future(state.cut.wait())
        nxt: asyncio.Future[str] | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(gen.__anext__())
                await asyncio.wait({nxt, watch, cut}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    if cut.done() and not watch.done():  # cut by shutdown: abort, then say so and end
                        nxt.cancel()
                        await asyncio.gather(nxt, return_exceptions=True)
                        yield error_event(request, cut_error(request))
                        yield DONE
                    return
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            # No await may be needed here: a cancelled (disconnected) response cannot wait.  Cancelling
            # the pending step unwinds the generators, whose finally blocks abort the engine requests.
            watch.cancel()
            cut.cancel()
            if nxt is not None and not nxt.done():
                nxt.cancel()
            elif nxt is not None:
                asyncio.ensure_future(gen.aclose())  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
