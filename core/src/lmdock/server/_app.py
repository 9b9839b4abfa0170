"""The ASGI app: OpenAI's routes over ``LLM`` objects, with admission, auth, body limits and drain."""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmdock._errors import ConfigError, EngineClosedError, LmdockError, QueueFullError, RequestError, UnsupportedError
from lmdock._outputs import RequestOutput
from lmdock._params import ServerConfig
from lmdock._sinks import AsyncQueueSink
from lmdock.server._errors import APIError, error_body
from lmdock.server._metrics import CONTENT_TYPE, Metrics, RequestTimer
from lmdock.server._protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)

log = logging.getLogger("lmdock.server")


@dataclass
class ServedModel:
    """One model the server answers for: its public name, the loaded ``LLM``, its admission bound."""

    name: str
    llm: Any
    max_queue: int
    chat_template: str | None = None
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _State:
    models: dict[str, ServedModel]
    settings: ServerConfig
    api_key: str | None
    metrics: Metrics
    draining: bool = False


def create_app(models: list[ServedModel], settings: ServerConfig | None = None, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving ``models`` (the first is the default when a request names none)."""
    settings = settings or ServerConfig()
    if not models:
        raise ValueError("create_app needs at least one model")
    served = {m.name: m for m in models}
    metrics = Metrics(lambda: {name: _stats(m) for name, m in served.items()})
    state = _State(served, settings, api_key, metrics)
    app = FastAPI(title="lmdock", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lmdock = state
    _install_errors(app)
    _routes(app, state)
    # Outermost first: body limit, then auth, then CORS (so a preflight needs no key), then drain.
    app.add_middleware(_Guard, state=state)
    if settings.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app


def _stats(m: ServedModel) -> dict[str, Any]:
    try:
        return m.llm.stats()
    except Exception:  # noqa: BLE001 - a dead engine reports nothing; /health says why
        return {}


# -- errors --------------------------------------------------------------------------------------


def _json_error(status: int, message: str, param: str | None = None, code: str | None = None,
                headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return _json_error(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return _json_error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request body")
        return _json_error(400, f"{param}: {msg}" if param else msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _json_error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _other(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _json_error(500, f"internal error ({type(exc).__name__}); see the server's log")


def _as_api_error(exc: BaseException, retry_after: int) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), headers={"Retry-After": str(retry_after)})
    if isinstance(exc, EngineClosedError):
        return APIError(503, f"the engine is not running: {exc}", headers={"Retry-After": str(retry_after)})
    if isinstance(exc, (RequestError, ConfigError, UnsupportedError, ValueError)):
        param = getattr(exc, "key", None)
        if param and param.startswith("sampling_params."):
            param = param.split(".", 1)[1]
        return APIError(400, str(exc), param=param)
    if isinstance(exc, LmdockError):
        return APIError(500, str(exc))
    log.error("request failed", exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}: {exc})")


# -- the guard: body size, API key, drain (pure ASGI, so streaming and disconnects pass through) ----


class _Guard:
    def __init__(self, app: Any, state: _State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st = self.state
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if st.draining:
            await _send_error(send, 503, "the server is shutting down; retry on another replica or later",
                              {"Retry-After": str(st.settings.retry_after)})
            return
        if st.api_key is not None and path != "/health" and scope.get("method") != "OPTIONS":
            auth = headers.get("authorization", "")
            given = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), st.api_key.encode()):
                what = "wrong API key" if given else "missing API key"
                await _send_error(send, 401, f"{what}: send 'Authorization: Bearer <key>'")
                return
        limit = st.settings.max_body_bytes
        length = headers.get("content-length")
        too_big = f"the request body is larger than the limit of {limit} bytes ([server] max_body_bytes)"
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(send, 413, too_big)
            return
        seen = 0
        overflow = False

        async def limited() -> dict[str, Any]:
            # A chunked body is counted as it arrives; past the limit the app gets an empty final chunk
            # and whatever it answers is replaced by the 413.
            nonlocal seen, overflow
            if overflow:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    overflow = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return msg

        replaced = False

        async def guarded_send(msg: dict[str, Any]) -> None:
            nonlocal replaced
            if overflow:
                if not replaced:
                    replaced = True
                    await _send_error(send, 413, too_big)
                return
            await send(msg)

        await self.app(scope, limited, guarded_send)


async def _send_error(send: Callable[..., Any], status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


# -- generation plumbing --------------------------------------------------------------------------


class _Admission:
    """Holds ``count`` of a model's queue places for one HTTP request; 429 with Retry-After when full."""

    def __init__(self, sm: ServedModel, count: int, retry_after: int) -> None:
        if sm.in_flight + count > sm.max_queue:
            raise APIError(429, f"model {sm.name!r} has {sm.in_flight} requests in flight, its limit is {sm.max_queue}; "
                                "retry after the Retry-After seconds", headers={"Retry-After": str(retry_after)})
        sm.in_flight += count
        self.sm, self.count = sm, count

    def release(self) -> None:
        if self.count:
            self.sm.in_flight -= self.count
            self.count = 0


async def _engine_stream(st: _State, sm: ServedModel, prompt: str | list[int], params: Any,
                         add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
    """Submit one request and yield its snapshots; leaving early (disconnect, cancel) aborts it at once."""
    llm = sm.llm
    request = llm._request(prompt, params, stream=True, add_special_tokens=add_special_tokens)
    sink = AsyncQueueSink(asyncio.get_running_loop())
    timer = RequestTimer(st.metrics, sm.name)
    llm.engine.submit(request, sink)
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


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await ``work``; if the client goes first, cancel it (aborting its engine requests) and stop."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(499, "the client closed the connection")
    return task.result()


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _token_text(tok: Any, token_id: int, lp: Any) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tok.decode([token_id]) if tok is not None else str(token_id)


def _legacy_logprobs(tok: Any, ids: list[int], positions: list[Any], offset: int) -> dict[str, Any]:
    """The completions API's ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, pos in zip(ids, positions):
        lp = pos.get(t) if pos else None
        text = _token_text(tok, t, lp)
        tokens.append(text)
        token_lps.append(lp.logprob if lp is not None else None)
        tops.append({_token_text(tok, k, v): v.logprob for k, v in pos.items()} if pos else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tok: Any, ids: list[int], positions: list[Any], k: int) -> list[dict[str, Any]]:
    content = []
    for t, pos in zip(ids, positions):
        lp = pos.get(t)
        text = _token_text(tok, t, lp)
        top = sorted(pos.items(), key=lambda kv: kv[1].rank or 0)[:k] if k else []
        content.append({
            "token": text, "logprob": lp.logprob if lp else None, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (s := _token_text(tok, i, v)), "logprob": v.logprob, "bytes": list(s.encode())} for i, v in top],
        })
    return content


def _finish(reason: str | None) -> str | None:
    return reason


def _usage(outs: list[RequestOutput | None]) -> dict[str, int]:
    p = sum(len(o.prompt_token_ids) for o in outs if o is not None)
    c = sum(len(c.token_ids) for o in outs if o is not None for c in o.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# -- routes ---------------------------------------------------------------------------------------


def _routes(app: FastAPI, st: _State) -> None:  # noqa: C901 - one place for the route table
    retry = st.settings.retry_after

    def model_for(name: str | None) -> ServedModel:
        if name is None or name == "":
            return next(iter(st.models.values()))
        sm = st.models.get(name)
        if sm is None:
            raise APIError(404, f"model {name!r} is not served here; served models: {', '.join(st.models)}",
                           param="model", code="model_not_found")
        return sm

    def params_for(sm: ServedModel, overrides: dict[str, Any]) -> Any:
        try:
            return sm.llm._params(overrides)
        except (ConfigError, ValueError) as exc:
            raise _as_api_error(exc, retry) from None

    @app.get("/health")
    async def health() -> Response:
        dead = []
        for name, sm in st.models.items():
            try:
                sm.llm.engine  # noqa: B018 - raises when shut down
            except LmdockError as exc:
                dead.append(f"{name}: {exc}")
        if dead:
            return _json_error(503, "; ".join(dead), headers={"Retry-After": str(retry)})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": sm.created, "owned_by": "lmdock", "root": sm.llm.model_config.model,
             "max_model_len": sm.llm.max_model_len, "backend": sm.llm.backend.name}
            for name, sm in st.models.items()
        ]}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {name: {**_stats(sm), "in_flight": sm.in_flight, "max_queue": sm.max_queue} for name, sm in st.models.items()}

    # -- tokenizer ----------------------------------------------------------------------------------

    def tokenizer(sm: ServedModel) -> Any:
        if sm.llm.tokenizer is None:
            raise APIError(400, f"model {sm.name!r} was loaded without a tokenizer")
        return sm.llm.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        sm = model_for(body.model)
        tok = tokenizer(sm)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        try:
            if body.messages is not None:
                text = sm.llm.render_chat(body.messages, sm.chat_template, body.add_generation_prompt)
                ids = tok.encode(text, add_special_tokens=False)
            else:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except LmdockError as exc:
            raise _as_api_error(exc, retry) from None
        return {"count": len(ids), "max_model_len": sm.llm.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        sm = model_for(body.model)
        tok = tokenizer(sm)
        vocab = _vocab_size(tok)
        bad = next((t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> dict[str, Any]:
        sm = model_for(model)
        tok = tokenizer(sm)
        info: dict[str, Any] = {
            "tokenizer_class": type(tok).__name__,
            "eos_token": getattr(tok, "eos_token", None), "eos_token_id": tok.eos_token_id,
            "bos_token": getattr(tok, "bos_token", None), "bos_token_id": tok.bos_token_id,
            "pad_token": getattr(tok, "pad_token", None), "pad_token_id": getattr(tok, "pad_token_id", None),
            "add_bos_token": getattr(tok, "add_bos_token", None),
            "chat_template": sm.chat_template or getattr(tok, "chat_template", None),
            "model_max_length": sm.llm.max_model_len, "max_model_len": sm.llm.max_model_len,
            "vocab_size": _vocab_size(tok),
        }
        return info

    # -- completions --------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        sm = model_for(body.model)
        prompts = body.prompts()
        params = params_for(sm, body.overrides())
        tok = sm.llm.tokenizer
        n = params.n
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        admission = _Admission(sm, len(prompts), retry)
        try:
            streams = [_engine_stream(st, sm, p, params) for p in prompts]
            # Validate and submit every prompt before answering, so a bad one is a 400, not a broken stream.
            firsts = await _unless_disconnected(request, _start_all(streams, retry))
        except BaseException:
            admission.release()
            raise
        echo_texts = [
            (p if isinstance(p, str) else (tok.decode(p) if tok is not None else "")) if body.echo else "" for p in prompts
        ]
        want_lp = body.logprobs is not None

        def choice_logprobs(i: int, out: RequestOutput, c: Any, start: int, text_start: int) -> dict[str, Any] | None:
            if not want_lp:
                return None
            ids, pos = list(c.token_ids[start:]), list((c.logprobs or [])[start:])
            if body.echo and start == 0:
                plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                head = _legacy_logprobs(tok, list(out.prompt_token_ids), list(plp), 0)
                tail = _legacy_logprobs(tok, ids, pos, len(echo_texts[i]))
                return {k: head[k] + tail[k] for k in head}
            return _legacy_logprobs(tok, ids, pos, text_start)

        if not body.stream:
            async def collect() -> list[RequestOutput]:
                last: list[Any] = [None] * len(prompts)
                for i, f in enumerate(firsts):
                    last[i] = f
                async for i, out in _merged([_rest(s, f) for s, f in zip(streams, firsts)]):
                    last[i] = out
                return last

            try:
                outs = await _unless_disconnected(request, collect())
            except BaseException as exc:
                raise _as_api_error(exc, retry) from None
            finally:
                admission.release()
            choices = []
            for i, out in enumerate(outs):
                for c in out.outputs:
                    choices.append({"index": i * n + c.index, "text": echo_texts[i] + c.text,
                                    "logprobs": choice_logprobs(i, out, c, 0, len(echo_texts[i])),
                                    "finish_reason": _finish(c.finish_reason), "stop_reason": c.stop_reason})
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": sm.name,
                                 "choices": choices, "usage": _usage(outs)})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            sent_text: dict[tuple[int, int], int] = {}
            sent_tok: dict[tuple[int, int], int] = {}
            done: set[tuple[int, int]] = set()
            last: list[Any] = [None] * len(prompts)
            try:
                async for i, out in _merged([_rest(s, f) for s, f in zip(streams, firsts)]):
                    last[i] = out
                    for c in out.outputs:
                        key = (i, c.index)
                        if key in done:
                            continue
                        t0, k0 = sent_text.get(key), sent_tok.get(key, 0)
                        first = t0 is None
                        delta = c.text[t0 or 0:]
                        if first:
                            delta = echo_texts[i] + delta
                        if not delta and len(c.token_ids) == k0 and not c.finished and not first:
                            continue
                        lp = choice_logprobs(i, out, c, k0, len(echo_texts[i]) + (t0 or 0)) if (want_lp and (first or len(c.token_ids) > k0)) else None
                        sent_text[key], sent_tok[key] = len(c.text), len(c.token_ids)
                        if c.finished:
                            done.add(key)
                        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": sm.name,
                                    "choices": [{"index": i * n + c.index, "text": delta, "logprobs": lp,
                                                 "finish_reason": _finish(c.finish_reason),
                                                 "stop_reason": c.stop_reason}]})
                if include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": sm.name,
                                "choices": [], "usage": _usage(last)})
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - an error mid-stream goes to the client as an event
                yield _sse(_as_api_error(exc, retry).body())
            finally:
                admission.release()
            yield "data: [DONE]\n\n"

        return _streaming(request, events())

    # -- chat ---------------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        sm = model_for(body.model)
        params = params_for(sm, body.overrides())
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false", param="continue_final_message")
        try:
            prompt = sm.llm.render_chat(body.messages, body.chat_template or sm.chat_template, body.add_generation_prompt,
                                        body.continue_final_message, body.chat_template_kwargs)
        except LmdockError as exc:
            raise _as_api_error(exc, retry) from None
        tok = sm.llm.tokenizer
        k = body.top_logprobs or 0
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        admission = _Admission(sm, 1, retry)
        try:
            stream = _engine_stream(st, sm, prompt, params, add_special_tokens=False)
            (first,) = await _unless_disconnected(request, _start_all([stream], retry))
        except BaseException:
            admission.release()
            raise

        def logprobs_of(c: Any, start: int) -> dict[str, Any] | None:
            if not body.logprobs:
                return None
            return {"content": _chat_logprobs(tok, list(c.token_ids[start:]), list((c.logprobs or [])[start:]), k)}

        if not body.stream:
            async def collect() -> RequestOutput:
                last = first
                async for out in _rest(stream, first):
                    last = out
                return last

            try:
                out = await _unless_disconnected(request, collect())
            except BaseException as exc:
                raise _as_api_error(exc, retry) from None
            finally:
                admission.release()
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs_of(c, 0), "finish_reason": _finish(c.finish_reason), "stop_reason": c.stop_reason}
                       for c in out.outputs]
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": sm.name,
                                 "choices": choices, "usage": _usage([out])})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": sm.name,
                         "choices": choices, **extra})

        async def events() -> AsyncIterator[str]:
            sent_text: dict[int, int] = {}
            sent_tok: dict[int, int] = {}
            done: set[int] = set()
            last = first
            try:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                             for i in range(params.n)])
                async for out in _rest(stream, first):
                    last = out
                    for c in out.outputs:
                        if c.index in done:
                            continue
                        t0, k0 = sent_text.get(c.index, 0), sent_tok.get(c.index, 0)
                        delta = c.text[t0:]
                        if not delta and len(c.token_ids) == k0 and not c.finished:
                            continue
                        sent_text[c.index], sent_tok[c.index] = len(c.text), len(c.token_ids)
                        if c.finished:
                            done.add(c.index)
                        yield chunk([{"index": c.index, "delta": {"content": delta} if delta else {},
                                      "logprobs": logprobs_of(c, k0), "finish_reason": _finish(c.finish_reason)}])
                if include_usage:
                    yield chunk([], usage=_usage([last]))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                yield _sse(_as_api_error(exc, retry).body())
            finally:
                admission.release()
            yield "data: [DONE]\n\n"

        return _streaming(request, events())

    # -- pooling: embeddings, score, rerank ----------------------------------------------------------

    def pooling_method(sm: ServedModel, name: str, capability: str) -> Callable[..., Any]:
        fn = getattr(sm.llm, name, None)
        if fn is None:
            raise APIError(400, f"model {sm.name!r}: this lmdock has no LLM.{name}(); upgrade lmdock")
        backend = getattr(sm.llm, "backend", None)
        if backend is not None and hasattr(backend, "capability"):
            ok, reason = backend.capability(capability)
            if not ok:
                raise APIError(400, f"model {sm.name!r}: backend {backend.name!r} cannot {capability}: {reason}")
        return fn

    async def run_pooling(sm: ServedModel, request: Request, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        admission = _Admission(sm, 1, retry)
        try:
            return await _unless_disconnected(request, asyncio.to_thread(fn, *args, **kwargs))
        except BaseException as exc:
            raise _as_api_error(exc, retry) from None
        finally:
            admission.release()

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        sm = model_for(body.model)
        fn = pooling_method(sm, "embed", "embed")
        inp = body.input
        inputs: list[Any] = [inp] if isinstance(inp, str) or (inp and all(isinstance(x, int) for x in inp)) else list(inp)
        if not inputs:
            raise APIError(400, "input is empty", param="input")
        pooling = None
        if body.dimensions is not None or body.truncate_prompt_tokens is not None:
            import lmdock

            cls = getattr(lmdock, "PoolingParams", None)
            if cls is None:
                raise APIError(400, "dimensions and truncate_prompt_tokens need lmdock.PoolingParams; upgrade lmdock")
            pooling = cls(**{k: v for k, v in (("dimensions", body.dimensions), ("truncate_prompt_tokens", body.truncate_prompt_tokens)) if v is not None})
        outs = await run_pooling(sm, request, fn, inputs, pooling_params=pooling)
        data, tokens = [], 0
        for i, o in enumerate(outs):
            vec = list(o.outputs.embedding)
            tokens += len(getattr(o, "prompt_token_ids", None) or [])
            emb: Any = vec
            if body.encoding_format == "base64":
                emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return JSONResponse({"object": "list", "data": data, "model": sm.name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @app.post("/v1/score")
    @app.post("/score")
    async def score(body: ScoreRequest, request: Request) -> Response:
        sm = model_for(body.model)
        fn = pooling_method(sm, "score", "score")
        t1 = body.text_1 if isinstance(body.text_1, str) else list(body.text_1)
        t2 = body.text_2 if isinstance(body.text_2, str) else list(body.text_2)
        if isinstance(t1, list) and isinstance(t2, list) and len(t1) != len(t2) and len(t1) != 1:
            raise APIError(400, f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1 or as many as text_2", param="text_1")
        outs = await run_pooling(sm, request, fn, t1, t2)
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": sm.name,
                             "data": [{"index": i, "object": "score", "score": float(o.outputs.score)} for i, o in enumerate(outs)],
                             "usage": {"prompt_tokens": sum(len(getattr(o, "prompt_token_ids", None) or []) for o in outs)}})

    @app.post("/v1/rerank")
    @app.post("/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Response:
        sm = model_for(body.model)
        fn = pooling_method(sm, "score", "score")
        if not body.documents:
            raise APIError(400, "documents is empty", param="documents")
        outs = await run_pooling(sm, request, fn, body.query, list(body.documents))
        results = [{"index": i, "relevance_score": float(o.outputs.score),
                    **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i, o in enumerate(outs)]
        results.sort(key=lambda r: -r["relevance_score"])
        if body.top_n is not None:
            results = results[: body.top_n]
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": sm.name, "results": results,
                             "usage": {"total_tokens": sum(len(getattr(o, "prompt_token_ids", None) or []) for o in outs)}})


def _vocab_size(tok: Any) -> int | None:
    try:
        return len(tok)
    except TypeError:
        return getattr(tok, "vocab_size", None)


async def _start_all(streams: list[AsyncIterator[RequestOutput]], retry: int) -> list[RequestOutput | None]:
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
        raise _as_api_error(exc, retry) from None
    return list(results)


async def _rest(stream: AsyncIterator[RequestOutput], first: RequestOutput | None) -> AsyncIterator[RequestOutput]:
    """The stream again, starting with the snapshot :func:`_start_all` already took."""
    try:
        if first is not None:
            yield first
            if first.finished:
                return
        async for out in stream:
            yield out
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def _streaming(request: Request, events: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        # Our own watcher as well as Starlette's: a client gone while nothing is sent (queued, or
        # between tokens) still aborts the request at once.
        gen = events.__aiter__()
        watch = asyncio.ensure_future(_wait_disconnect(request))
        nxt: asyncio.Future[str] | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(gen.__anext__())
                await asyncio.wait({nxt, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
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
            if nxt is not None and not nxt.done():
                nxt.cancel()
            elif nxt is not None:
                asyncio.ensure_future(gen.aclose())  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
