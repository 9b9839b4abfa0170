"""``POST /v1/completions``: one or several prompts, ``n`` choices each, streamed or not, with echo and logprobs."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmdock._llm.logprobs import legacy_logprobs
from lmdock._llm.outputs import RequestOutput
from lmdock.server._disconnects import unless_disconnected
from lmdock.server._engine_streams import choice_deltas, collect, submit_admitted
from lmdock.server._errors import as_api_error
from lmdock.server._protocol import CompletionRequest, usage
from lmdock.server._sse import sse_response
from lmdock.server._state import state_of

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    st = state_of(request)
    retry = st.retry_after
    sm = await st.model(body.model, request, body.keep_alive)
    prompts = body.prompts()
    params = st.sampling_params(sm, body.overrides(), body)
    lora = st.adapter(body.model)
    makers = [functools.partial(sm.llm.make_request, p, params, stream=True, lora_request=lora) for p in prompts]
    admission, streams, firsts = await submit_admitted(request, st, sm, makers, params, max_tokens_field=body.max_tokens_field())
    reply = _Reply(body, body.model if lora else sm.name, sm.llm.tokenizer, prompts, params.n)
    if body.stream:
        return sse_response(request, reply.chunks(streams, firsts), admission, retry)
    try:
        outs = await unless_disconnected(request, collect(streams, firsts))
    except BaseException as exc:
        raise as_api_error(exc, retry) from None
    finally:
        admission.release()
    return JSONResponse(reply.whole(outs))


class _Reply:
    """The response's shape for one request: its id, the echoed prompts, choices and logprobs."""

    def __init__(self, body: CompletionRequest, model: str, tok: Any, prompts: list[str | list[int]], n: int) -> None:
        self.body, self.model, self.tok, self.n = body, model, tok, n
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.echo = [(p if isinstance(p, str) else (tok.decode(p) if tok is not None else "")) if body.echo else "" for p in prompts]
        self.count = len(prompts)

    def _object(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": choices, **extra}

    def logprobs(self, i: int, out: RequestOutput, c: Any, start: int, text_start: int) -> dict[str, Any] | None:
        """Choice ``c``'s logprobs from its token ``start`` on (with the prompt's, when echoed, from 0)."""
        ids, pos = list(c.token_ids[start:]), list((c.logprobs or [])[start:])
        before = [*out.prompt_token_ids, *c.token_ids[:start]]  # what the tokens' text follows
        if self.body.echo and start == 0:
            plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            head = legacy_logprobs(self.tok, list(out.prompt_token_ids), list(plp), 0)
            tail = legacy_logprobs(self.tok, ids, pos, len(self.echo[i]), before)
            return {k: head[k] + tail[k] for k in head}
        return legacy_logprobs(self.tok, ids, pos, text_start, before)

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        if self.body.prompt_only():
            return self._scored(outs)
        want_lp = self.body.logprobs is not None
        choices = [{"index": i * self.n + c.index, "text": self.echo[i] + c.text,
                    "logprobs": self.logprobs(i, out, c, 0, len(self.echo[i])) if want_lp else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for i, out in enumerate(outs) for c in out.outputs]
        return self._object(choices, usage=usage(outs))  # type: ignore[arg-type]

    def _scored(self, outs: list[RequestOutput]) -> dict[str, Any]:
        """``echo`` with max_tokens 0: each prompt and its logprobs, no completion."""
        choices = []
        for i, out in enumerate(outs):
            lp = None
            if self.body.logprobs is not None:
                plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                lp = legacy_logprobs(self.tok, list(out.prompt_token_ids), list(plp), 0)
            choices += [{"index": i * self.n + c.index, "text": self.echo[i], "logprobs": lp, "finish_reason": "length",
                         "stop_reason": None} for c in out.outputs]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        return self._object(choices, usage={"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens})

    async def chunks(self, streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput | None]) -> AsyncIterator[dict[str, Any]]:
        want_lp = self.body.logprobs is not None
        last: list[Any] = [None] * self.count
        async for d in choice_deltas(streams, firsts, last, send_first=True):
            c, i = d.choice, d.prompt
            text = self.echo[i] + d.text if d.first else d.text
            lp = None
            if want_lp and (d.first or len(c.token_ids) > d.token_start):
                lp = self.logprobs(i, d.out, c, d.token_start, len(self.echo[i]) + d.text_start)
            yield self._object([{"index": i * self.n + c.index, "text": text, "logprobs": lp,
                                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield self._object([], usage=usage(last))
