"""``POST /v1/responses`` (OpenAI's Responses API) on the chat path, with ``GET`` and ``DELETE
/v1/responses/{id}`` over the server's bounded store of recent responses.

A request becomes a chat request (``_responses_items``): ``instructions`` a system message, then the
conversation ``previous_response_id`` ends (from the store), then ``input``.  The chat completion,
or its chunks, become output items and OpenAI's streamed events (``_responses_output``), between
``response.created`` / ``response.in_progress`` and ``response.completed``, or
``response.incomplete`` when ``max_output_tokens`` cut it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from lmdock.server._advisory import Ignored
from lmdock.server._chat_bridge import ThinkingKnob, start_chat, typed_sse
from lmdock.server._errors import APIError
from lmdock.server._protocol import StrictBody
from lmdock.server._response_store import ResponseStore, Stored
from lmdock.server._responses_items import (
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    custom_names,
    input_messages,
    namespaced,
)
from lmdock.server._responses_output import EventSequence, Outputs, assistant, new_id
from lmdock.server._state import state_of

router = APIRouter()

#: Chat's field names in errors from the chat path, as this API calls them.
NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
         "response_format": "text.format"}


class TextConfig(StrictBody):
    format: dict[str, Any] | None = None
    # OpenAI's default, which is what a model does unasked; low and high would need a knob the served models lack
    verbosity: Literal["medium"] | None = None


class Reasoning(StrictBody):
    """``effort`` goes to the template's reasoning knob (:class:`ThinkingKnob`).  ``summary`` asks
    for the reasoning item's ``summary``, which is the reasoning text itself (lmdock has no
    summarizer); ``none`` for none."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    generate_summary: Literal["auto", "concise", "detailed", "none"] | None = None  # summary's older name


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
    reasoning: Reasoning | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop turns silently: refused
    include: list[str] | None = None
    # advisory (lmdock.server._advisory): a cache routing key, a tier, facts about the client for a provider's logs
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    client_metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _honourable(self) -> ResponsesRequest:
        """Settings the served models have no knob for are refused, each naming what there is instead."""
        other = [x for x in self.include or () if x != "reasoning.encrypted_content"]
        if other:
            raise APIError(400, f"include {other}: lmdock serve has no such output data to include (logprobs, "
                                "sources, images); it includes reasoning.encrypted_content only", param="include")
        self._check_metadata()
        return self

    def _check_metadata(self) -> None:
        """OpenAI's bounds on ``metadata`` (it comes back in the response and the store keeps it; the
        chat path never sees it, and ``StrictBody`` checks that it is valid text)."""
        metadata = self.metadata or {}
        if len(metadata) > 16:
            raise APIError(400, f"metadata has {len(metadata)} keys; at most 16", param="metadata")
        for key, value in metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise APIError(400, f"metadata.{key}: keys are at most 64 characters, values 512", param=f"metadata.{key}")

    def chat(self, history: tuple[dict[str, Any], ...], ignored: Ignored) -> dict[str, Any]:
        """This request as a chat request over ``history`` (the conversation so far, this input
        included); the advisory fields it carries go to ``ignored``."""
        for name in ("prompt_cache_key", "client_metadata", "service_tier"):
            if getattr(self, name) is not None:
                ignored.add(name)
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        chat: dict[str, Any] = {"model": self.model, "messages": [*system, *history], "max_tokens": self.max_output_tokens,
                                "temperature": self.temperature, "top_p": self.top_p, "user": self.user}
        if self.tools or self.tool_choice is not None or self.parallel_tool_calls is not None:
            tools = chat_tools(self.tools or [], ignored) or None
            choice = None if self.tool_choice is None else chat_tool_choice(self.tool_choice)
            if tools is None and choice == "auto":
                choice = None  # its only tools were hosted ones, dropped: nothing is left to choose from
            chat.update(tools=tools, parallel_tool_calls=self.parallel_tool_calls, tool_choice=choice)
        if self.text is not None and self.text.format is not None:
            chat["response_format"] = chat_response_format(self.text.format)
        return chat

    def thinking_knob(self, ignored: Ignored) -> ThinkingKnob | None:
        effort = self.reasoning.effort if self.reasoning is not None else None
        return None if effort is None else ThinkingKnob(ignored, "reasoning.effort", effort)

    def outputs(self) -> Outputs:
        """How this response's items look: its custom and namespaced tools' calls, and what reasoning items carry."""
        r = self.reasoning
        return Outputs(custom_names(self.tools), summary=r is not None and (r.summary or r.generate_summary or "none") != "none",
                       token="reasoning.encrypted_content" in (self.include or ()), namespaced=namespaced(self.tools))


