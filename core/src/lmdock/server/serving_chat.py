"""``POST /v1/chat/completions``: messages through the model's (or the request's) chat template, ``n``
choices, streamed or not, with logprobs, JSON-schema response formats, tool calls and reasoning
content (``lmdock.tools``: the model's parsers read each choice; a forced ``tool_choice`` constrains it).

Other front ends (``/v1/responses``, ``/v1/messages``) reuse the chat path through :func:`start_chat`:
it admits a :class:`ChatRequest`, runs it as the core's chat call (``lmdock._llm.chat.ChatCall``: plan,
render, constrain, request, the same pipeline as ``LLM.chat``) and returns a :class:`ChatRun`, whose
``await run.whole()`` is OpenAI's ``chat.completion`` dict and ``run.chunks()`` its
``chat.completion.chunk`` dicts (a bad request is an :class:`APIError` from :func:`start_chat`,
before anything is sent).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmdock._llm.chat import ChatCall
from lmdock._llm.logprobs import chat_logprobs
from lmdock._llm.outputs import CompletionOutput, RequestOutput
from lmdock._plugin.errors import LmdockError
from lmdock.server._admission import Admission
from lmdock.server._advisory import Ignored
from lmdock.server._disconnects import unless_disconnected
from lmdock.server._engine_streams import choice_deltas, collect, offloaded, submit_admitted
from lmdock.server._errors import APIError, as_api_error
from lmdock.server._protocol import ChatRequest, usage
from lmdock.server._sse import sse_response
from lmdock.server._state import ServedModel, ServerState, state_of
from lmdock.server._templates import check_request_template, render_bounded

router = APIRouter()

#: adjusts a chat body to the model that serves it, before rendering (see :func:`render`)
Prepare = Callable[[ServedModel, ChatRequest], None]


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request) -> Response:
    run = await start_chat(body, request)
    ignored = Ignored()  # what the grammar could not hold of the tools' and response format's schemas
    ignored.loosened(run.plan, body.response_format.model_dump() if body.response_format else None, "response_format")
    if body.stream:
        return ignored.apply(sse_response(request, run.chunks(), run.admission, run.retry), "/v1/chat/completions")
    return ignored.apply(JSONResponse(ignored.check(run.plan, await run.whole())), "/v1/chat/completions")


async def start_chat(body: ChatRequest, request: Request, prepare: Prepare | None = None, clamp: bool | None = None,
                     thinking_budget: int | None = None) -> ChatRun:
    """Admit, render and submit a chat request: the :class:`ChatRun` to read it from.  Raises
    :class:`APIError` (400 naming the field, 404, 429...) before anything is sent.  ``prepare``: see
    :func:`render`; ``clamp``: a ``max_tokens`` past the context is cut to it (None: as ``[server]
    max_tokens_past_context`` says); ``thinking_budget``: the thinking held to that many tokens where
    the engine samples in lmdock's step loop and the prompt opens the thinking (``run.budget_held``)."""
    st = state_of(request)
    sm, call = await render(body, request, prepare)
    try:
        params = call.constrain(st.sampling_params(sm, body.overrides(), body), thinking_budget)
    except LmdockError as exc:
        raise _tool_error(exc, st.retry_after, sm) from None
    admission, streams, firsts = await submit_admitted(request, st, sm, [offloaded(functools.partial(call.request, params, stream=True), bool(call.images))], params,
                                                       max_tokens_field=body.max_tokens_field(), clamp=clamp)
    run = ChatRun(body, request, sm, call.plan, admission, streams, firsts, st.retry_after, params.n)
    run.budget_held = call.budget_held
    if call.lora_request is not None:
        run.model = body.model  # the response names the adapter's model, as vLLM's does
    return run


async def render(body: ChatRequest, request: Request, prepare: Prepare | None = None) -> tuple[ServedModel, ChatCall]:
    """The model and the chat call a request renders to (its ``prompt`` rendered): what
    :func:`start_chat` submits, and what ``/v1/messages/count_tokens`` counts.  ``prepare(sm, body)``,
    once the model is known, adjusts the body to it (the agent routes set the template's reasoning knob there)."""
    st = state_of(request)
    sm = await st.model(body.model, request, body.keep_alive)
    if prepare is not None:
        prepare(sm, body)
    call = _call(st, sm, body)
    await _render(st, sm, body, call)
    return sm, call


def _call(st: ServerState, sm: ServedModel, body: ChatRequest) -> ChatCall:
    """The request as a chat call on ``sm``'s LLM, its plan made (a tool field it cannot honour: 400)."""
    try:
        return ChatCall(sm.llm, body.messages, chat_template=body.chat_template or sm.chat_template,
                        add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
                        chat_template_kwargs=body.chat_template_kwargs, tools=body.tools, tool_choice=body.tool_choice,
                        parallel_tool_calls=body.parallel_tool_calls,
                        lora_request=st.adapter(body.model))  # NAME:ADAPTER runs under the adapter on NAME's engine
    except LmdockError as exc:
        raise _tool_error(exc, st.retry_after, sm) from None


