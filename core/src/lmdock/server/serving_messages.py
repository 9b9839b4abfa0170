"""``POST /v1/messages`` (Anthropic's Messages API) on the chat path, and ``POST
/v1/messages/count_tokens``; errors on these routes in Anthropic's body,
``{"type": "error", "error": {"type", "message"}}``.

A request becomes a chat request (``_messages_blocks``); the chat completion becomes content blocks
(``thinking`` from a reasoning model, ``text``, ``tool_use`` with its ``input`` parsed) and a
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence`` with the ``stop_sequence`` matched,
``tool_use``); streamed, its chunks become Anthropic's events: ``message_start``, ``ping``, per block
``content_block_start``, ``content_block_delta`` (``thinking_delta`` / ``text_delta`` /
``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (stop reason, usage) and
``message_stop``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from lmdock.server._advisory import Ignored
from lmdock.server._chat_bridge import ThinkingKnob, prompt_tokens, refuse_keys, start_chat, typed_sse
from lmdock.server._errors import APIError
from lmdock.server._messages_blocks import chat_messages, chat_tool_choice, chat_tools, has_cache_control
from lmdock.server._protocol import StrictBody

#: Chat's field names in errors from the chat path, as this API calls them.
NAMES = {"stop": "stop_sequences"}


router = APIRouter()  # its errors answer in Anthropic's body: _errors.body_for chooses it by path


class Metadata(StrictBody):
    user_id: str | None = None  # advisory: an end user's id, for a provider's abuse reports


class Thinking(StrictBody):
    """``adaptive``: the model's default; ``enabled``: thinking on (``enable_thinking: true``), on a
    model with a reasoning parser; ``disabled``: off.  ``budget_tokens`` is advisory (not held)."""

    type: Literal["adaptive", "enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _budget_when_on(self) -> Thinking:
        if self.type == "disabled" and self.budget_tokens is not None:
            raise APIError(400, "thinking.budget_tokens: disabled thinking has no budget", param="thinking.budget_tokens")
        return self


class OutputConfig(StrictBody):
    effort: Literal["low", "medium", "high", "max"] | None = None
    format: dict[str, Any] | None = None

    def response_format(self) -> dict[str, Any] | None:
        """``format`` (``{type: json_schema, schema}``) as chat's ``response_format``."""
        if self.format is None:
            return None
        if self.format.get("type") != "json_schema" or not isinstance(self.format.get("schema"), dict):
            raise APIError(400, "output_config.format: lmdock takes {type: json_schema, schema: {...}}", param="output_config.format")
        refuse_keys(self.format, frozenset({"type", "schema"}), "output_config.format")
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": self.format["schema"]}}


