"""``create_app``: the ASGI app over loaded ``LLM`` objects, put together from the serving modules."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from lmdock._config.server import ServerConfig
from lmdock.server import (
    serving_chat,
    serving_completion,
    serving_health,
    serving_messages,
    serving_models,
    serving_pooling,
    serving_responses,
    serving_tokenize,
)
from lmdock.server._errors import install_error_handlers, json_error
from lmdock.server._guard import Guard
from lmdock.server._metrics import Metrics
from lmdock.server._pool import HoldRelease, ServedModel, ServedPool
from lmdock.server._state import ServerState, engine_stats

#: One router per endpoint family, in the order their routes are matched.
ROUTERS = (serving_health, serving_models, serving_tokenize, serving_completion, serving_chat, serving_pooling,
           serving_responses, serving_messages)


def create_app(models: list[ServedModel], settings: ServerConfig | None = None, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving ``models`` (the first is the default when a request names none).  A model
    handed over loaded stays loaded; one with a ``loader`` and no ``llm`` is loaded when a request names it."""
    settings = settings or ServerConfig()
    if not models:
        raise ValueError("create_app needs at least one model")
    served = {m.name: m for m in models}
    metrics = Metrics(lambda: {name: engine_stats(m) for name, m in served.items()},
                      lambda: {name: (m.llm is not None, m.memory_bytes) for name, m in served.items()},
                      names=settings.metric_names)
    pool = ServedPool(served, settings, metrics)
    state = ServerState(served, settings, api_key, metrics, pool)
    app = FastAPI(title="lmdock", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lmdock = state
    install_error_handlers(app)
    for module in ROUTERS:
        app.include_router(module.router)
    # Outermost first: body limit, then auth, then CORS (so a preflight needs no key), then drain, then
    # the holds on models, let go when the response has been sent.
    app.add_middleware(HoldRelease, pool=pool)
    app.add_middleware(Guard, state=state)
    if settings.cors_origins:
        app.add_middleware(_cors_middleware(), allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app


def _cors_middleware() -> type:
    """Starlette's CORS middleware, whose refused preflight answers in OpenAI's error body (Starlette's
    own is plain text, which clients parsing JSON errors choke on)."""
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import Response

    class CORS(CORSMiddleware):
        def preflight_response(self, request_headers: Any) -> Response:
            response = super().preflight_response(request_headers)
            if response.status_code != 400:
                return response
            reason = bytes(response.body).decode() or "Disallowed CORS request"
            headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
            return json_error(400, f"{reason}: the origin, method or headers are not in [server] cors_origins", headers=headers)

    return CORS
