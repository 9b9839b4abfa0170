"""``POST /v1/responses`` (OpenAI's Responses API) on the chat path, with ``GET`` and ``DELETE
/v1/responses/{id}`` over the server's bounded store of recent responses.

A request becomes a chat request (``_responses_items``): ``instructions`` a system message, then the
conversation ``previous_response_id`` ends (from the store), then ``input``.  The chat completion
becomes output items, a ``message`` with ``output_text`` and one ``function_call`` per tool call;
streamed, its chunks become the typed events of OpenAI's sequence (``response.created``,
``response.in_progress``, then per item ``output_item.added`` ... ``output_item.done``, then
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from lmdock.server._chat_bridge import StrictBody, start_chat, typed_sse
from lmdock.server._errors import APIError
from lmdock.server._response_store import ResponseStore, Stored
from lmdock.server._responses_items import chat_response_format, chat_tool_choice, chat_tools, input_messages
from lmdock.server._state import state_of

router = APIRouter()

#: Chat's field names in errors from the chat path, as this API calls them.
NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
         "response_format": "text.format"}


class TextConfig(StrictBody):
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # refused unless null (see _honourable)


class ResponsesRequest(StrictBody):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None  # refused unless its settings are null (see _honourable)
    truncation: Literal["disabled"] | None = None  # "auto" would drop turns silently: refused
    include: list[str] | None = None
    prompt_cache_key: str | None = None  # a hint: lmdock's prefix cache needs no key
    service_tier: Literal["auto", "default"] | None = None

    @model_validator(mode="after")
    def _honourable(self) -> ResponsesRequest:
        """Settings the served models have no knob for are refused, each naming what there is instead."""
        if self.include:
            raise APIError(400, f"include {self.include}: lmdock serve has no extra output data to include "
                                "(logprobs, reasoning content, encrypted content); send none", param="include")
        for key, value in (self.reasoning or {}).items():
            if value is not None:
                raise APIError(400, f"reasoning.{key}: the served models take no reasoning settings (a model's reasoning "
                                    "parser is set per model in the config: [models.NAME] reasoning_parser)",
                               param=f"reasoning.{key}")
        if self.text is not None and self.text.verbosity is not None:
            raise APIError(400, "text.verbosity: the served models take no verbosity setting; ask in the instructions",
                           param="text.verbosity")
        return self

    def chat(self, history: tuple[dict[str, Any], ...]) -> dict[str, Any]:
        """This request as a chat request over ``history`` (the conversation so far, this input included)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        chat: dict[str, Any] = {"model": self.model, "messages": [*system, *history], "max_tokens": self.max_output_tokens,
                                "temperature": self.temperature, "top_p": self.top_p, "user": self.user}
        if self.tools or self.tool_choice is not None or self.parallel_tool_calls is not None:
            chat.update(tools=chat_tools(self.tools or []) or None, parallel_tool_calls=self.parallel_tool_calls,
                        tool_choice=None if self.tool_choice is None else chat_tool_choice(self.tool_choice))
        if self.text is not None and self.text.format is not None:
            chat["response_format"] = chat_response_format(self.text.format)
        return chat


@router.post("/v1/responses")
async def create(body: ResponsesRequest, request: Request) -> Response:
    st = state_of(request)
    name = st.model(body.model).name
    store = _store(request)
    history = (*_previous(store, body.previous_response_id), *input_messages(body.input))
    turn = _Turn(body, name, history, store)
    run = await start_chat(body.chat(history), request, NAMES, body.stream)
    if body.stream:
        seq = _Sequence()
        return typed_sse(request, run, turn.events(run.chunks(), seq), seq.error)
    return JSONResponse(turn.whole(await run.whole()))


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request) -> dict[str, Any]:
    return _stored(request, response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request) -> dict[str, Any]:
    _stored(request, response_id)
    _store(request).delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _store(request: Request) -> ResponseStore:
    """The app's response store, made on first use."""
    store = getattr(request.app.state, "responses", None)
    if store is None:
        store = request.app.state.responses = ResponseStore()
    return store  # type: ignore[no-any-return]


def _stored(request: Request, response_id: str) -> Stored:
    found = _store(request).get(response_id)
    if found is None:
        raise APIError(404, f"response {response_id!r} is not stored here (sent with store: false, or one of the "
                            "server's oldest, past the store's bound, or before a restart)", param="response_id")
    return found


def _previous(store: ResponseStore, response_id: str | None) -> tuple[dict[str, Any], ...]:
    if response_id is None:
        return ()
    found = store.get(response_id)
    if found is None:
        raise APIError(400, f"previous response {response_id!r} is not stored here (sent with store: false, or one of "
                            "the server's oldest, past the store's bound, or before a restart): send the conversation "
                            "in input instead", param="previous_response_id")
    return found.history


