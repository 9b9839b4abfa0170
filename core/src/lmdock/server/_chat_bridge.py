"""The Responses and Messages APIs ride the chat path: each translates its request into a chat
request, runs it through ``/v1/chat/completions``' own code (the same template rendering, sampling
defaults, admission, abort on disconnect and streaming; there is no second generation loop) and
translates the chat completion, or its stream of chunks, back into its own shape.

Here is what both share: the call into chat (and its rendered prompt, for counting tokens), an error
from chat renamed into the caller's field names, and server-sent events named by their ``type``
(``event: message_start`` / ``data: {...}``), as both APIs send them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from lmdock.server import serving_chat
from lmdock.server._advisory import Ignored, reasoning_knobs
from lmdock.server._errors import APIError
from lmdock.server._protocol import ChatRequest, unknown_field
from lmdock.server._sse import DONE, sse, sse_response


def refuse_keys(item: dict[str, Any], known: frozenset[str], where: str) -> None:
    """A 400 naming the first key of ``item`` (a loosely typed part of a body: an input item, a
    content block) that is not in ``known`` and not null."""
    for key, value in item.items():
        if value is not None and key not in known:
            raise APIError(400, f"{where}: {unknown_field(key, known)}", param=f"{where}.{key}")


def string_field(item: dict[str, Any], key: str, where: str) -> str:
    """``item[key]``, which must be a string (a 400 naming ``where.key`` otherwise)."""
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def kind_field(item: dict[str, Any], key: str, where: str) -> str | None:
    """``item[key]`` where it names a kind (a block's ``type``, a message's ``role``): a string or
    absent; any other JSON value is a 400 naming ``where.key`` (it would otherwise be looked up in a
    table of kinds, where a list or an object is no key at all)."""
    value = item.get(key)
    if value is not None and not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string, not {_json_kind(value)}", param=f"{where}.{key}")
    return value


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number"}.get(type(value), "a value")


def chat_request(chat: dict[str, Any]) -> ChatRequest:
    """``chat`` as the chat route's body; what it refuses is a 400 naming the field."""
    try:
        return ChatRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None


class ThinkingKnob:
    """What a request asks of the model's thinking, set on the template's knob once the model is known
    (:func:`lmdock.server._advisory.reasoning_knobs`); what the model has no knob for is named in ``ignored``.

    ``effort``: a grade (``output_config.effort``, ``reasoning.effort``) under the request's name for it
    (``field``); ``on``: thinking asked on or off (``thinking.type``), None for the model's default;
    ``budget``: the most tokens the thinking may take (``thinking.budget_tokens``), held by the step loop."""

    OFF = ("none", "minimal")

    def __init__(self, ignored: Ignored, field: str = "", effort: str | None = None, on: bool | None = None,
                 budget: int | None = None) -> None:
        self.ignored, self.field, self.effort, self.on, self.budget = ignored, field, effort, on, budget

    def __call__(self, sm: Any, body: ChatRequest) -> None:
        template = body.chat_template or sm.chat_template or getattr(sm.llm.tokenizer, "chat_template", None)
        knobs = reasoning_knobs(template if isinstance(template, str) else None)
        kwargs = dict(body.chat_template_kwargs or {})
        if self.on is True and not sm.llm.model_config.reasoning_parser:
            self.ignored.add("thinking (the model does not think: it has no reasoning parser)")
        elif self.on is not None:
            kwargs["enable_thinking"] = self.on
        if self.effort is not None:
            self._effort(knobs, kwargs)
        body.chat_template_kwargs = kwargs or None

    def _effort(self, knobs: frozenset[str], kwargs: dict[str, Any]) -> None:
        graded = "reasoning_effort" in knobs
        if graded:
            kwargs["reasoning_effort"] = self.effort
        if "enable_thinking" in knobs and self.field.startswith("reasoning"):  # Responses' none/minimal: off
            kwargs["enable_thinking"] = self.effort not in self.OFF
            if not graded and self.effort not in self.OFF:
                self.ignored.add(f"{self.field}={self.effort} (the template's knob is enable_thinking: on, ungraded)")
        elif not graded:
            self.ignored.add(f"{self.field} (the chat template has no reasoning_effort)")