@router.post("/v1/responses")
async def create(body: ResponsesRequest, request: Request) -> Response:
    store = _store(request)
    previous = _previous(store, body.previous_response_id)
    new = input_messages(body.input)
    history = (*(previous.history() if previous else ()), *new)
    if not history:
        raise APIError(400, "input is empty: give a string or at least one item", param="input")
    ignored = Ignored()
    chat = body.chat(history, ignored)
    run = await start_chat(chat, request, NAMES, body.stream, body.thinking_knob(ignored))
    ignored.loosened(run.plan, chat.get("response_format"), "text.format")
    turn = _Turn(body, run.model, previous.messages if previous else (), new, store)
    if body.stream:
        seq = EventSequence(body.outputs())
        return ignored.apply(typed_sse(request, run, turn.events(run.chunks(), seq), seq.error), "/v1/responses")
    return ignored.apply(JSONResponse(turn.whole(ignored.check(run.plan, await run.whole()))), "/v1/responses")


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request) -> Response:
    return _raw(_stored(request, response_id).body)


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request) -> dict[str, Any]:
    _stored(request, response_id)
    _store(request).delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _store(request: Request) -> ResponseStore:
    """The app's response store, made on first use."""
    store = getattr(request.app.state, "responses", None)
    if store is None:
        settings = state_of(request).settings
        store = request.app.state.responses = ResponseStore(settings.response_store_max_items, settings.response_store_max_bytes)
    return store  # type: ignore[no-any-return]


def _stored(request: Request, response_id: str) -> Stored:
    found = _store(request).get(response_id)
    if found is None:
        raise APIError(404, f"response {response_id!r} is not stored here (sent with store: false, or one of the "
                            "server's oldest, past the store's bound, or before a restart)", param="response_id")
    return found


def _raw(body: bytes) -> Response:
    """A stored response as it was sent (its JSON bytes, not parsed again)."""
    return Response(body, media_type="application/json")


def _previous(store: ResponseStore, response_id: str | None) -> Stored | None:
    if response_id is None:
        return None
    found = store.get(response_id)
    if found is None:
        raise APIError(400, f"previous response {response_id!r} is not stored here (sent with store: false, or one of "
                            "the server's oldest, past the store's bound, or before a restart): send the conversation "
                            "in input instead", param="previous_response_id")
    return found


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    p, c = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # the prefix cache's
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


class _Turn:
    """One response: its id, its object (whole or as events), and its place in the store."""

    def __init__(self, body: ResponsesRequest, model: str, previous: tuple[bytes, ...], new: list[dict[str, Any]],
                 store: ResponseStore) -> None:
        """``previous``: the stored conversation this one continues (shared, not copied); ``new``: this input's messages."""
        self.body, self.model, self.previous, self.new, self.store = body, model, previous, new, store
        self.id = new_id("resp")
        self.created = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id, "store": b.store,
                "reasoning": b.reasoning.model_dump(exclude_none=True) if b.reasoning else None,
                "temperature": b.temperature, "top_p": b.top_p,
                "text": {"format": (b.text.format if b.text and b.text.format else {"type": "text"}), "verbosity": "medium"},
                "tool_choice": b.tool_choice if b.tool_choice is not None else "auto", "tools": b.tools or [],
                "truncation": "disabled", "usage": _usage(usage), "user": b.user, "metadata": b.metadata or {}}

    def finish(self, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None,
               message: dict[str, Any]) -> dict[str, Any]:
        """The finished response, kept with its conversation (chat's assistant ``message`` last)
        unless the request said ``store: false``."""
        final = self.response(status, output, usage)
        if self.body.store:
            self.store.put(self.id, Stored.of(final, self.previous, [*self.new, assistant(message)]))
        return final

    def whole(self, completion: dict[str, Any]) -> dict[str, Any]:
        choice = completion["choices"][0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self.finish(status, self.body.outputs().items(choice["message"], status), completion.get("usage"), choice["message"])

    async def events(self, chunks: AsyncIterator[dict[str, Any]], seq: EventSequence) -> AsyncIterator[dict[str, Any]]:
        """The chat chunks as the Responses API's event sequence (numbered by ``seq``)."""
        yield seq.event("response.created", response=self.response("in_progress", [], None))
        yield seq.event("response.in_progress", response=self.response("in_progress", [], None))
        async for chunk in chunks:
            for event in seq.chunk(chunk):
                yield event
        for event in seq.end():
            yield event
        final = self.finish(seq.status, seq.output, seq.usage, seq.message)
        yield seq.event(f"response.{seq.status}", response=final)
