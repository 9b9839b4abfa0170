"""vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (what lm-evaluation-harness's remote tokenizer reads)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from lmdock._plugin.errors import LmdockError
from lmdock.server._errors import APIError, as_api_error
from lmdock.server._protocol import DetokenizeRequest, TokenizeRequest
from lmdock.server._state import ServedModel, state_of
from lmdock.server._templates import render_bounded
from lmdock.tools import check_tools

router = APIRouter()


def _tokenizer(sm: ServedModel) -> Any:
    if sm.llm.tokenizer is None:
        raise APIError(400, f"model {sm.name!r} was loaded without a tokenizer")
    return sm.llm.tokenizer


def _vocab_size(tok: Any) -> int | None:
    try:
        return len(tok)
    except TypeError:
        return getattr(tok, "vocab_size", None)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    st = state_of(request)
    sm = await st.model(body.model, request)
    tok = _tokenizer(sm)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.tools is not None and body.messages is None:
        raise APIError(400, "tools are rendered with messages: send messages, or leave tools out", param="tools")
    try:
        if body.messages is not None:  # the template renders off the event loop, within the server's limits
            messages, tools = body.messages, check_tools(body.tools) if body.tools is not None else None
            text = await render_bounded(lambda: sm.llm.render_chat(messages, sm.chat_template, body.add_generation_prompt, tools=tools),
                                        st.settings)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    except LmdockError as exc:
        raise as_api_error(exc, st.retry_after, sm.hide) from None
    return {"count": len(ids), "max_model_len": sm.llm.max_model_len, "tokens": ids, "token_strs": None}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    sm = await state_of(request).model(body.model, request)
    tok = _tokenizer(sm)
    vocab = _vocab_size(tok)
    bad = next((t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": tok.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> dict[str, Any]:
    sm = await state_of(request).model(model, request)
    tok = _tokenizer(sm)
    return {
        "tokenizer_class": type(tok).__name__,
        "eos_token": getattr(tok, "eos_token", None), "eos_token_id": tok.eos_token_id,
        "bos_token": getattr(tok, "bos_token", None), "bos_token_id": tok.bos_token_id,
        "pad_token": getattr(tok, "pad_token", None), "pad_token_id": getattr(tok, "pad_token_id", None),
        "add_bos_token": getattr(tok, "add_bos_token", None),
        "chat_template": sm.chat_template or getattr(tok, "chat_template", None),
        "model_max_length": sm.llm.max_model_len, "max_model_len": sm.llm.max_model_len,
        "vocab_size": _vocab_size(tok),
    }