async def start_chat(chat: dict[str, Any], request: Request, names: dict[str, str], stream: bool,
                     thinking: ThinkingKnob | None = None) -> serving_chat.ChatRun:
    """``chat`` admitted, rendered and submitted on the chat path (``stream``: its chunks will be
    read, the last one with ``usage``); an error names the caller's fields (``names``: chat's to the
    caller's, see :func:`renamed`); ``thinking`` sets the template's reasoning knob.  A ``max_tokens``
    past the context is cut to what it leaves (agent clients send one whatever the model's context)."""
    if stream:
        chat = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    budget = thinking.budget if thinking is not None else None
    try:
        run = await serving_chat.start_chat(chat_request(chat), request, thinking, clamp=True,  # agents send any max_tokens
                                            thinking_budget=budget)
    except APIError as exc:
        raise renamed(exc, names) from None
    if budget is not None and not run.budget_held and thinking is not None:
        thinking.ignored.add("thinking.budget_tokens (not held: the engine samples outside lmdock's step loop, "
                             "or the prompt opens no thinking span)")
    return run


async def prompt_tokens(chat: dict[str, Any], request: Request, names: dict[str, str], thinking: ThinkingKnob | None = None) -> int:
    """How many tokens ``chat``'s prompt takes, rendered as :func:`start_chat` renders it."""
    try:
        sm, call = await serving_chat.render(chat_request(chat), request, thinking)
    except APIError as exc:
        raise renamed(exc, names) from None
    if call.images:  # as the model's processor expands their placeholders (slow: off the event loop)
        return len((await asyncio.to_thread(call.request)).prompt_token_ids)
    return len(sm.llm.tokenizer.encode(call.prompt, add_special_tokens=False))


def renamed(exc: APIError, names: dict[str, str]) -> APIError:
    """An error from the chat path in the caller's field names (``max_output_tokens`` for chat's
    ``max_tokens`` on Responses, ``stop_sequences`` for ``stop`` on Messages): ``names`` maps chat's
    to the caller's."""
    if exc.param is None:
        return exc
    head, _, rest = exc.param.partition(".")
    if head not in names:
        return exc
    param = names[head] + (f".{rest}" if rest else "")
    # a message that starts with the field ("max_tokens=600: ...", "stop: ...") names it; other text stays
    message, after = exc.message, exc.message[len(exc.param):]
    if message.startswith(exc.param) and after[:1] in (":", "="):
        message = param + after
    return APIError(exc.status, message, param=param, code=exc.code, headers=exc.headers)


def typed_sse(request: Request, run: serving_chat.ChatRun, events: AsyncIterator[dict[str, Any]],
              error_event: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> StreamingResponse:
    """``events`` (each a dict whose first key is ``type``) as server-sent events named by their type,
    as both APIs send them and Anthropic's client requires.  The chat route's SSE response carries
    them (its abort on disconnect, its release of the admission); its ``data: {...}`` lines get their
    ``event:`` line here, its ``[DONE]`` is dropped (neither API sends one), and an error body in
    OpenAI's dialect (``{"error": {...}}``, for a failure after the start) becomes ``error_event(error)``
    (Responses' own error event; on Anthropic's routes the error is already its ``error`` event)."""
    response = sse_response(request, events, run.admission, run.retry)
    response.body_iterator = _named(response.body_iterator, error_event)
    return response


async def _named(lines: AsyncIterator[Any], error_event: Callable[[dict[str, Any]], dict[str, Any]] | None) -> AsyncIterator[str]:
    start = len('data: {"type":"')
    try:
        async for line in lines:
            if line == DONE:
                continue
            if line.startswith('data: {"type":"'):  # sse() writes the dict's first key first, compactly
                kind = line[start:line.index('"', start)]
                yield f"event: {kind}\n{line}"
            elif error_event is not None:
                event = error_event(json.loads(line.removeprefix("data: "))["error"])
                yield f"event: {event['type']}\n{sse(event)}"
            else:
                yield line
    finally:
        await lines.aclose()  # type: ignore[attr-defined]  # its own finally aborts the engine request
