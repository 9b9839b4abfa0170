"""``POST /v1/chat/completions``: messages through the model's (or the request's) chat template, ``n``
choices, streamed or not, with logprobs and JSON-schema response formats."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmdock._errors import LmdockError
from lmdock._logprobs import chat_logprobs
from lmdock._outputs import RequestOutput
from lmdock._params import ServerConfig
from lmdock.server._errors import APIError, as_api_error
from lmdock.server._protocol import ChatRequest, usage
from lmdock.server._state import ServedModel, state_of
from lmdock.server._streaming import (
    choice_deltas,
    collect,
    sse_response,
    submit_admitted,
    unless_disconnected,
)
from lmdock.server._templates import check_request_template, render_bounded

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request) -> Response:
    st = state_of(request)
    retry = st.retry_after
    sm = await st.model(body.model, request, body.keep_alive)
    params = st.sampling_params(sm, body.overrides(), body)
    prompt = await _render(st.settings, sm, body, retry)
    lora = st.adapter(body.model)
    admission, streams, firsts = await submit_admitted(request, st, sm, [prompt], params, add_special_tokens=False,
                                                       max_tokens_field=body.max_tokens_field(), lora_request=lora)
    reply = _Reply(body, body.model if lora else sm.name, sm.llm.tokenizer, params.n)
    reply.prompt_ids = list(firsts[0].prompt_token_ids) if firsts and firsts[0] is not None else []
    if body.stream:
        return sse_response(request, reply.chunks(streams, firsts), admission, retry)
    try:
        (out,) = await unless_disconnected(request, collect(streams, firsts))
    except BaseException as exc:
        raise as_api_error(exc, retry) from None
    finally:
        admission.release()
    return JSONResponse(reply.whole(out))


async def _render(settings: ServerConfig, sm: ServedModel, body: ChatRequest, retry: int) -> str:
    """The prompt, rendered off the event loop within the server's time and size limits."""
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message needs add_generation_prompt: false", param="continue_final_message")
    check_request_template(body.chat_template, settings)

    def render() -> str:
        return sm.llm.render_chat(body.messages, body.chat_template or sm.chat_template, body.add_generation_prompt,  # type: ignore[no-any-return]
                                  body.continue_final_message, body.chat_template_kwargs)

    try:
        return await render_bounded(render, settings)
    except LmdockError as exc:
        raise as_api_error(exc, retry, sm.hide) from None


class _Reply:
    """The response's shape for one request: its id, choices and logprobs."""

    def __init__(self, body: ChatRequest, model: str, tok: Any, n: int) -> None:
        self.body, self.model, self.tok, self.n = body, model, tok, n
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.prompt_ids: list[int] = []  # the rendered prompt's tokens: what the first token's text follows
        self.created = int(time.time())

    def logprobs(self, c: Any, start: int) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        before = [*self.prompt_ids, *c.token_ids[:start]]  # what the tokens' text follows
        return {"content": chat_logprobs(self.tok, list(c.token_ids[start:]), list((c.logprobs or [])[start:]),
                                         self.body.top_logprobs or 0, before)}

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": self.logprobs(c, 0),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage([out])}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": choices, **extra}

    async def chunks(self, streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput | None]) -> AsyncIterator[dict[str, Any]]:
        yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                           for i in range(self.n)])
        last: list[Any] = [None]
        async for d in choice_deltas(streams, firsts, last):
            c = d.choice
            yield self._chunk([{"index": c.index, "delta": {"content": d.text} if d.text else {},
                                "logprobs": self.logprobs(c, d.token_start), "finish_reason": c.finish_reason}])
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield self._chunk([], usage=usage(last))
