"""The HTTP limits of ``[server]``, enforced where uvicorn reads a connection, before any route runs.

uvicorn's default parser (httptools) buffers a request's head whatever its size (a 64 MB header was
read, then answered 200), and no timer runs while a head arrives, so connections that never finish
their headers (slowloris) are held for ever and exhaust the file descriptors.  :class:`LimitedH11Protocol`
is uvicorn's h11 protocol with:

1. ``max_header_bytes``: a head still incomplete past it is answered 431 and the connection closed,
   so it costs one read buffer, never the whole header;
2. ``header_timeout``: a head not complete that long after the connection opened (or its previous
   response ended) is answered 408 and closed (an idle connection is closed at its keep-alive timeout);
3. ``max_headers``: a request with more header lines is answered 431;
4. ``max_connections``: past it, a request is answered 503 with ``Retry-After`` and the connection
   closed (uvicorn's ``limit_concurrency`` answers in plain text), so exhaustion is a refusal to
   retry, and the slow connections that caused it are gone within ``header_timeout``;
5. draining: an idle keep-alive connection stays open until its keep-alive timeout, so a request
   sent on it gets the guard's 503 (uvicorn closed it at once: the client read nothing).
"""

from __future__ import annotations

import asyncio
import functools
import json
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from lmdock._config.server import ServerConfig
from lmdock.server._errors import error_body
from lmdock.server._guard import send_error

#: What h11 itself may buffer of an incomplete head past ``max_header_bytes`` (one socket read and
#: more): only a backstop, the 431 comes first.
H11_SLACK = 1 << 20


def protocol(settings: ServerConfig) -> Any:
    """The ``http`` protocol factory to give ``uvicorn.Config``."""
    return functools.partial(LimitedH11Protocol, settings=settings)


def uvicorn_options(settings: ServerConfig) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for the limits of ``settings``."""
    return {"http": protocol(settings), "h11_max_incomplete_event_size": settings.max_header_bytes + H11_SLACK,
            "timeout_keep_alive": settings.keep_alive_timeout}


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a bounded head, a header-read timeout and a connection limit."""

    def __init__(self, *args: Any, settings: ServerConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.inner_app = self.app
        self.app = self.admit
        self.head_bytes = 0  # bytes received since this request's head began
        self.head_timer: asyncio.TimerHandle | None = None

    # -- the head: size and time -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self.head_bytes += len(data)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in: a request runs (or the connection failed)
            self._head_done()
            self.head_bytes = 0
        elif self.transport.is_closing():
            return
        elif self.head_bytes > self.settings.max_header_bytes:
            self.refuse(431, self._too_large())
        elif self.head_timer is None:  # a new head began without a response ending (an early answer, then more)
            self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.head_bytes = 0
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """Draining: uvicorn closes an idle connection here, and a request its client sends meanwhile
        reads nothing.  Left open until its keep-alive timeout, such a request gets the guard's 503
        with ``Retry-After`` and ``Connection: close``; a request in flight finishes first."""
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.timeout_keep_alive_task is None and not self.transport.is_closing():
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _arm_head_timer(self) -> None:
        self._head_done()
        self.head_timer = self.loop.call_later(self.settings.header_timeout, self._head_timed_out)

    def _head_done(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.head_bytes == 0:  # an idle connection: closed, as at its keep-alive timeout
            self.timeout_keep_alive_handler()
            return
        self.refuse(408, f"the request's headers did not arrive within {self.settings.header_timeout:g} s "
                         "([server] header_timeout)")

    def _too_large(self) -> str:
        return f"the request's headers are larger than the limit of {self.settings.max_header_bytes} bytes ([server] max_header_bytes)"

    def refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with OpenAI's error body and close, before h11 has a request to answer."""
        body = json.dumps(error_body(status, message)).encode()
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        self._head_done()
        self.transport.write(head.encode() + body)
        self.transport.close()

    # -- the request: header count, connection limit -----------------------------------------------

    async def admit(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The app, behind the limits that need the parsed request."""
        s = self.settings
        # a head that arrived whole in one read is measured here (data_received measures it while it comes)
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > s.max_header_bytes:
            await send_error(send, 431, self._too_large(), {"Connection": "close"})
            return
        if len(scope["headers"]) > s.max_headers:
            await send_error(send, 431, f"the request has {len(scope['headers'])} headers, more than the limit of "
                                        f"{s.max_headers} ([server] max_headers)", {"Connection": "close"})
            return
        if len(self.connections) > s.max_connections or len(self.tasks) > s.max_connections:
            await send_error(send, 503, f"the server holds {len(self.connections)} connections, its limit is "
                                        f"{s.max_connections} ([server] max_connections); retry after the Retry-After seconds",
                             {"Retry-After": str(s.retry_after), "Connection": "close"})
            return
        await self.inner_app(scope, receive, send)
