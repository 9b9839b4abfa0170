"""``create_app``: the ASGI app over loaded ``LLM`` objects, put together from the serving modules."""

from __future__ import annotations

from fastapi import FastAPI

from lmdock._params import ServerConfig
from lmdock.server import (
    serving_chat,
    serving_completion,
    serving_health,
    serving_models,
    serving_pooling,
    serving_tokenize,
)
from lmdock.server._errors import install_error_handlers
from lmdock.server._guard import Guard
from lmdock.server._metrics import Metrics
from lmdock.server._state import ServedModel, ServerState, engine_stats

#: One router per endpoint family, in the order their routes are matched.
ROUTERS = (serving_health, serving_models, serving_tokenize, serving_completion, serving_chat, serving_pooling)


def create_app(models: list[ServedModel], settings: ServerConfig | None = None, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving ``models`` (the first is the default when a request names none)."""
    settings = settings or ServerConfig()
    if not models:
        raise ValueError("create_app needs at least one model")
    served = {m.name: m for m in models}
    metrics = Metrics(lambda: {name: engine_stats(m) for name, m in served.items()})
    state = ServerState(served, settings, api_key, metrics)
    app = FastAPI(title="lmdock", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lmdock = state
    install_error_handlers(app)
    for module in ROUTERS:
        app.include_router(module.router)
    # Outermost first: body limit, then auth, then CORS (so a preflight needs no key), then drain.
    app.add_middleware(Guard, state=state)
    if settings.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app
