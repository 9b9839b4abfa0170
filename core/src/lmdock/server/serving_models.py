"""``GET /v1/models``: the served models under their config names, with their backend and context length."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from lmdock.server._state import state_of

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": sm.created, "owned_by": "lmdock", "root": sm.llm.model_config.model,
         "max_model_len": sm.llm.max_model_len, "backend": sm.llm.backend.name}
        for name, sm in state_of(request).models.items()
    ]}
