"""Several models in one server: the core's :class:`lmdock.ModelPool` (``lmdock/_models/pool.py``: loading,
measuring, making room, keep_alive) under the server's event loop and HTTP errors.

A route takes its model with ``await st.model(name, request)`` (:meth:`ServedPool.acquire`): the pool
holds it and, when it is not loaded, loads it on the pool's worker thread while the event loop awaits
(requests that arrive meanwhile wait for the same load, up to the model's queue bound, then 429).  The
hold lasts until :class:`HoldRelease`, the ASGI middleware around the app, has seen the response sent,
streams included (a FastAPI dependency with ``yield`` ends before a stream does).  A held model, or one
with sequences in its engine, is never unloaded.  A load the pool cannot make room for is a 503 with
Retry-After naming the models that hold the memory; a failed load, a 500 with the loader's error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmdock._config.model import ModelConfig
from lmdock._config.server import ServerConfig
from lmdock._models.pool import ModelPool
from lmdock._models.pooled import ModelBusyError, PooledModel, PoolFullError
from lmdock.server import _images as images
from lmdock.server._errors import APIError
from lmdock.server._metrics import Metrics

#: The ASGI scope key holding the models a request took (released by :class:`HoldRelease`).
HOLDS = "lmdock.holds"


@dataclass(eq=False)  # one model: compared by identity
class ServedModel(PooledModel):
    """One model the server answers for: the pool's entry (name, ``LLM`` or None while unloaded, loader,
    keep_alive, pin, holds) with its admission bound and what routes show of it.

    ``in_flight``: sequences the server has in its engine; ``waiting``: requests waiting for its load."""

    max_queue: int
    chat_template: str | None = None
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    root: str = ""
    waiting: int = 0
    #: ``[models.NAME.adapters]``: LoRA adapters by name, served as ``NAME:ADAPTER`` on this model's engine
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.llm is not None:
            self.root = self.root or str(getattr(getattr(self.llm, "model_config", None), "model", "") or "")

    @property
    def busy(self) -> bool:
        """Whether a request holds the model (or waits for it) or has sequences in its engine."""
        return self.holds > 0 or self.in_flight > 0

    @property
    def hide(self) -> tuple[str, str]:
        """``(the model's path or hub id, its served name)``: errors show clients the name only."""
        return (self.root, self.name)


def queue_limit(settings: ServerConfig, config: ModelConfig) -> int:
    """A model's admission bound: ``[server] max_queue``, else its scheduler's seats and waiting room."""
    return settings.max_queue or (config.scheduler.max_num_seqs + config.scheduler.max_waiting)


class ServedPool:
    """The served models in a :class:`lmdock.ModelPool`, awaited from the event loop, its errors as HTTP's."""

    def __init__(self, models: dict[str, ServedModel], settings: ServerConfig, metrics: Metrics) -> None:
        self.models = models
        self.settings = settings
        self.metrics = metrics
        self.core = ModelPool(memory_budget_gib=settings.memory_budget_gib, max_loaded_models=settings.max_loaded_models,
                              models=models.values(), on_load=self._loaded, on_unload=self._unloaded)

    def _loaded(self, sm: PooledModel, seconds: float) -> None:
        assert isinstance(sm, ServedModel)
        sm.root, sm.max_queue = str(sm.llm.model_config.model), queue_limit(self.settings, sm.llm.model_config)
        sm.llm.image_limits = images.limits(self.settings)  # [server]'s bounds on request images
        self.metrics.model_loads.labels(sm.name).inc()
        self.metrics.model_load_seconds.labels(sm.name).observe(seconds)

    def _unloaded(self, sm: PooledModel, reason: str) -> None:
        self.metrics.model_unloads.labels(sm.name, reason).inc()

    # -- what routes call -----------------------------------------------------------------------

    async def acquire(self, sm: ServedModel, scope: dict[str, Any], keep_alive: float | None = None) -> ServedModel:
        """``sm`` loaded and held for the request of ``scope`` (:class:`HoldRelease` lets go of it).
        ``keep_alive``: the request's (Ollama's), the model's from now on."""
        if sm.llm is None and sm.waiting >= sm.max_queue:
            raise APIError(429, f"model {sm.name!r} is loading and {sm.waiting} requests wait for it, its limit "
                                "([server] max_queue); retry after the Retry-After seconds",
                           headers={"Retry-After": str(self.settings.retry_after)})
        try:
            fut = self.core.hold(sm.name, keep_alive=keep_alive)
        except ValueError as exc:
            raise APIError(400, str(exc), param="keep_alive") from None
        scope[HOLDS].append(sm)
        await self._wait(sm, fut)
        return sm

    def release(self, sm: ServedModel) -> None:
        self.core.release(sm.name)

    async def load(self, sm: ServedModel) -> None:
        """Load ``sm`` now (``POST /v1/models/{name}/load``)."""
        await self._wait(sm, self.core.start_load(sm.name))

    async def unload(self, sm: ServedModel) -> None:
        """Unload ``sm`` now (``POST /v1/models/{name}/unload``); 409 when it is pinned or in use."""
        try:
            await asyncio.to_thread(self.core.unload, sm.name)
        except ModelBusyError as exc:
            headers = None if sm.pin or sm.loader is None else {"Retry-After": str(self.settings.retry_after)}
            raise APIError(409, str(exc), param="model", headers=headers) from None

    def preload(self, sm: ServedModel) -> None:
        """Load ``sm`` before the server takes requests (named, default, pinned and preloaded models)."""
        self.core.preload(sm.name)

    def start(self) -> None:
        """Start the keep_alive reaper (at the server's start)."""
        self.core.start()

    def close(self) -> None:
        """Shut every loaded model down (the server is exiting)."""
        self.core.close()

    async def _wait(self, sm: ServedModel, fut: Any) -> None:
        """Await ``sm``'s load (``fut``, the pool's), its errors in the client's terms."""
        if fut.done() and fut.exception() is None:
            return
        sm.waiting += 1
        try:
            await asyncio.shield(asyncio.wrap_future(fut))  # a client that leaves does not cancel the others' load
        except PoolFullError as exc:
            raise APIError(503, f"{exc}; retry after the Retry-After seconds", code="model_pool_full",
                           headers={"Retry-After": str(self.settings.retry_after)}) from None
        except Exception as exc:  # the loader's own error, in the client's terms
            text = str(exc).replace(sm.root, sm.name) if sm.root else str(exc)
            raise APIError(500, f"model {sm.name!r} failed to load: {type(exc).__name__}: {text}",
                           code="model_load_failed") from None
        finally:
            sm.waiting -= 1


class HoldRelease:
    """ASGI middleware: lets go of the models a request took once its response has been sent."""

    def __init__(self, app: Any, pool: ServedPool) -> None:
        self.app = app
        self.pool = pool

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holds: list[ServedModel] = []
        scope[HOLDS] = holds
        try:
            await self.app(scope, receive, send)
        finally:
            for sm in holds:
                self.pool.release(sm)
