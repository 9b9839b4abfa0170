"""The one exception mapping: every error becomes a status and a message, written in the dialect of the
API that was called: OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, or on
Anthropic's routes (``/v1/messages*``) Anthropic's, ``{"type": "error", "error": {"type", "message"}}``.
:func:`body_for` is the one place the dialect is chosen: the exception handlers, the guard's refusals
and the errors sent mid-stream all write through it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmdock._plugin.errors import (
    ConfigError,
    EngineClosedError,
    LmdockError,
    QueueFullError,
    RequestError,
    UnsupportedError,
)

log = logging.getLogger("lmdock.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error that becomes an HTTP status with OpenAI's body (and headers such as Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
                      "param": param, "code": code if code is not None else str(status)}}


#: Anthropic's error types by HTTP status (the ``/v1/messages`` routes answer in its body).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body, ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic(scope: dict[str, Any]) -> bool:
    """Whether the request at ``scope`` called Anthropic's API, whose clients read only its error body."""
    path = scope.get("path", "")
    return path == "/v1/messages" or path.startswith("/v1/messages/")  # type: ignore[no-any-return]


def body_for(scope: dict[str, Any], status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The error body in the dialect of the API at ``scope``'s path: Anthropic's on its routes, OpenAI's
    everywhere else."""
    return anthropic_error_body(status, message) if is_anthropic(scope) else error_body(status, message, param, code)


def json_error(status: int, message: str, param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None, scope: dict[str, Any] | None = None) -> JSONResponse:
    """The error as a JSON response, in the dialect of the API at ``scope`` (OpenAI's without one)."""
    return JSONResponse(body_for(scope or {}, status, message, param, code), status_code=status, headers=headers)


def as_api_error(exc: BaseException, retry_after: int, hide: tuple[str, str] | None = None) -> APIError:
    """The status an exception from the engine or the request's own values stands for.  ``hide``:
    ``(the model's path, its served name)``; a client reads the name, never the server's file system."""
    if isinstance(exc, APIError):
        return exc
    text = str(exc)
    if hide is not None and hide[0]:
        text = text.replace(repr(hide[0]), repr(hide[1])).replace(hide[0], hide[1])
    if isinstance(exc, QueueFullError):
        return APIError(429, text, headers={"Retry-After": str(retry_after)})
    if isinstance(exc, asyncio.CancelledError):  # cut by the server: past [server] shutdown_timeout
        return APIError(503, "the request was cut short: the server is shutting down ([server] shutdown_timeout "
                             "passed); retry on another replica or later", headers={"Retry-After": str(retry_after)})
    if isinstance(exc, EngineClosedError):
        return APIError(503, f"the engine is not running: {text}", headers={"Retry-After": str(retry_after)})
    if isinstance(exc, (RequestError, ConfigError, UnsupportedError, ValueError)):
        param = getattr(exc, "key", None)
        if param and param.startswith("sampling_params."):
            param = param.split(".", 1)[1]
        return APIError(400, text, param=param)
    if isinstance(exc, LmdockError):
        return APIError(500, text)
    log.error("request failed", exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}: {text})")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error ``app`` raises (ours, validation, HTTP, and the unexpected) in the dialect of
    the API the request called (:func:`body_for`)."""

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return json_error(exc.status, exc.message, exc.param, exc.code, exc.headers, scope=request.scope)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return json_error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
                              scope=request.scope)
        if first.get("type") == "unknown_field":  # raised by _protocol's bodies, which name the field themselves
            return json_error(400, first.get("msg", "unknown field"), ".".join([*loc, first["ctx"]["field"]]), scope=request.scope)
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request body")
        return json_error(400, f"{param}: {msg}" if param else msg, param, scope=request.scope)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return json_error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None), scope=request.scope)

    @app.exception_handler(Exception)
    async def _other(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return json_error(500, f"internal error ({type(exc).__name__}); see the server's log", scope=request.scope)
