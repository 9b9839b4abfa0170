"""Several models in one server: load on first request, unload under a memory budget, never a busy model.

A route takes its model with ``await st.model(name, request)`` (:meth:`ModelPool.acquire`): a model
that is not loaded is loaded off the event loop (requests that arrive meanwhile wait for the same
load, up to the model's queue bound, then 429), and the model is *held* until :class:`HoldRelease`,
the ASGI middleware around the app, has seen the response sent, streams included (a FastAPI
dependency with ``yield`` ends before a stream does).  A held model, or one with sequences in its
engine, is never unloaded.

Loads and unloads happen one at a time, so the budget is decided in order: before a load, and again
once the load has measured what it took, the pool makes room under ``[server] memory_budget_gib``
and ``max_loaded_models`` by unloading the least recently used idle model, then the next; when
only busy or pinned models are left, the request gets 503 with Retry-After naming them.  A reaper
task unloads models idle past their ``keep_alive``.

Memory is measured, never guessed from file sizes: the process's resident set (plus the GPU memory
torch holds when torch has a GPU up) across the load, then what the model's unload gave back, the
larger of the two at its next load.  The first load of a backend also counts the backend's imports
(torch, transformers), which stay after an unload; weights a backend maps from disk count as they
are first read, after the load; the unload's measure sees both right.  An engine that runs in other
processes is not seen by this measure.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmdock._params import ModelConfig, ServerConfig
from lmdock.server._errors import APIError
from lmdock.server._metrics import Metrics

log = logging.getLogger("lmdock.server")

#: The ASGI scope key holding the models a request took (released by :class:`HoldRelease`).
HOLDS = "lmdock.holds"
_GIB = 2**30


@dataclass(eq=False)  # one model: compared by identity
class ServedModel:
    """One model the server answers for: its public name, the ``LLM`` (None while unloaded), its
    admission bound, and what the pool (``_pool.py``) needs to load it again and decide when to unload.

    ``loader`` builds the ``LLM``; without one the model was handed over loaded and stays so.
    ``holds``: requests that took the model and have not finished sending their answer (a held model
    is never unloaded)."""

    name: str
    llm: Any
    max_queue: int
    chat_template: str | None = None
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    loader: Callable[[], Any] | None = None
    root: str = ""
    keep_alive: float = -1
    pin: bool = False
    holds: int = 0
    waiting: int = 0
    last_used: float = 0.0  # time.time() of the last request's end; 0: never used
    memory_bytes: int | None = None
    loading: Any = None  # the asyncio future of a load under way
    unloading: bool = False  # its engine is being shut down (``llm`` is None already)
    #: ``[models.NAME.adapters]``: LoRA adapters by name, served as ``NAME:ADAPTER`` on this model's engine
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.llm is not None:
            self.root = self.root or str(getattr(getattr(self.llm, "model_config", None), "model", "") or "")

    @property
    def state(self) -> str:
        """``loaded``, ``loading``, ``unloading`` or ``unloaded``."""
        if self.llm is not None:
            return "loaded"
        return "loading" if self.loading is not None else "unloading" if self.unloading else "unloaded"

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


_DURATION = re.compile(r"(\d+(?:\.\d*)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: float | str) -> float:
    """Ollama's ``keep_alive``: seconds, or a Go duration (``"5m"``, ``"1h30m"``, ``"300ms"``); negative
    is for ever (-1).  Anything else is a ValueError saying what to send."""
    if isinstance(value, str):
        text = value.strip()
        sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
        try:
            seconds = float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"{value!r} is not a duration: send seconds, or a duration such as '5m', '1h30m', '-1'") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
        value = sign * seconds
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a duration: send seconds, or a duration such as '5m', '1h30m', '-1'")
    return -1.0 if value < 0 else float(value)


def resident_bytes() -> int:
    """The process's resident memory now, plus the GPU memory torch has reserved if it has a GPU up."""
    try:
        with open("/proc/self/statm", "rb") as f:
            total = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux
        try:
            import psutil
        except ImportError:
            return 0
        total = psutil.Process().memory_info().rss
    torch = sys.modules.get("torch")  # never imported here: only a process that already has it has a GPU up
    if torch is not None and torch.cuda.is_initialized():
        total += sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))
    return total


def _free(box: list[Any]) -> None:
    """Shut the LLM in ``box`` down and give its memory back: the last reference goes, then the cycles,
    then the GPU cache and glibc's free lists (without ``malloc_trim`` freed heap stays resident)."""
    llm = box.pop()
    llm.shutdown()
    del llm
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl)
            pass


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / _GIB:.2f}"


