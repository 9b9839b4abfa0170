"""``/v1/embeddings``, ``/v1/score`` and ``/v1/rerank`` (vLLM's, also without ``/v1``): ``LLM.embed`` and ``LLM.score``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmdock._openai.embeddings import embedding_prompts, embeddings_response
from lmdock.server._admission import Admission
from lmdock.server._disconnects import unless_disconnected
from lmdock.server._errors import APIError, as_api_error
from lmdock.server._protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from lmdock.server._state import ServedModel, state_of

router = APIRouter()


def _pooling_method(sm: ServedModel, name: str, capability: str) -> Callable[..., Any]:
    fn = getattr(sm.llm, name, None)
    if fn is None:
        raise APIError(400, f"model {sm.name!r}: this lmdock has no LLM.{name}(); upgrade lmdock")
    backend = getattr(sm.llm, "backend", None)
    if backend is not None and hasattr(backend, "capability"):
        ok, reason = backend.capability(capability)
        if not ok:
            raise APIError(400, f"model {sm.name!r}: backend {backend.name!r} cannot {capability}: {reason}")
    return fn  # type: ignore[no-any-return]


async def _run(sm: ServedModel, request: Request, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` in a worker thread under ``sm``'s admission, cancelled if the client goes."""
    retry = state_of(request).retry_after
    admission = Admission(sm, 1, retry)
    try:
        return await unless_disconnected(request, asyncio.to_thread(fn, *args, **kwargs))
    except BaseException as exc:
        raise as_api_error(exc, retry, sm.hide) from None
    finally:
        admission.release()


def _prompt_tokens(outs: list[Any]) -> int:
    return sum(len(getattr(o, "prompt_token_ids", None) or []) for o in outs)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    sm = await state_of(request).model(body.model, request)
    fn = _pooling_method(sm, "embed", "embed")
    inputs = embedding_prompts(body.input)
    if not inputs:
        raise APIError(400, "input is empty", param="input")
    pooling = None
    if body.dimensions is not None or body.truncate_prompt_tokens is not None:
        import lmdock

        cls = getattr(lmdock, "PoolingParams", None)
        if cls is None:
            raise APIError(400, "dimensions and truncate_prompt_tokens need lmdock.PoolingParams; upgrade lmdock")
        pooling = cls(**{k: v for k, v in (("dimensions", body.dimensions), ("truncate_prompt_tokens", body.truncate_prompt_tokens)) if v is not None})
    outs = await _run(sm, request, fn, inputs, pooling_params=pooling)
    return JSONResponse(embeddings_response(outs, sm.name, body.encoding_format))


@router.post("/v1/score")
@router.post("/score")
async def score(body: ScoreRequest, request: Request) -> Response:
    sm = await state_of(request).model(body.model, request)
    fn = _pooling_method(sm, "score", "score")
    t1 = body.text_1 if isinstance(body.text_1, str) else list(body.text_1)
    t2 = body.text_2 if isinstance(body.text_2, str) else list(body.text_2)
    if isinstance(t1, list) and isinstance(t2, list) and len(t1) != len(t2) and len(t1) != 1:
        raise APIError(400, f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1 or as many as text_2", param="text_1")
    outs = await _run(sm, request, fn, t1, t2)
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": sm.name,
                         "data": [{"index": i, "object": "score", "score": float(o.outputs.score)} for i, o in enumerate(outs)],
                         "usage": {"prompt_tokens": _prompt_tokens(outs)}})


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request) -> Response:
    sm = await state_of(request).model(body.model, request)
    fn = _pooling_method(sm, "score", "score")
    if not body.documents:
        raise APIError(400, "documents is empty", param="documents")
    outs = await _run(sm, request, fn, body.query, list(body.documents))
    results = [{"index": i, "relevance_score": float(o.outputs.score),
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i, o in enumerate(outs)]
    results.sort(key=lambda r: -r["relevance_score"])
    if body.top_n is not None:
        results = results[: body.top_n]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": sm.name, "results": results,
                         "usage": {"total_tokens": _prompt_tokens(outs)}})