class _Conversation(StrictBody):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None  # advisory: context editing is the hosted API's

    def chat(self, ignored: Ignored) -> dict[str, Any]:
        """The conversation, tools and tool choice as a chat request's fields; the advisory fields it
        carries go to ``ignored``."""
        chat: dict[str, Any] = {"model": self.model, "messages": chat_messages(self.system, self.messages)}
        if self.context_management is not None:
            ignored.add("context_management")
        if self.tool_choice is not None and self.tool_choice.get("type") != "none" and not self.tools:
            raise APIError(400, f"tool_choice {self.tool_choice.get('type')!r} needs tools", param="tool_choice")
        if self.tools or self.tool_choice is not None:
            choice, parallel = chat_tool_choice(self.tool_choice) if self.tool_choice is not None else (None, None)
            tools = chat_tools(self.tools or [], ignored) or None
            if tools is None and choice == "auto":
                choice = None  # its only tools were hosted ones, dropped: nothing is left to choose from
            chat.update(tools=tools, tool_choice=choice, parallel_tool_calls=parallel)
        if has_cache_control(self.system, self.messages, self.tools):
            ignored.add("cache_control")
        if self.output_config is not None and self.output_config.format is not None:
            chat["response_format"] = self.output_config.response_format()
        return chat

    def thinking_knob(self, ignored: Ignored) -> ThinkingKnob:
        """What this request asks of the model's thinking, set on its template's knob."""
        kind = self.thinking.type if self.thinking is not None else "adaptive"
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        effort = self.output_config.effort if self.output_config is not None else None
        return ThinkingKnob(ignored, "output_config.effort", "high" if effort == "max" else effort,
                            {"adaptive": None, "enabled": True, "disabled": False}[kind], budget)


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)  # Anthropic's range
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=1)
    metadata: Metadata | None = None
    service_tier: str | None = None  # advisory: one tier

    def chat(self, ignored: Ignored) -> dict[str, Any]:
        if self.metadata is not None and self.metadata.user_id is not None:
            ignored.add("metadata.user_id")
        if self.service_tier is not None:
            ignored.add("service_tier")
        return {**super().chat(ignored), "max_tokens": self.max_tokens, "stop": self.stop_sequences,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


class CountTokensRequest(_Conversation):
    pass


@router.post("/v1/messages")
async def create(body: MessagesRequest, request: Request) -> Response:
    ignored = _beta(request)
    chat = body.chat(ignored)
    run = await start_chat(chat, request, NAMES, body.stream, body.thinking_knob(ignored))
    ignored.loosened(run.plan, chat.get("response_format"), "output_config.format")
    reply = _Reply(body, run.model, len(run.prompt_ids), run.cached_tokens)
    if body.stream:
        return ignored.apply(typed_sse(request, run, reply.events(run.chunks())), "/v1/messages")
    return ignored.apply(JSONResponse(reply.whole(ignored.check(run.plan, await run.whole()))), "/v1/messages")


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The tokens the conversation's prompt takes, rendered as ``/v1/messages`` renders it."""
    ignored = _beta(request)
    tokens = await prompt_tokens(body.chat(ignored), request, NAMES, body.thinking_knob(ignored))
    return ignored.apply(JSONResponse({"input_tokens": tokens}), "/v1/messages/count_tokens")


def _beta(request: Request) -> Ignored:
    """The advisory beta flags: Anthropic's ``anthropic-beta`` header and ``?beta=true``."""
    ignored = Ignored()
    if request.headers.get("anthropic-beta"):
        ignored.add(f"anthropic-beta ({request.headers['anthropic-beta']})")
    if "beta" in request.query_params:
        ignored.add("beta (query)")
    return ignored


def _stop(choice: dict[str, Any], sequences: list[str] | None) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` from chat's ``finish_reason`` and vLLM's ``stop_reason``
    (the stop string or token that ended the text)."""
    finish, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and matched in (sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens``
    those the prefix cache gave (their sum is the prompt); nothing is written to a cache on request."""
    chat_usage = chat_usage or {}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage.get("prompt_tokens", 0) - cached, "output_tokens": chat_usage.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as ``tool_use.input``; text that is no JSON object stays readable."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class _Reply:
    """One message: its id and its body, whole or as events."""

    def __init__(self, body: MessagesRequest, model: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.body, self.model, self.prompt_tokens, self.cached_tokens = body, model, prompt_tokens, cached_tokens
        self.id = f"msg_{uuid.uuid4().hex}"

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None], usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def whole(self, completion: dict[str, Any]) -> dict[str, Any]:
        choice = completion["choices"][0]
        message = choice["message"]
        content = [{"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}] if message.get("reasoning_content") else []
        content += [{"type": "text", "text": message["content"]}] if message.get("content") else []
        content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": _input(c["function"]["arguments"])}
                    for c in message.get("tool_calls") or ()]
        return self.message(content, _stop(choice, self.body.stop_sequences), _usage(completion.get("usage")))

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """The chat chunks as Anthropic's event sequence."""
        start = _usage({"prompt_tokens": self.prompt_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}})
        yield {"type": "message_start", "message": self.message([], (None, None), start)}
        yield {"type": "ping"}
        blocks = _Blocks()
        stop: tuple[str, str | None] = ("end_turn", None)
        usage = None
        async for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", ()):
                for event in blocks.delta(choice.get("delta", {})):
                    yield event
                if choice.get("finish_reason"):
                    stop = _stop(choice, self.body.stop_sequences)
        for event in blocks.close():
            yield event
        yield {"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]}, "usage": _usage(usage)}
        yield {"type": "message_stop"}


class _Blocks:
    """The streamed content blocks: the one open now (thinking, text, or a call by chat's index) and its index."""

    def __init__(self) -> None:
        self.index = -1
        self.open: tuple[str, Any] | None = None  # ("text", None) or ("tool_use", chat's call index)

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            if self.open != ("thinking", None):
                out += self._start(("thinking", None), {"type": "thinking", "thinking": "", "signature": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}})
        if delta.get("content"):
            if self.open != ("text", None):
                out += self._start(("text", None), {"type": "text", "text": ""})
            out.append({"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": delta["content"]}})
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if self.open != ("tool_use", call.get("index")):
                out += self._start(("tool_use", call.get("index")), {"type": "tool_use", "id": call.get("id") or "",
                                                                     "name": fn.get("name") or "", "input": {}})
            if fn.get("arguments"):
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        return out

    def _start(self, key: tuple[str, Any], block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.index += 1
        self.open = key
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]
