"""Stream plumbing shared by the generating routes: admission (429), engine streams that merge the
snapshots that wait, several streams merged into one, abort on disconnect, and the SSE response.

A generating route reads as: admit -> :func:`start_all` (submit, so a bad prompt is a 400 before any
byte is sent) -> collect the outputs, or stream :func:`choice_deltas` as SSE through :func:`sse_response`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from lmdock._lora import LoRARequest
from lmdock._outputs import CompletionOutput, RequestOutput
from lmdock._sinks import AsyncQueueSink
from lmdock.server._errors import APIError, as_api_error
from lmdock.server._metrics import RequestTimer
from lmdock.server._state import ServedModel, ServerState, state_of

DONE = "data: [DONE]\n\n"


def sequences(prompts: int, params: Any) -> int:
    """The sequences a request adds to the engine: each prompt's ``n`` completions, or its beams."""
    return prompts * max(params.n, params.beam_width)


class Admission:
    """Holds ``count`` of a model's queue places (sequences) for one HTTP request: 429 with Retry-After
    when they are taken, 400 when the request could never fit."""

    def __init__(self, sm: ServedModel, count: int, retry_after: int) -> None:
        if count > sm.max_queue:
            raise APIError(400, f"the request adds {count} sequences (prompts x n, or beams), more than model {sm.name!r} "
                                f"ever holds at once ({sm.max_queue}; [server] max_queue): split it")
        if sm.in_flight + count > sm.max_queue:
            raise APIError(429, f"model {sm.name!r} has {sm.in_flight} sequences in flight, its limit is {sm.max_queue}; "
                                "retry after the Retry-After seconds", headers={"Retry-After": str(retry_after)})
        sm.in_flight += count
        self.sm, self.count = sm, count

    def release(self) -> None:
        if self.count:
            self.sm.in_flight -= self.count
            self.count = 0


async def engine_stream(st: ServerState, sm: ServedModel, prompt: str | list[int] | dict[str, Any], params: Any,
                        add_special_tokens: bool = True, max_tokens_field: str | None = None,
                        lora_request: LoRARequest | None = None, clamp: bool | None = None) -> AsyncIterator[RequestOutput]:
    """Submit one request and yield its snapshots; leaving early (disconnect, cancel) aborts it at once.

    ``max_tokens_field``: the name the client asked for a token count under; asking for more than the
    context leaves is a 400 (as vLLM and OpenAI answer), or cut to what it leaves where ``clamp`` (None:
    ``[server] max_tokens_past_context`` says); a default is cut at the context.
    ``lora_request``: the adapter a ``NAME:ADAPTER`` model name asked for, or None."""
    llm = sm.llm
    await llm.acheck_grammar(params)  # in a worker process, off this loop (lmdock._grammar_check)
    if isinstance(prompt, dict):  # images: decoded and run through the model's processor off this loop
        request = await asyncio.to_thread(llm.make_request, prompt, params, stream=True, add_special_tokens=add_special_tokens,
                                          lora_request=lora_request)
    else:
        request = llm.make_request(prompt, params, stream=True, add_special_tokens=add_special_tokens, lora_request=lora_request)
    if max_tokens_field is not None:
        room = llm.max_model_len - len(request.prompt_token_ids)
        if params.max_new_tokens > room:
            if clamp is None:
                clamp = st.settings.max_tokens_past_context == "clamp"
            if not clamp or room <= 0:
                raise APIError(400, f"{max_tokens_field}={params.max_new_tokens}: the prompt has {len(request.prompt_token_ids)} "
                                    f"tokens and the model's context is {llm.max_model_len}; ask for at most {max(room, 0)}",
                               param=max_tokens_field)
            request = dataclasses.replace(request, params=request.params.replace(max_new_tokens=room))
    prepare = getattr(llm.engine, "prepare_lora", None)
    if lora_request is not None and prepare is not None:  # reads the adapter from disk on first use: not on the loop
        await asyncio.to_thread(prepare, lora_request)
    sink = AsyncQueueSink(asyncio.get_running_loop())
    timer = RequestTimer(st.metrics, sm.name)
    await submit(llm.engine, request, sink)
    finished = False
    try:
        while True:
            item = await sink.queue.get()
            # Snapshots are cumulative: when several wait (this loop fell behind the engine), only the
            # newest goes on, in one chunk, as vLLM's output collector merges outputs its consumer has
            # not taken yet; each still feeds the metrics.  Under load the server then writes fewer,
            # larger chunks instead of falling further behind.
            while not isinstance(item, BaseException) and not item.finished and not sink.queue.empty():
                timer.snapshot(item)
                item = sink.queue.get_nowait()
            if isinstance(item, BaseException):
                raise item
            timer.snapshot(item)
            yield item
            if item.finished:
                finished = True
                return
    finally:
        if not finished:
            llm.engine.abort(request.request_id)


