"""Several models in one process: load on first use, unload under a memory budget, never a model in use.

``ModelPool`` holds models by name, each with a loader (``LLM(name, config=...)`` for a config file's
models).  ``with pool.use("a") as llm:`` loads ``a`` when it is not loaded and *holds* it while inside;
a held model is never unloaded.  :meth:`ModelPool.hold` is the same without blocking: it holds the
model and returns a future of its ``LLM`` (``lmdock serve`` awaits it, so its event loop never waits
for a load, and lets go of the model once a response has been sent: ``server/_pool.py``).

Loads and unloads run one at a time, on the pool's worker thread, so room is decided in order: before a
load, and again once the load has measured what it took, the pool makes room under
``memory_budget_gib`` and ``max_loaded_models`` by unloading the least recently used idle model, then
the next; when only held or pinned models are left, :class:`PoolFullError` names them.  Concurrent
first uses of a model share one load, and a failed load fails each of them with the loader's error.
A reaper thread unloads models idle past their ``keep_alive``.

Memory is measured across each load and unload (:mod:`lmdock._models.memory`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lmdock._models.memory import GIB, free_llm, gib, resident_bytes
from lmdock._models.pooled import ModelBusyError, PooledModel, PoolFullError, keep_alive_seconds

log = logging.getLogger("lmdock.pool")


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class ModelPool:
    """Models loaded on first use under ``memory_budget_gib`` and ``max_loaded_models``; thread-safe.

    ``config``: a config file whose ``[models.NAME]`` entries the pool holds (with their ``keep_alive``,
    ``pin`` and ``preload``; pinned and preloaded ones are loaded now) and whose ``[server]``
    ``memory_budget_gib`` / ``max_loaded_models`` apply where the arguments are None.  ``models``:
    entries made elsewhere (the server's).  ``on_load(model, seconds)`` and ``on_unload(model, reason)``
    are called on the pool's worker thread after each load and unload (reason: ``evicted``,
    ``keep_alive``, ``request``, ``close``)."""

    def __init__(self, config: str | os.PathLike[str] | None = None, *, memory_budget_gib: float | None = None,
                 max_loaded_models: int | None = None, models: Iterable[PooledModel] = (),
                 on_load: Callable[[PooledModel, float], None] | None = None,
                 on_unload: Callable[[PooledModel, str], None] | None = None) -> None:
        from lmdock._config.file import load_config

        cfg = load_config(config) if config is not None else None
        if memory_budget_gib is None and cfg is not None:
            memory_budget_gib = cfg.server.memory_budget_gib
        if max_loaded_models is None and cfg is not None:
            max_loaded_models = cfg.server.max_loaded_models
        if memory_budget_gib is not None and not memory_budget_gib > 0:
            raise ValueError(f"memory_budget_gib must be > 0 (GiB), got {memory_budget_gib!r}; None for no bound")
        if max_loaded_models is not None and (isinstance(max_loaded_models, bool) or not isinstance(max_loaded_models, int)
                                              or max_loaded_models < 1):
            raise ValueError(f"max_loaded_models must be an int >= 1, got {max_loaded_models!r}; None for no bound")
        self.memory_budget_gib = memory_budget_gib
        self.max_loaded_models = max_loaded_models
        self.budget = None if memory_budget_gib is None else int(memory_budget_gib * GIB)
        self.on_load, self.on_unload = on_load, on_unload
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # the reaper waits on it
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="lmdock-pool")  # loads and unloads, in order
        self._reaper: threading.Thread | None = None
        self._closed = False
        self._models: dict[str, PooledModel] = {}
        for m in models:
            self._add(m)
        if cfg is not None:
            self._add_config(cfg)

    def _add_config(self, cfg: Any) -> None:
        from lmdock._llm.facade import LLM

        for name, mc in cfg.models.items():
            self.add(name, functools.partial(LLM, name, config=cfg.path), keep_alive=mc.keep_alive, pin=mc.pin)
        try:
            for name, mc in cfg.models.items():
                if mc.pin or mc.preload:
                    self.preload(name)
        except BaseException:
            self.close()
            raise

    # -- what users call ------------------------------------------------------------------------

    def add(self, name: str, loader: Callable[[], Any], *, keep_alive: float | str = -1.0, pin: bool = False) -> None:
        """Hold ``name``, loaded by ``loader()`` (an ``LLM``) when first used.  ``keep_alive``: seconds idle
        before it is unloaded (0: once let go; -1: never); ``pin``: never unloaded (it still loads on first use)."""
        self._add(PooledModel(name, None, loader=loader, keep_alive=keep_alive_seconds(keep_alive), pin=pin))

    def _add(self, m: PooledModel) -> None:
        with self._lock:
            if m.name in self._models:
                raise ValueError(f"model {m.name!r} is in the pool already")
            self._models[m.name] = m

    def hold(self, name: str, *, keep_alive: float | str | None = None) -> Future[Any]:
        """Hold model ``name`` (nothing unloads it until :meth:`release`) and return a future of its ``LLM``:
        done now when it is loaded, else when the load (started now, or under way) ends.  A failed load's
        future raises the loader's error, or :class:`PoolFullError`; the hold stays until released.
        ``keep_alive`` (seconds or ``"5m"``, Ollama's) becomes the model's from now on; a ValueError on a
        pinned model."""
        m = self._model(name)
        seconds = None if keep_alive is None else keep_alive_seconds(keep_alive)
        with self._lock:
            if seconds is not None:
                if m.pin or m.loader is None:
                    raise ValueError(f"keep_alive: model {name!r} is pinned: it stays loaded whatever a request asks; "
                                     "leave keep_alive out")
                m.keep_alive = seconds
            fut = self._loaded(m)
            m.holds += 1  # held before the load: a model someone waits for is not evicted meanwhile
            m.last_used = time.time()
            return fut

    def release(self, name: str) -> None:
        """Let go of a hold taken by :meth:`hold`; ``keep_alive`` counts from the last release."""
        m = self._model(name)
        with self._lock:
            if m.holds <= 0:
                raise ValueError(f"model {name!r} is not held: release() once per hold()")
            m.holds -= 1
            m.last_used = time.time()
            self._changed.notify_all()

    def acquire(self, name: str, *, keep_alive: float | str | None = None, timeout: float | None = None) -> Any:
        """:meth:`hold` and wait for the ``LLM``; on an error the hold is let go.  Pair with :meth:`release`."""
        fut = self.hold(name, keep_alive=keep_alive)
        try:
            return fut.result(timeout)
        except BaseException:
            self.release(name)
            raise

    @contextlib.contextmanager
    def use(self, name: str, *, keep_alive: float | str | None = None) -> Iterator[Any]:
        """``with pool.use(name) as llm:`` the model loaded, and held (never unloaded) while inside."""
        llm = self.acquire(name, keep_alive=keep_alive)
        try:
            yield llm
        finally:
            self.release(name)

    def load(self, name: str) -> Any:
        """Load ``name`` now, making room as a first use would (it is not held); its ``LLM``."""
        with self._lock:
            fut = self._loaded(self._model(name))
        return fut.result()

    def start_load(self, name: str) -> Future[Any]:
        """:meth:`load` without waiting: a future of the ``LLM``."""
        with self._lock:
            return self._loaded(self._model(name))

    def preload(self, name: str) -> Any:
        """Load ``name`` now whatever memory it takes (pinned and preloaded models, at start): the budget
        applies from then on; ``max_loaded_models`` still does."""
        m = self._model(name)
        return self._worker.submit(self._load, m, False).result()

    def unload(self, name: str, reason: str = "request") -> None:
        """Unload ``name`` now; :class:`ModelBusyError` when it is pinned or held."""
        m = self._model(name)
        if m.loader is None or m.pin:
            why = "pinned ([models.NAME] pin)" if m.pin else "handed over loaded, so it could not be loaded again"
            raise ModelBusyError(f"model {name!r} is {why}; it stays loaded")
        self._worker.submit(self._unload_idle, m, reason).result()

    def models(self) -> dict[str, dict[str, Any]]:
        """Each model's ``state``, ``memory_bytes`` (measured; None before its first load), ``last_used``,
        ``holds``, ``keep_alive`` and ``pin``, by name."""
        with self._lock:
            return {m.name: {"state": m.state, "memory_bytes": m.memory_bytes, "last_used": m.last_used or None,
                             "holds": m.holds, "keep_alive": m.keep_alive, "pin": m.pin} for m in self._models.values()}

    def start(self) -> None:
        """Start the keep_alive reaper (done on first use; the server does it at start)."""
        with self._lock:
            self._start_reaper()

    def close(self) -> None:
        """Shut every loaded model down and stop the pool's threads; the pool takes no more work."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        self._worker.submit(self._unload_all).result()
        self._worker.shutdown()
        if self._reaper is not None:
            self._reaper.join()

    def __enter__(self) -> ModelPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        states = ", ".join(f"{m.name}: {m.state}" for m in self._models.values())
        return f"ModelPool({states}; memory_budget_gib={self.memory_budget_gib}, max_loaded_models={self.max_loaded_models})"

    # -- loading --------------------------------------------------------------------------------

    def _model(self, name: str) -> PooledModel:
        m = self._models.get(name)
        if m is None:
            raise KeyError(f"no model named {name!r} in the pool; models: {', '.join(self._models) or 'none'}")
        return m

    def _loaded(self, m: PooledModel) -> Future[Any]:
        """(the lock held) A future of ``m``'s LLM: done when loaded, else its load, started when none is."""
        if self._closed:
            raise RuntimeError("the model pool is closed")
        self._start_reaper()
        if m.llm is not None:
            return _done(m.llm)
        if m.loading is None:
            m.loading = Future()
            m.loading.set_running_or_notify_cancel()  # a waiter that leaves cannot cancel the others' load
            self._worker.submit(self._run_load, m, m.loading)
        return m.loading

    def _run_load(self, m: PooledModel, fut: Future[Any]) -> None:
        try:
            llm = self._load(m, True)
        except BaseException as exc:  # the loader's own error, for every waiter
            log.error("loading model %r failed", m.name, exc_info=exc)
            self._load_ended(m)
            fut.set_exception(exc)
            return
        self._load_ended(m)
        fut.set_result(llm)

    def _load_ended(self, m: PooledModel) -> None:
        with self._lock:
            m.loading = None  # the next use after a failed load tries again
            self._changed.notify_all()

    def _load(self, m: PooledModel, budget: bool) -> Any:
        """(worker thread) Load ``m`` unless it is loaded; with ``budget``, make room before and after."""
        if m.llm is not None:
            return m.llm
        if budget:
            self._make_room(m)
        elif (why := self._short(m, count_only=True)) is not None:
            raise PoolFullError(f"cannot load model {m.name!r}: {why}")
        self._load_now(m)
        if budget:
            try:  # the load is measured now: over the budget, idle models make room, or this one goes
                self._make_room(m)
            except PoolFullError:
                self._unload(m, "evicted")
                raise
        return m.llm

    def _load_now(self, m: PooledModel) -> None:
        """Run ``m``'s loader and measure what the load took; its errors go up as they are."""
        if m.loader is None:
            raise RuntimeError(f"model {m.name!r} is not loaded and has no loader")
        before, t0 = resident_bytes(), time.perf_counter()
        llm = m.loader()
        seconds = time.perf_counter() - t0
        with self._lock:
            m.memory_bytes = max(resident_bytes() - before, m.memory_bytes or 0)  # at least what its last unload freed
            m.llm, m.last_used = llm, time.time()
        if self.on_load is not None:
            self.on_load(m, seconds)
        log.info("loaded model %r in %.2f s (%s GiB)", m.name, seconds, gib(m.memory_bytes))

    # -- making room ----------------------------------------------------------------------------

    def _short(self, m: PooledModel, gone: list[PooledModel] | None = None, count_only: bool = False) -> str | None:
        """(the lock held) Why ``m`` (loaded, or about to be) does not fit beside the other loaded models
        (less ``gone``), or None."""
        others = [o for o in self._models.values() if o is not m and o.llm is not None and o not in (gone or ())]
        limit = self.max_loaded_models
        if limit is not None and len(others) + 1 > limit:
            return f"{len(others)} models are loaded and max_loaded_models is {limit}"
        if self.budget is not None and not count_only:
            used, need = sum(o.memory_bytes or 0 for o in others), m.memory_bytes
            if used + (need or 0) > self.budget or (need is None and used >= self.budget):
                return (f"the loaded models take {gib(used)} GiB, model {m.name!r} {gib(need)} GiB (measured), "
                        f"and memory_budget_gib is {self.memory_budget_gib}")
        return None

    def _victims(self, m: PooledModel) -> list[PooledModel]:
        """(the lock held) The idle models to unload, least recently used first, so that ``m`` fits;
        PoolFullError naming the loaded ones when they are not enough."""
        idle = sorted((o for o in self._models.values() if o is not m and o.llm is not None and o.evictable),
                      key=lambda o: o.last_used)
        victims: list[PooledModel] = []
        while (why := self._short(m, victims)) is not None:
            if not idle:
                held = [f"{o.name!r} ({'pinned' if o.pin or o.loader is None else f'{o.holds} requests'}, {gib(o.memory_bytes)} GiB)"
                        for o in self._models.values() if o is not m and o.llm is not None]
                raise PoolFullError(f"cannot load model {m.name!r}: {why}, and the loaded models are in use or pinned: "
                                    f"{', '.join(held) or 'none'}")
            victims.append(idle.pop(0))
        return victims

    def _make_room(self, m: PooledModel) -> None:
        """Unload idle models, least recently used first, until ``m`` fits.  Each is chosen (and taken)
        under the lock, again after the previous unload: someone may have taken it meanwhile."""
        while True:
            with self._lock:
                victims = self._victims(m)  # PoolFullError before any unload when all the idle ones would not do
                if not victims:
                    return
                box = self._take(victims[0])
            self._free_taken(victims[0], box, "evicted")

    # -- unloading ------------------------------------------------------------------------------

    def _take(self, m: PooledModel) -> list[Any]:
        """(the lock held) ``m``'s LLM, out of the pool: from now on ``m`` reads ``unloading``."""
        box, m.llm, m.unloading = [m.llm], None, True
        return box

    def _free_taken(self, m: PooledModel, box: list[Any], reason: str) -> None:
        before = resident_bytes()
        try:
            free_llm(box)
            # what came back is the model's: not the backend's imports (which its first load counted), but the
            # weights it touched after the load (mmap-ed files count as they are read)
            m.memory_bytes = max(before - resident_bytes(), 0)
            if self.on_unload is not None:  # before 'unloaded' shows: a client that sees it sees the count
                self.on_unload(m, reason)
        finally:
            with self._lock:
                m.unloading = False
                self._changed.notify_all()
        log.info("unloaded model %r (%s): %s GiB resident freed", m.name, reason, gib(m.memory_bytes))

    def _unload(self, m: PooledModel, reason: str) -> None:
        with self._lock:
            box = self._take(m)
        self._free_taken(m, box, reason)

    def _unload_idle(self, m: PooledModel, reason: str) -> None:
        """(worker thread) Unload ``m`` unless it is unloaded; ModelBusyError while it is held."""
        with self._lock:
            if m.llm is None:
                return
            if m.busy:
                raise ModelBusyError(f"model {m.name!r} has {m.holds} requests in flight; unload it when they finish")
            box = self._take(m)
        self._free_taken(m, box, reason)

    def _unload_all(self) -> None:
        for m in list(self._models.values()):
            if m.llm is not None:
                try:
                    self._unload(m, "close")
                except Exception:  # noqa: BLE001 - one engine's failing shutdown does not keep the others up
                    log.exception("shutting model %r down failed", m.name)

    # -- keep_alive -----------------------------------------------------------------------------

    def _start_reaper(self) -> None:
        """(the lock held)"""
        if self._reaper is None and not self._closed:
            self._reaper = threading.Thread(target=self._reap, name="lmdock-pool-reaper", daemon=True)
            self._reaper.start()

    def _due(self, now: float) -> float | None:
        """(the lock held) Seconds until the next idle model passes its keep_alive (0: one has), or None."""
        due = [m.last_used + m.keep_alive - now for m in self._models.values()
               if m.llm is not None and m.keep_alive >= 0 and m.evictable]
        return max(min(due), 0.0) if due else None

    def _reap(self) -> None:
        """Unload each idle model past its keep_alive; woken early when a model turns idle."""
        while True:
            with self._lock:
                if self._closed:
                    return
                due = self._due(time.time())
                if due is None or due > 0:
                    self._changed.wait(due)
                    continue
            try:
                self._worker.submit(self._unload_expired).result()
            except RuntimeError:  # the worker was shut down: the pool is closed
                return

    def _unload_expired(self) -> None:
        for m in list(self._models.values()):
            with self._lock:
                if m.llm is None or m.keep_alive < 0 or not m.evictable or time.time() - m.last_used < m.keep_alive:
                    continue
                box = self._take(m)
            try:
                self._free_taken(m, box, "keep_alive")
            except Exception:  # noqa: BLE001 - the reaper outlives one engine's failing shutdown
                log.exception("unloading model %r failed", m.name)
