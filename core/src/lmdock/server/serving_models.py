"""``GET /v1/models`` and ``GET /v1/models/{id}``: every servable model under its config name, with its
state (loaded / loading / unloaded), the memory its last load measured and its last use; ``POST
/v1/models/{id}/load`` and ``/unload`` load and unload one (llama.cpp's router routes); vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add and remove a model's ``MODEL:ADAPTER``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from lmdock._llm.lora import ADAPTER_NAME, LoRARequest, read_lora_adapter
from lmdock._plugin.errors import LmdockError, listed
from lmdock.server._errors import APIError
from lmdock.server._protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from lmdock.server._state import ServedModel, ServerState, state_of

router = APIRouter()

#: Adapters one model serves at most (declared and loaded at run time): each is a card in
#: ``/v1/models`` and a name a 404 may list, so their number is the server's to bound.
MAX_ADAPTERS = 128
#: The longest ``lora_path`` taken (Linux's PATH_MAX).
MAX_PATH = 4096


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


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """vLLM's: serve a PEFT adapter folder as ``MODEL:lora_name`` from now on (it loads on first use);
    403 unless ``[server] allow_runtime_lora_updating``; 400 for a name in use or a folder that is not one."""
    st = state_of(request)
    sm = _updatable(st, body.model)
    if not ADAPTER_NAME.fullmatch(body.lora_name):
        raise APIError(400, f"lora_name {listed([body.lora_name])!r}: an adapter name is 1 to 64 letters, digits, '.', '_' "
                            "and '-'", param="lora_name")
    if body.lora_name in sm.adapters:
        raise APIError(400, f"The lora adapter {body.lora_name!r} has already been loaded on {sm.name!r}", param="lora_name")
    if len(sm.adapters) >= MAX_ADAPTERS:
        raise APIError(400, f"model {sm.name!r} serves {len(sm.adapters)} adapters, the most one model takes: unload one "
                            "first (/v1/unload_lora_adapter)", param="lora_name")
    path = await asyncio.to_thread(_checked_adapter, body.lora_name, body.lora_path)  # disk reads off the event loop
    sm.adapters[body.lora_name] = path
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


def _checked_adapter(name: str, path: str) -> str:
    """The adapter folder's resolved path, once its config and weights' header read as a PEFT LoRA
    adapter (so a bad folder is a 400 here, not on first use); errors name the folder as sent,
    never what its files hold."""
    where = listed([path], width=200)
    if len(path) > MAX_PATH or "\0" in path:
        raise APIError(400, f"lora_path {where!r} is not a path (at most {MAX_PATH} characters, no NUL)", param="lora_path")
    try:
        if not (Path(path) / "adapter_config.json").is_file():
            raise APIError(400, f"lora_path {where!r} has no adapter_config.json: an adapter is a PEFT folder", param="lora_path")
        resolved = str(Path(path).resolve())
    except OSError as exc:
        raise APIError(400, f"lora_path {where!r} cannot be read ({exc.strerror})", param="lora_path") from None
    try:
        read_lora_adapter(LoRARequest(name, resolved))
    except LmdockError as exc:
        raise APIError(400, str(exc).replace(resolved, path), param="lora_path") from None
    return resolved


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """vLLM's: stop serving ``MODEL:lora_name`` (later requests for it get 404); 404 for an unknown one."""
    st = state_of(request)
    sm = _updatable(st, body.model)
    if sm.adapters.pop(body.lora_name, None) is None:
        raise APIError(404, f"The lora adapter {body.lora_name!r} cannot be found on {sm.name!r}", param="lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _updatable(st: ServerState, model: str | None) -> ServedModel:
    if not st.settings.allow_runtime_lora_updating:
        raise APIError(403, "loading and unloading LoRA adapters at run time is off: set [server] allow_runtime_lora_updating = true "
                            "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), or declare adapters under [models.NAME.adapters]")
    return st.served(model)