class ModelPool:
    """The served models, loaded on demand under ``[server] memory_budget_gib`` and ``max_loaded_models``."""

    def __init__(self, models: dict[str, ServedModel], settings: ServerConfig, metrics: Metrics) -> None:
        self.models = models
        self.settings = settings
        self.metrics = metrics
        self.budget = None if settings.memory_budget_gib is None else int(settings.memory_budget_gib * _GIB)
        self._lock: asyncio.Lock | None = None  # made in the server's loop, by start()
        self._wake: asyncio.Event | None = None
        self._reaper: asyncio.Task[None] | None = None

    # -- what routes call -----------------------------------------------------------------------

    async def acquire(self, sm: ServedModel, scope: dict[str, Any], keep_alive: float | None = None) -> ServedModel:
        """``sm`` loaded and held for the request of ``scope`` (:class:`HoldRelease` lets go of it).
        ``keep_alive``: the request's (Ollama's), the model's from now on."""
        if keep_alive is not None:
            if sm.pin or sm.loader is None:
                raise APIError(400, f"keep_alive: model {sm.name!r} is pinned: it stays loaded whatever a request asks; "
                                    "leave keep_alive out", param="keep_alive")
            sm.keep_alive = keep_alive
        self.start()
        sm.holds += 1  # held before the load: a model a request waits for is not evicted meanwhile
        scope[HOLDS].append(sm)
        if sm.llm is None:
            await self._wait_for_load(sm)
        sm.last_used = time.time()
        return sm

    def release(self, sm: ServedModel) -> None:
        sm.holds -= 1
        sm.last_used = time.time()
        if sm.holds == 0 and self._wake is not None:
            self._wake.set()  # keep_alive counts from now

    async def load(self, sm: ServedModel) -> None:
        """Load ``sm`` now (``POST /v1/models/{name}/load``)."""
        self.start()
        if sm.llm is None:
            await self._wait_for_load(sm)
        sm.last_used = time.time()

    async def unload(self, sm: ServedModel) -> None:
        """Unload ``sm`` now (``POST /v1/models/{name}/unload``); 409 when it is pinned or in use."""
        self.start()
        if sm.loader is None or sm.pin:
            why = "pinned ([models.NAME] pin)" if sm.pin else "handed to the server loaded, so it could not be loaded again"
            raise APIError(409, f"model {sm.name!r} is {why}; it stays loaded", param="model")
        assert self._lock is not None
        async with self._lock:
            if sm.llm is None:
                return
            if sm.busy:
                raise APIError(409, f"model {sm.name!r} has {sm.holds} requests in flight; unload it when they finish",
                               param="model", headers={"Retry-After": str(self.settings.retry_after)})
            await self._unload(sm, "request")

    def preload(self, sm: ServedModel) -> None:
        """Load ``sm`` before the server takes requests (pinned and preloaded models)."""
        self._load_sync(sm)

    def start(self) -> None:
        """Make the lock and start the keep_alive reaper, in the server's event loop (at its startup, or at the
        first request of an app served otherwise)."""
        if self._reaper is None:
            self._lock, self._wake = asyncio.Lock(), asyncio.Event()
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    # -- loading --------------------------------------------------------------------------------

    async def _wait_for_load(self, sm: ServedModel) -> None:
        if sm.waiting >= sm.max_queue:
            raise APIError(429, f"model {sm.name!r} is loading and {sm.waiting} requests wait for it, its limit "
                                "([server] max_queue); retry after the Retry-After seconds",
                           headers={"Retry-After": str(self.settings.retry_after)})
        if sm.loading is None:
            sm.loading = asyncio.ensure_future(self._load(sm))
            sm.loading.add_done_callback(functools.partial(_load_done, sm))
        sm.waiting += 1
        try:
            await asyncio.shield(sm.loading)  # a client that leaves does not cancel the others' load
        finally:
            sm.waiting -= 1

    async def _load(self, sm: ServedModel) -> None:
        assert self._lock is not None
        async with self._lock:
            if sm.llm is not None:
                return
            await self._make_room(sm)
            try:
                await asyncio.to_thread(self._load_sync, sm)
            except Exception as exc:  # the loader's own error, in the client's terms
                text = str(exc).replace(sm.root, sm.name) if sm.root else str(exc)
                log.error("loading model %r failed", sm.name, exc_info=exc)
                raise APIError(500, f"model {sm.name!r} failed to load: {type(exc).__name__}: {text}",
                               code="model_load_failed") from None
            try:  # the load is measured now: over the budget, idle models make room, or this one goes
                await self._make_room(sm)
            except APIError:
                await self._unload(sm, "evicted")
                raise

    def _load_sync(self, sm: ServedModel) -> None:
        """Run ``sm``'s loader and measure what the load took; its errors go up as they are."""
        if sm.loader is None:
            raise RuntimeError(f"model {sm.name!r} is not loaded and has no loader")
        before, t0 = resident_bytes(), time.perf_counter()
        llm = sm.loader()
        seconds = time.perf_counter() - t0
        sm.memory_bytes = max(resident_bytes() - before, sm.memory_bytes or 0)  # at least what its last unload freed
        sm.llm, sm.root = llm, str(llm.model_config.model)
        sm.max_queue = queue_limit(self.settings, llm.model_config)
        sm.last_used = time.time()
        self.metrics.model_loads.labels(sm.name).inc()
        self.metrics.model_load_seconds.labels(sm.name).observe(seconds)
        log.info("loaded model %r in %.2f s (%s GiB)", sm.name, seconds, _gib(sm.memory_bytes))

    # -- making room ----------------------------------------------------------------------------

    def _short(self, sm: ServedModel, gone: list[ServedModel] | None = None) -> str | None:
        """Why ``sm`` (loaded, or about to be) does not fit beside the other loaded models (less ``gone``), or None."""
        others = [m for m in self.models.values() if m is not sm and m.llm is not None and m not in (gone or ())]
        limit = self.settings.max_loaded_models
        if limit is not None and len(others) + 1 > limit:
            return f"{len(others)} models are loaded and [server] max_loaded_models is {limit}"
        if self.budget is not None:
            used, need = sum(m.memory_bytes or 0 for m in others), sm.memory_bytes
            if used + (need or 0) > self.budget or (need is None and used >= self.budget):
                return (f"the loaded models take {_gib(used)} GiB, model {sm.name!r} {_gib(need)} GiB (measured), "
                        f"and [server] memory_budget_gib is {self.settings.memory_budget_gib}")
        return None

    def _idle(self, sm: ServedModel) -> list[ServedModel]:
        """The loaded models other than ``sm`` that may be unloaded, least recently used first."""
        return sorted((m for m in self.models.values() if m is not sm and m.llm is not None and _evictable(m)),
                      key=lambda m: m.last_used)

    def _victims(self, sm: ServedModel) -> list[ServedModel]:
        """The idle models to unload so that ``sm`` fits; 503 naming the loaded ones when they are not enough."""
        victims: list[ServedModel] = []
        idle = self._idle(sm)
        while (why := self._short(sm, victims)) is not None:
            if not idle:
                raise self._full(sm, why)
            victims.append(idle.pop(0))
        return victims

    async def _make_room(self, sm: ServedModel) -> None:
        """Unload idle models, least recently used first, until ``sm`` fits.  Each is chosen again after
        the previous unload: a request may have taken it meanwhile."""
        while victims := self._victims(sm):  # 503 before any unload when all the idle ones would not do
            await self._unload(victims[0], "evicted")

    def _full(self, sm: ServedModel, why: str) -> APIError:
        held = [f"{m.name!r} ({'pinned' if m.pin else f'{m.holds} requests'}, {_gib(m.memory_bytes)} GiB)"
                for m in self.models.values() if m is not sm and m.llm is not None]
        return APIError(503, f"cannot load model {sm.name!r}: {why}, and the loaded models are in use or pinned: "
                             f"{', '.join(held) or 'none'}; retry after the Retry-After seconds",
                        code="model_pool_full", headers={"Retry-After": str(self.settings.retry_after)})

    async def _unload(self, sm: ServedModel, reason: str) -> None:
        """Unload ``sm`` (the lock held; ``sm`` idle).  ``llm`` is None at once, before the first await."""
        box, sm.llm, sm.unloading = [sm.llm], None, True
        before = resident_bytes()
        try:
            await asyncio.to_thread(_free, box)
        finally:
            sm.unloading = False
        freed = max(before - resident_bytes(), 0)
        # what came back is the model's: not the backend's imports (which its first load counted), but the
        # weights it touched after the load (mmap-ed files count as they are read)
        sm.memory_bytes = freed
        self.metrics.model_unloads.labels(sm.name, reason).inc()
        log.info("unloaded model %r (%s): %s GiB resident freed", sm.name, reason, _gib(freed))

    # -- keep_alive -----------------------------------------------------------------------------

    def _expired(self, now: float) -> list[ServedModel]:
        return [m for m in self.models.values()
                if m.llm is not None and m.keep_alive >= 0 and _evictable(m) and now - m.last_used >= m.keep_alive]

    def _next_expiry(self, now: float) -> float | None:
        due = [m.last_used + m.keep_alive - now for m in self.models.values()
               if m.llm is not None and m.keep_alive >= 0 and _evictable(m)]
        return max(min(due), 0.0) if due else None

    async def _reap(self) -> None:
        """Unload each idle model past its keep_alive; woken early when a model turns idle."""
        assert self._lock is not None and self._wake is not None
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._next_expiry(time.time()))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            for sm in self._expired(time.time()):
                async with self._lock:
                    if sm in self._expired(time.time()):
                        try:
                            await self._unload(sm, "keep_alive")
                        except Exception:  # noqa: BLE001 - the reaper outlives one engine's failing shutdown
                            log.exception("unloading model %r failed", sm.name)


def _evictable(m: ServedModel) -> bool:
    return m.loader is not None and not m.pin and not m.busy and m.loading is None


def _load_done(sm: ServedModel, fut: asyncio.Future[None]) -> None:
    sm.loading = None  # the next request after a failed load tries again
    if not fut.cancelled():
        fut.exception()  # retrieved: each waiter has raised it


class HoldRelease:
    """ASGI middleware: lets go of the models a request took once its response has been sent."""

    def __init__(self, app: Any, pool: ModelPool) -> None:
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
