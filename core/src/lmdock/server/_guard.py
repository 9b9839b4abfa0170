"""The guard in front of every route: drain (503), API key (401), body size (413); pure ASGI, so
streaming and disconnects pass through untouched."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from lmdock.server._errors import body_for, is_anthropic
from lmdock.server._state import ServerState


class Guard:
    """ASGI middleware: refuses while draining, without the API key, or past ``max_body_bytes``."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st = self.state
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if st.draining:
            # Connection: close, so the client's next request opens a new connection (to another replica)
            await send_error(send, 503, "the server is shutting down; retry on another replica or later",
                             {"Retry-After": str(st.settings.retry_after), "Connection": "close"}, scope=scope)
            return
        refusal = self._auth_refusal(scope, headers)
        if refusal is not None:
            await send_error(send, 401, refusal, scope=scope)
            return
        limit = st.settings.max_body_bytes
        length = headers.get("content-length")
        too_big = f"the request body is larger than the limit of {limit} bytes ([server] max_body_bytes)"
        if length is not None and length.isdigit() and int(length) > limit:
            await send_error(send, 413, too_big, scope=scope)
            return
        await self._limited(scope, receive, send, limit, too_big)

    def _auth_refusal(self, scope: dict[str, Any], headers: dict[str, str]) -> str | None:
        """Why the request may not pass for want of the API key, or None (``/health`` and CORS preflights need none)."""
        key = self.state.api_key
        if key is None or scope.get("path", "") == "/health" or scope.get("method") == "OPTIONS":
            return None
        auth = headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        # ASGI headers are bytes, read here as latin-1: back to those bytes, against the key as UTF-8
        if hmac.compare_digest(given.encode("latin-1"), key.encode("utf-8")):
            return None
        what = "wrong API key" if given else "missing API key"
        return f"{what}: send 'x-api-key: <key>'" if is_anthropic(scope) else f"{what}: send 'Authorization: Bearer <key>'"

    async def _limited(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any], limit: int,
                       too_big: str) -> None:
        seen = 0
        overflow = False

        async def limited() -> dict[str, Any]:
            # A chunked body is counted as it arrives; past the limit the app gets an empty final chunk
            # and whatever it answers is replaced by the 413.
            nonlocal seen, overflow
            if overflow:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    overflow = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return msg  # type: ignore[no-any-return]

        replaced = False

        async def guarded_send(msg: dict[str, Any]) -> None:
            nonlocal replaced
            if overflow:
                if not replaced:
                    replaced = True
                    await send_error(send, 413, too_big, scope=scope)
                return
            await send(msg)

        await self.app(scope, limited, guarded_send)


async def send_error(send: Callable[..., Any], status: int, message: str, headers: dict[str, str] | None = None,
                     scope: dict[str, Any] | None = None) -> None:
    """Answer straight on the ASGI channel (before any route runs), in the body the route's API uses
    (:func:`refusal_body`)."""
    body = json.dumps(refusal_body(scope or {}, status, message)).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


def refusal_body(scope: dict[str, Any], status: int, message: str) -> dict[str, Any]:
    """The refusal's body in the dialect of the API at ``scope`` (``_errors.body_for``)."""
    return body_for(scope, status, message)
