"""``GET /v1/models`` and ``GET /v1/models/{id}``: every servable model under its config name, with its
state (loaded / loading / unloaded), the memory its last load measured and its last use; ``POST
/v1/models/{id}/load`` and ``/unload`` load and unload one (llama.cpp's router routes)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from lmdock.server._state import ServedModel, state_of

router = APIRouter()


def _card(sm: ServedModel) -> dict[str, Any]:
    llm = sm.llm
    return {"id": sm.name, "object": "model", "created": sm.created, "owned_by": "lmdock", "root": sm.root,
            "max_model_len": llm.max_model_len if llm is not None else None,
            "backend": llm.backend.name if llm is not None else None,
            "state": sm.state, "pinned": sm.pin or sm.loader is None, "keep_alive": sm.keep_alive,
            "memory_bytes": sm.memory_bytes, "last_used": int(sm.last_used) or None, "requests": sm.holds}


def _adapter_cards(sm: ServedModel) -> list[dict[str, Any]]:
    """A model's LoRA adapters, as vLLM lists them: ``parent`` the base model, ``root`` the folder."""
    return [{"id": f"{sm.name}:{name}", "object": "model", "created": sm.created, "owned_by": "lmdock", "root": path,
             "parent": sm.name, "state": sm.state} for name, path in sm.adapters.items()]


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [card for sm in state_of(request).models.values() for card in (_card(sm), *_adapter_cards(sm))]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """One model (``client.models.retrieve``); 404 in OpenAI's shape naming the served ones."""
    return _card(state_of(request).served(model_id))


@router.post("/v1/models/{model_id:path}/load")
async def load_model(model_id: str, request: Request) -> dict[str, Any]:
    """Load the model now (making room as a request would); its card once loaded."""
    st = state_of(request)
    sm = st.served(model_id)
    await st.pool.load(sm)
    return _card(sm)


@router.post("/v1/models/{model_id:path}/unload")
async def unload_model(model_id: str, request: Request) -> dict[str, Any]:
    """Unload the model now; 409 while requests use it, or when it is pinned."""
    st = state_of(request)
    sm = st.served(model_id)
    await st.pool.unload(sm)
    return _card(sm)