async def submit(engine: Any, request: Any, sink: Any) -> None:
    """Submit ``request``; one with a grammar on a thread, where the engine compiles it (checked
    already, but a big one still takes a while), so this loop does not wait for it.  An engine whose
    ``submit`` must run on the loop and compiles nothing here says so: ``submit_on_loop = True``
    (the Ray front end's, whose replicas compile)."""
    if request.params.structured_output is None or getattr(engine, "submit_on_loop", False):
        engine.submit(request, sink)
        return
    done = asyncio.ensure_future(asyncio.to_thread(engine.submit, request, sink))
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:  # the client left while it compiled: abort it once it is in
        done.add_done_callback(lambda f: f.cancelled() or f.exception() or engine.abort(request.request_id))
        raise


async def submit_admitted(request: Request, st: ServerState, sm: ServedModel, prompts: list[Any], params: Any,
                          **stream_kw: Any) -> tuple[Admission, list[AsyncIterator[RequestOutput]], list[RequestOutput | None]]:
    """Admit a request's sequences, then submit one engine stream per prompt and wait for each one's
    first output (so a bad prompt is a 400, not a broken stream); the places go back on any failure."""
    admission = Admission(sm, sequences(len(prompts), params), st.retry_after)
    try:
        streams = [engine_stream(st, sm, p, params, **stream_kw) for p in prompts]
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


# -- disconnects ------------------------------------------------------------------------------------


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _cut_error(request: Request) -> APIError:
    """The 503 of a request cut by shutdown (``shutdown_timeout`` passed), with Retry-After."""
    return as_api_error(asyncio.CancelledError(), state_of(request).retry_after)


async def unless_disconnected(request: Request, work: Any) -> Any:
    """Await ``work``; if the client goes first, cancel it (aborting its engine requests) and stop; if
    the server's drain runs out first (:attr:`ServerState.cut`), cancel it and answer 503."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    cut = asyncio.ensure_future(state_of(request).cut.wait())
    try:
        await asyncio.wait({task, watch, cut}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watch.done() and not watch.cancelled()  # else this route itself was cancelled (shutdown)
        was_cut = cut.done() and not cut.cancelled()
        watch.cancel()
        cut.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if gone:
                raise APIError(499, "the client closed the connection")
            if was_cut:
                raise _cut_error(request)
    return task.result()


# -- streamed responses -----------------------------------------------------------------------------


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


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _events(chunks: AsyncIterator[dict[str, Any]], admission: Admission, retry: int) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - an error mid-stream goes to the client as an event
        yield sse(as_api_error(exc, retry).body())
    finally:
        admission.release()
    yield DONE


def sse_response(request: Request, chunks: AsyncIterator[dict[str, Any]], admission: Admission, retry: int) -> StreamingResponse:
    """``chunks`` as server-sent events, then ``[DONE]``; an error mid-stream is sent as an error
    event, and so is the end of the server's drain (:attr:`ServerState.cut`: a 503 to retry); the
    admission is released when the stream ends however it ends."""
    events = _events(chunks, admission, retry)
    state = state_of(request)

    async def body() -> AsyncIterator[str]:
        # Our own watcher as well as Starlette's: a client gone while nothing is sent (queued, or
        # between tokens) still aborts the request at once.
        gen = events.__aiter__()
        watch = asyncio.ensure_future(_wait_disconnect(request))
        cut = asyncio.ensure_future(state.cut.wait())
        nxt: asyncio.Future[str] | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(gen.__anext__())
                await asyncio.wait({nxt, watch, cut}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    if cut.done() and not watch.done():  # cut by shutdown: abort, then say so and end
                        nxt.cancel()
                        await asyncio.gather(nxt, return_exceptions=True)
                        yield sse(_cut_error(request).body())
                        yield DONE
                    return
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            # No await may be needed here: a cancelled (disconnected) response cannot wait.  Cancelling
            # the pending step unwinds the generators, whose finally blocks abort the engine requests.
            watch.cancel()
            cut.cancel()
            if nxt is not None and not nxt.done():
                nxt.cancel()
            elif nxt is not None:
                asyncio.ensure_future(gen.aclose())  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