def _tool_error(exc: LmdockError, retry: int, sm: ServedModel) -> APIError:
    """A tool-field error as a 400 naming the field its message starts with."""
    err = as_api_error(exc, retry, sm.hide)
    head = str(exc).split(":", 1)[0].split("[", 1)[0].split(" ", 1)[0]
    if err.param is None and head in ChatRequest.model_fields:
        err.param = head
    return err


async def _render(st: ServerState, sm: ServedModel, body: ChatRequest, call: ChatCall) -> str:
    """The prompt, rendered off the event loop within the server's time and size limits."""
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message needs add_generation_prompt: false", param="continue_final_message")
    check_request_template(body.chat_template, st.settings)
    try:
        return await render_bounded(call.render, st.settings)  # type: ignore[no-any-return]
    except LmdockError as exc:
        raise as_api_error(exc, st.retry_after, sm.hide) from None


def finish_reason(c: CompletionOutput, calls: list[Any]) -> str | None:
    """OpenAI's ``finish_reason``: ``"tool_calls"`` when a choice that stopped made calls (vLLM #14951)."""
    return "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason


class ChatRun:
    """A submitted chat request, read whole (:meth:`whole`) or streamed (:meth:`chunks`) in OpenAI's shapes.

    Either releases the admission when it ends, however it ends; leaving :meth:`chunks` early aborts
    the engine request."""

    def __init__(self, body: ChatRequest, request: Request, sm: ServedModel, plan: Any, admission: Admission,
                 streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput | None], retry: int, n: int) -> None:
        self.body, self.request, self.plan, self.admission, self.retry = body, request, plan, admission, retry
        self.streams, self.firsts = streams, firsts
        self.model, self.tok, self.n = sm.name, sm.llm.tokenizer, n  # the params' n: a config default counts too
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        # the rendered prompt's tokens: what the first token's text follows
        self.prompt_ids: list[int] = list(firsts[0].prompt_token_ids) if firsts and firsts[0] is not None else []
        #: of which the prefix cache gave (0 where the engine does not count them)
        self.cached_tokens: int = (firsts[0].num_cached_tokens or 0) if firsts and firsts[0] is not None else 0
        self.created = int(time.time())
        self.budget_held = False  # a thinking budget asked for is held (see start_chat)

    def logprobs(self, c: Any, start: int) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        before = [*self.prompt_ids, *c.token_ids[:start]]  # what the tokens' text follows
        return {"content": chat_logprobs(self.tok, list(c.token_ids[start:]), list((c.logprobs or [])[start:]),
                                         self.body.top_logprobs or 0, before)}

    async def whole(self) -> dict[str, Any]:
        """OpenAI's ``chat.completion`` object."""
        try:
            (out,) = await unless_disconnected(self.request, collect(self.streams, self.firsts))
        except BaseException as exc:
            raise as_api_error(exc, self.retry) from None
        finally:
            self.admission.release()
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [self._choice(c) for c in out.outputs], "usage": usage([out])}

    def _choice(self, c: CompletionOutput) -> dict[str, Any]:
        reading = self.plan.read(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": reading.content}
        if reading.reasoning is not None:
            message["reasoning_content"] = reading.reasoning
        if reading.tool_calls:
            message["tool_calls"] = [call.openai() for call in reading.tool_calls]
        return {"index": c.index, "message": message, "logprobs": self.logprobs(c, 0),
                "finish_reason": finish_reason(c, reading.tool_calls), "stop_reason": c.stop_reason}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": choices, **extra}

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """OpenAI's ``chat.completion.chunk`` objects: the role first, then each choice's reasoning,
        content and call deltas as they come, its finish reason last, and ``usage`` where asked for."""
        try:
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                               for i in range(self.n)])
            last: list[Any] = [None]
            reads = [self.plan.stream() for _ in range(self.n)]
            async for d in choice_deltas(self.streams, self.firsts, last):
                c = d.choice
                piece = reads[c.index].feed(c.text, final=c.finished)
                delta: dict[str, Any] = {}
                if piece.reasoning:
                    delta["reasoning_content"] = piece.reasoning
                if piece.content:
                    delta["content"] = piece.content
                if piece.calls:
                    delta["tool_calls"] = [call.openai() for call in piece.calls]
                choice = {"index": c.index, "delta": delta, "logprobs": self.logprobs(c, d.token_start), "finish_reason": None}
                if c.finished:  # vLLM's stop_reason too: the stop string or token that ended the text
                    choice.update(finish_reason=finish_reason(c, reads[c.index].tool_calls), stop_reason=c.stop_reason)
                yield self._chunk([choice])
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield self._chunk([], usage=usage(last))
        finally:
            self.admission.release()