def _usage(chat_usage: dict[str, int] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    p, c = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def _assistant(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant's turn as a chat message, for the store."""
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


class _Turn:
    """One response: its id, its object (whole or as events), and its place in the store."""

    def __init__(self, body: ResponsesRequest, model: str, history: tuple[dict[str, Any], ...], store: ResponseStore) -> None:
        self.body, self.model, self.history, self.store = body, model, history, store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id, "reasoning": None, "store": b.store,
                "temperature": b.temperature, "top_p": b.top_p,
                "text": {"format": (b.text.format if b.text and b.text.format else {"type": "text"})},
                "tool_choice": b.tool_choice if b.tool_choice is not None else "auto", "tools": b.tools or [],
                "truncation": "disabled", "usage": _usage(usage), "user": b.user, "metadata": b.metadata or {}}

    def finish(self, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None, text: str,
               calls: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response, kept in the store unless the request said ``store: false``."""
        final = self.response(status, output, usage)
        if self.body.store:
            self.store.put(self.id, Stored(final, (*self.history, _assistant(text, calls))))
        return final

    def whole(self, completion: dict[str, Any]) -> dict[str, Any]:
        choice = completion["choices"][0]
        message = choice["message"]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        text, calls = message.get("content") or "", message.get("tool_calls") or []
        output = [_message_item(f"msg_{uuid.uuid4().hex}", text, status)] if text or not calls else []
        output += [_call_item(f"fc_{uuid.uuid4().hex}", c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
                   for c in calls]
        return self.finish(status, output, completion.get("usage"), text, calls)

    async def events(self, chunks: AsyncIterator[dict[str, Any]], seq: _Sequence) -> AsyncIterator[dict[str, Any]]:
        """The chat chunks as the Responses API's event sequence (numbered by ``seq``)."""
        yield seq.event("response.created", response=self.response("in_progress", [], None))
        yield seq.event("response.in_progress", response=self.response("in_progress", [], None))
        async for chunk in chunks:
            for event in seq.chunk(chunk):
                yield event
        for event in seq.end():
            yield event
        status = "incomplete" if seq.finish == "length" else "completed"
        final = self.finish(status, seq.output, seq.usage, seq.text, seq.calls)
        yield seq.event(f"response.{status}", response=final)


class _Sequence:
    """The streamed events' state: the sequence number, the item open now, the items done."""

    def __init__(self) -> None:
        self.number = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written: {"kind", "id", "index", "text", ...}
        self.text = ""  # all output text, and the calls, for the store
        self.calls: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.usage: dict[str, int] | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.number += 1
        return {"type": kind, "sequence_number": self.number - 1, **fields}

    def error(self, err: dict[str, Any]) -> dict[str, Any]:
        """A failure after the start (OpenAI's error body) as the ``error`` event."""
        return self.event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta", {})
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self.open is None or self.open["kind"] != "message":
            out = self.close("completed")
            out += self._start_message()
        self.open["text"] += text  # type: ignore[index]
        self.text += text
        out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=self.open["index"],  # type: ignore[index]
                              content_index=0, delta=text, logprobs=[]))
        return out

    def _start_message(self) -> list[dict[str, Any]]:
        self.open = {"kind": "message", "id": f"msg_{uuid.uuid4().hex}", "index": len(self.output), "text": ""}
        where = {"item_id": self.open["id"], "output_index": self.open["index"]}
        return [self.event("response.output_item.added", output_index=self.open["index"],
                           item=_message_item(self.open["id"], "", "in_progress")),
                self.event("response.content_part.added", **where, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        fn = call.get("function") or {}
        if self.open is None or self.open["kind"] != "function_call" or self.open["call_index"] != call.get("index"):
            out = self.close("completed")
            self.open = {"kind": "function_call", "id": f"fc_{uuid.uuid4().hex}", "index": len(self.output), "text": "",
                         "call_index": call.get("index"), "call_id": call.get("id") or "", "name": fn.get("name") or ""}
            out.append(self.event("response.output_item.added", output_index=self.open["index"],
                                  item=_call_item(self.open["id"], self.open["call_id"], self.open["name"], "", "in_progress")))
        if fn.get("arguments"):
            self.open["text"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=self.open["index"], delta=fn["arguments"]))
        return out

    def end(self) -> list[dict[str, Any]]:
        """The events that finish the last item (an empty message when nothing at all was written)."""
        out = self._start_message() if self.open is None and not self.output else []
        return out + self.close("incomplete" if self.finish == "length" else "completed")

    def close(self, status: str) -> list[dict[str, Any]]:
        """The events that finish the open item, if any."""
        item = self.open
        if item is None:
            return []
        self.open = None
        where = {"item_id": item["id"], "output_index": item["index"]}
        if item["kind"] == "message":
            done = _message_item(item["id"], item["text"], status)
            part = done["content"][0]
            out = [self.event("response.output_text.done", **where, content_index=0, text=item["text"], logprobs=[]),
                   self.event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], item["text"], status)
            self.calls.append({"id": item["call_id"], "type": "function",
                               "function": {"name": item["name"], "arguments": item["text"]}})
            out = [self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=item["text"])]
        self.output.append(done)
        return [*out, self.event("response.output_item.done", output_index=item["index"], item=done)]
