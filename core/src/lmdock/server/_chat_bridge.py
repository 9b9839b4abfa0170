"""The Responses and Messages APIs ride the chat path: each translates its request into a chat
request, runs it through ``/v1/chat/completions``' own code (the same template rendering, sampling
defaults, admission, abort on disconnect and streaming; there is no second generation loop) and
translates the chat completion, or its stream of chunks, back into its own shape.

Here is what both share: request bodies that refuse unknown fields, the call into chat, an error
from chat renamed into the caller's field names, and server-sent events named by their ``type``
(``event: message_start`` / ``data: {...}``), as both APIs send them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from lmdock.server import serving_chat
from lmdock.server._errors import APIError
from lmdock.server._protocol import ChatRequest, unknown_field


class StrictBody(BaseModel):
    """A request body (or part of one) that refuses a field it does not know, naming it and the
    closest known one, as ``_protocol``'s bodies do; a field sent as ``null`` asks for nothing."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if value is not None and key not in cls.model_fields:
                    raise PydanticCustomError("unknown_field", "{message}", {"field": key, "message": unknown_field(key, cls.model_fields)})
        return data


def refuse_keys(item: dict[str, Any], known: frozenset[str], where: str) -> None:
    """A 400 naming the first key of ``item`` (a loosely typed part of a body: an input item, a
    content block) that is not in ``known`` and not null."""
    for key, value in item.items():
        if value is not None and key not in known:
            raise APIError(400, f"{where}: {unknown_field(key, known)}", param=f"{where}.{key}")


def chat_tools_supported() -> bool:
    """Whether the chat path takes ``tools`` (it did not before tool calling was built)."""
    return "tools" in ChatRequest.model_fields


def chat_request(chat: dict[str, Any]) -> ChatRequest:
    """``chat`` as the chat route's body; what it refuses is a 400 naming the field."""
    try:
        return ChatRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None


async def chat_whole(chat: dict[str, Any], request: Request, names: dict[str, str]) -> dict[str, Any]:
    """The chat completion (OpenAI's ``chat.completion`` object) for ``chat``, not streamed; an
    error names the caller's fields (``names``: chat's to the caller's, see :func:`renamed`)."""
    try:
        response = await serving_chat.chat(chat_request({**chat, "stream": False}), request)
    except APIError as exc:
        raise renamed(exc, names) from None
    return json.loads(bytes(response.body))  # type: ignore[no-any-return]


async def chat_stream(chat: dict[str, Any], request: Request, names: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
    """The chat completion's chunks (OpenAI's ``chat.completion.chunk`` objects, the last one with
    ``usage``; an error after the start as ``{"error": {...}}``).  The chat route has admitted and
    submitted the request before this returns, so a bad request is a 400 here, before any event."""
    try:
        body = chat_request({**chat, "stream": True, "stream_options": {"include_usage": True}})
        response = await serving_chat.chat(body, request)
    except APIError as exc:
        raise renamed(exc, names) from None
    return _chunks(response.body_iterator)  # type: ignore[attr-defined]


async def _chunks(events: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    try:
        async for event in events:
            data = event.removeprefix("data: ").strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # its own finally aborts the engine request


def renamed(exc: APIError, names: dict[str, str]) -> APIError:
    """An error from the chat path in the caller's field names (``max_tokens`` for Messages'
    ``max_tokens``, ``max_output_tokens`` for Responses'): ``names`` maps chat's to the caller's."""
    if exc.param is None:
        return exc
    head, _, rest = exc.param.partition(".")
    if head not in names:
        return exc
    param = names[head] + (f".{rest}" if rest else "")
    message = exc.message.replace(exc.param, param, 1) if exc.param in exc.message else exc.message.replace(head, names[head], 1)
    return APIError(exc.status, message, param=param, code=exc.code, headers=exc.headers)


def typed_sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """``events`` as server-sent events named by their ``type`` (both APIs' clients dispatch on it)."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
                yield f"event: {event['type']}\ndata: {data}\n\n"
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
