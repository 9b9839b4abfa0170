"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served models under their config names, with their
backend and context length."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from lmdock.server._state import ServedModel, state_of

router = APIRouter()


def _card(name: str, sm: ServedModel) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": sm.created, "owned_by": "lmdock", "root": sm.llm.model_config.model,
            "max_model_len": sm.llm.max_model_len, "backend": sm.llm.backend.name}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_card(name, sm) for name, sm in state_of(request).models.items()]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """One model (``client.models.retrieve``); 404 in OpenAI's shape naming the served ones."""
    st = state_of(request)
    if model_id not in st.models:
        st.model(model_id)  # raises the 404
    return _card(model_id, st.models[model_id])
