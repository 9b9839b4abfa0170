"""For operators: ``/health`` (503 naming a dead engine), ``/metrics`` (Prometheus) and ``/stats`` (engine counts, queue places)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmdock._plugin.errors import LmdockError
from lmdock.server._errors import json_error
from lmdock.server._metrics import CONTENT_TYPE
from lmdock.server._state import engine_stats, state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when every loaded engine takes requests; 503 naming each that does not (shut down, or
    declared dead after failing steps in a row: restart the server).  An unloaded model is not dead:
    the next request for it loads it."""
    st = state_of(request)
    dead = []
    for name, sm in st.models.items():
        if sm.llm is None:
            continue
        try:
            stats = sm.llm.stats()  # raises when shut down
        except LmdockError as exc:
            dead.append(f"{name}: {exc}")
            continue
        except Exception:  # noqa: BLE001 - an engine whose counts fail still takes requests; its steps say otherwise
            stats = {}
        if stats.get("dead"):
            dead.append(f"{name}: the engine failed its steps repeatedly and was declared dead; restart the server")
    if dead:
        return json_error(503, "; ".join(dead), headers={"Retry-After": str(st.retry_after)})
    return JSONResponse({"status": "ok"})


@router.head("/health")
async def health_head(request: Request) -> Response:
    """``HEAD /health``: the same status and headers, no body (load balancers' probe)."""
    return await health(request)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/stats")
async def stats(request: Request) -> dict[str, Any]:
    return {name: {**engine_stats(sm), "in_flight": sm.in_flight, "max_queue": sm.max_queue, "state": sm.state,
                   "memory_bytes": sm.memory_bytes}
            for name, sm in state_of(request).models.items()}
