"""Engine streams for the generating routes: one per prompt, from ``LLM.open_stream`` (snapshots that
wait for this loop merged into the newest; leaving early aborts), submitted together after admission
(so a bad prompt is a 400 before any byte is sent), merged into one, collected whole or as each
choice's deltas.

A generating route reads as: :func:`submit_admitted` -> collect the outputs (:func:`collect`, under
``_disconnects.unless_disconnected``), or stream :func:`choice_deltas` as SSE (``_sse.sse_response``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from lmdock._llm.outputs import CompletionOutput, RequestOutput
from lmdock._plugin.contract import EngineRequest
from lmdock.server._admission import Admission, sequences
from lmdock.server._disconnects import unless_disconnected
from lmdock.server._errors import APIError, as_api_error
from lmdock.server._metrics import RequestTimer
from lmdock.server._state import ServedModel, ServerState


async def engine_stream(st: ServerState, sm: ServedModel, make: Callable[[], EngineRequest], params: Any,
                        max_tokens_field: str | None = None, clamp: bool | None = None) -> AsyncIterator[RequestOutput]:
    """Submit the request ``make()`` builds (``LLM.make_request`` or a chat call's, ``stream=True``,
    run with ``params``) and yield its snapshots; leaving early (disconnect, cancel) aborts it at once.

    ``max_tokens_field``: the name the client asked for a token count under; asking for more than the
    context leaves is a 400 (as vLLM and OpenAI answer), or cut to what it leaves where ``clamp`` (None:
    ``[server] max_tokens_past_context`` says); a default is cut at the context."""
    llm = sm.llm
    await llm.acheck_grammar(params)  # in a worker process, off this loop (lmdock._grammar.check)
    request = await asyncio.to_thread(make) if getattr(make, "offload", False) else make()
    if max_tokens_field is not None:
        request = _fit(st, llm.max_model_len, request, max_tokens_field, clamp)
    timer = RequestTimer(st.metrics, sm.name)
    # Under load the server writes fewer, larger chunks instead of falling further behind; each
    # snapshot merged away still feeds the metrics.
    stream = await llm.open_stream(request, skipped=timer.snapshot)
    try:
        async for out in stream:
            timer.snapshot(out)
            yield out
    finally:
        stream.close()


def offloaded(make: Callable[[], EngineRequest], slow: bool) -> Callable[[], EngineRequest]:
    """``make``, marked to run on a worker thread where ``slow`` (a prompt with images: decoded and run
    through the model's processor), so the event loop never waits on it."""
    if slow:
        make.offload = True  # type: ignore[attr-defined]
    return make


def _fit(st: ServerState, max_model_len: int, request: EngineRequest, field: str, clamp: bool | None) -> EngineRequest:
    """``request`` with a ``max_new_tokens`` the context has room for, or the 400 naming ``field``."""
    params = request.params
    room = max_model_len - len(request.prompt_token_ids)
    if params.max_new_tokens <= room:
        return request
    if clamp is None:
        clamp = st.settings.max_tokens_past_context == "clamp"
    if not clamp or room <= 0:
        raise APIError(400, f"{field}={params.max_new_tokens}: the prompt has {len(request.prompt_token_ids)} "
                            f"tokens and the model's context is {max_model_len}; ask for at most {max(room, 0)}",
                       param=field)
    return dataclasses.replace(request, params=params.replace(max_new_tokens=room))


async def submit_admitted(request: Request, st: ServerState, sm: ServedModel, makers: list[Callable[[], EngineRequest]],
                          params: Any, **stream_kw: Any) -> tuple[Admission, list[AsyncIterator[RequestOutput]], list[RequestOutput | None]]:
    """Admit a request's sequences, then submit one engine stream per request maker (one per prompt)
    and wait for each one's first output (so a bad prompt is a 400, not a broken stream); the places
    go back on any failure.  ``stream_kw``: :func:`engine_stream`'s."""
    admission = Admission(sm, sequences(len(makers), params), st.retry_after)
    try:
        streams = [engine_stream(st, sm, make, params, **stream_kw) for make in makers]
        firsts = await unless_disconnected(request, start_all(streams, st.retry_after))
    except BaseException:
        admission.release()
        raise
    return admission, streams, firsts


async def start_all(streams: list[AsyncIterator[RequestOutput]], retry: int) -> list[RequestOutput | None]:
    """Submit every request (the first ``__anext__`` submits, then waits for the first output).

    Submission errors (a bad prompt, a full queue) surface here as the right status; on any error,
    the requests already submitted are aborted.
    """
    tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException as exc:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise as_api_error(exc, retry) from None
    return list(results)


async def rest(stream: AsyncIterator[RequestOutput], first: RequestOutput | None) -> AsyncIterator[RequestOutput]:
    """The stream again, starting with the snapshot :func:`start_all` already took."""
    try:
        if first is not None:
            yield first
            if first.finished:
                return
        async for out in stream:
            yield out
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Snapshots of several requests as they come, tagged with the request's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
            await queue.put((i, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]


async def collect(streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput | None]) -> list[RequestOutput]:
    """The last (finished) snapshot of every stream, for a response that is not streamed."""
    last: list[Any] = list(firsts)
    async for i, out in merged([rest(s, f) for s, f in zip(streams, firsts)]):
        last[i] = out
    return last


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice has to send now: its new text, and how much of it was sent before."""

    prompt: int  # which of the request's prompts (0 for chat)
    out: RequestOutput
    choice: CompletionOutput
    text: str  # the text not sent yet
    text_start: int  # characters of the choice's text sent before
    token_start: int  # tokens of the choice sent before
    first: bool  # the choice's first chunk


async def choice_deltas(streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput | None],
                        last: list[Any], *, send_first: bool = False) -> AsyncIterator[ChoiceDelta]:
    """Every choice's progress as it comes, once per snapshot that adds text or tokens or finishes it
    (``send_first``: also its first snapshot, even an empty one); ``last`` keeps each stream's newest."""
    sent: dict[tuple[int, int], tuple[int, int]] = {}
    done: set[tuple[int, int]] = set()
    async for i, out in merged([rest(s, f) for s, f in zip(streams, firsts)]):
        last[i] = out
        for c in out.outputs:
            key = (i, c.index)
            if key in done:
                continue
            before = sent.get(key)
            t0, k0 = before or (0, 0)
            text = c.text[t0:]
            if not text and len(c.token_ids) == k0 and not c.finished and not (send_first and before is None):
                continue
            sent[key] = (len(c.text), len(c.token_ids))
            if c.finished:
                done.add(key)
            yield ChoiceDelta(i, out, c, text, t0, k0, before is None)
