"""Choose the models to serve (loading those named, pinned or preloaded), run uvicorn, drain on
SIGTERM/SIGINT, shut the engines down, exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn

from lmdock._config.file import ConfigFile, find_config, load_config
from lmdock._config.model import ModelConfig
from lmdock._config.server import ServerConfig
from lmdock._models.replicas import ReplicaPlan, replica_plan
from lmdock._plugin.errors import ConfigError
from lmdock.server._app import create_app
from lmdock.server._http import uvicorn_options
from lmdock.server._pool import ServedModel, queue_limit
from lmdock.server._ray import replicated, start_ray, stop_ray

log = logging.getLogger("lmdock.server")

#: Seconds past shutdown_timeout that the requests cut then get to send their last words.
CUT_GRACE = 5.0

#: File descriptors kept beyond max_connections for the models, the logs and the listening socket.
SPARE_FDS = 64


def resolve_api_key(settings: ServerConfig, cli_key: str | None = None) -> str | None:
    """``--api-key``, then ``$LMDOCK_API_KEY``, then ``[server] api_key_file``, then ``[server] api_key``.

    An empty key from any source is an error: it would have turned authentication off without a word."""
    for value, where in ((cli_key, "--api-key"), (os.environ.get("LMDOCK_API_KEY"), "$LMDOCK_API_KEY")):
        if value is not None:
            if not value.strip():
                raise ConfigError(f"{where} is empty: give a key, or leave {where} out to serve without one")
            return value
    if settings.api_key_file:
        try:
            key = Path(settings.api_key_file).expanduser().read_text(encoding="utf-8").strip().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file: {exc.strerror}", source=settings.api_key_file, key="server.api_key_file") from None
        if not key or not key[0].strip():
            raise ConfigError("the API key file is empty", source=settings.api_key_file, key="server.api_key_file")
        return key[0].strip()
    return settings.api_key


def is_loopback(host: str) -> bool:
    """Whether ``host`` only takes connections from this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def raise_fd_limit(connections: int) -> None:
    """Let the process hold ``connections`` sockets: raise its soft file-descriptor limit up to the hard
    one, or warn (past the limit, accept() fails and every client is locked out, instead of a 503)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        if soft < need:
            print(f"lmdock serve: warning: the process may open {soft} files ('ulimit -n'), fewer than [server] "
                  f"max_connections ({connections}) + {SPARE_FDS}: lower max_connections, or clients may be locked "
                  "out instead of answered 503", file=sys.stderr, flush=True)


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None elsewhere (musl, macOS, Windows)."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class _Server(uvicorn.Server):
    """uvicorn's server, marking the app as draining on the first signal and exiting 0 afterwards, and
    handing freed memory back to the system once it is idle."""

    def __init__(self, config: uvicorn.Config, state: Any) -> None:
        super().__init__(config)
        self._lmdock = state
        self._trim = _malloc_trim()
        self._trimmed_at = 0  # uvicorn's count of requests served at the last trim
        self._idle_ticks = 0

    async def on_tick(self, counter: int) -> bool:
        if counter % 10 == 0:  # once a second, as uvicorn's own housekeeping
            self._trim_when_idle()
        return await super().on_tick(counter)

    def _trim_when_idle(self) -> None:
        # glibc keeps what a burst freed (a large n, logprobs) resident as free heap in the main and
        # the engine threads' arenas; malloc_trim gives it back.  Once per quiet spell: after requests
        # were served, when no model has a sequence in flight for a whole second (the engines have
        # released their state by then), on a worker thread.
        served = self.server_state.total_requests
        if self._trim is None or served == self._trimmed_at or any(sm.in_flight for sm in self._lmdock.models.values()):
            self._idle_ticks = 0
            return
        self._idle_ticks += 1
        if self._idle_ticks >= 2:
            self._trimmed_at = served
            asyncio.get_running_loop().run_in_executor(None, self._trim, 0)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        # At shutdown_timeout the streams still running end with an error event and [DONE], and the
        # requests still waiting get 503 (ServerState.cut); uvicorn cancels what runs CUT_GRACE later.
        cut = asyncio.get_running_loop().call_later(self._lmdock.settings.shutdown_timeout, self._lmdock.cut.set)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    async def startup(self, sockets: Any = None) -> None:
        self._lmdock.pool.start()  # the keep_alive reaper runs from the start, not from the first request
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self._lmdock.draining:
            log.info("lmdock serve: draining (up to %ss for requests in flight)", self._lmdock.settings.shutdown_timeout)
        self._lmdock.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal after its shutdown (the process would die by SIGTERM); a drained
        # server has done its job and exits 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def serve(
    models: Sequence[str] | None = None,
    config: str | os.PathLike[str] | None = None,
    *,
    host: str | None = None,
    port: int | None = None,
    api_key: str | None = None,
    backend: str | None = None,
    chat_template: str | None = None,
    log_level: str = "info",
    options: dict[str, Any] | None = None,
    served_name: str | None = None,
    replicas: int | None = None,
) -> int:
    """Serve ``models`` (config names, paths or hub ids; by default every model of the config file).

    Models named here, the config's ``default_model`` and those with ``pin`` or ``preload`` are loaded
    before the server listens; the others when a request first names them (``server/_pool.py``, over ``lmdock.ModelPool``).
    ``options``: ``LLM(...)`` options over each model's config entry (vLLM's serve flags);
    ``served_name``: the name clients use for the one model (vLLM's ``--served-model-name``);
    ``replicas``: each model's engine as that many Ray Serve replicas (over the config's ``replicas`` and
    ``autoscaling``; ``server/_ray.py``)."""
    path = find_config(config)
    cfg = load_config(path) if path is not None else None
    settings = cfg.server if cfg is not None else ServerConfig()
    names = list(models or [])
    if not names:
        if cfg is None or not cfg.models:
            raise ConfigError("no model to serve: pass -m MODEL or add [models.NAME] tables to the config file",
                              source=str(path) if path else None)
        names = sorted(cfg.models, key=lambda n: n != cfg.default_model)  # the default answers requests naming none
    if len(set(names)) != len(names):
        raise ConfigError(f"a model is named twice: {', '.join(names)}")
    if served_name is not None and len(names) != 1:
        raise ConfigError(f"--served-model-name names one model; {len(names)} are served ({', '.join(names)}): "
                          "give each its name in the config file ([models.NAME])")
    template = chat_template or settings.chat_template
    template_text = None
    if template:
        try:
            template_text = Path(template).expanduser().read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read the chat template: {exc.strerror}", source=template) from None
    key = resolve_api_key(settings, api_key)
    if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1):
        raise ConfigError(f"replicas must be an integer >= 1, got {replicas!r}")
    entries = {name: cfg.models.get(name) if cfg is not None else None for name in names}
    plans = {name: replica_plan(entries[name] or ModelConfig(model=name), settings, replicas) for name in names}
    served = [_served(name, entries[name], path, plans[name], settings, backend, options or {}, template_text, served_name)
              for name in names]
    start = [sm for sm, name in zip(served, names) if models or _at_start(name, cfg)]
    limit = settings.max_loaded_models
    if limit is not None and len(start) > limit:
        raise ConfigError(f"{len(start)} models are loaded at start ({', '.join(sm.name for sm in start)}: named on the "
                          f"command line, default_model, pin or preload), more than [server] max_loaded_models = {limit}",
                          source=str(path) if path else None, key="server.max_loaded_models")
    app = create_app(served, settings, key)
    on_ray = [p for p in plans.values() if p.on_ray]
    if on_ray:  # the replicas are deployed as their models load (server/_ray.py)
        start_ray(sum(p.cpus for p in on_ray))
    try:
        for sm in start:
            app.state.lmdock.pool.preload(sm)
        uconfig = uvicorn.Config(
            app,
            host=host or settings.host,
            port=settings.port if port is None else port,
            log_level=log_level,
            timeout_graceful_shutdown=settings.shutdown_timeout + CUT_GRACE,  # type: ignore[arg-type]
            access_log=False,
            lifespan="off",
            **uvicorn_options(settings),
        )
        raise_fd_limit(settings.max_connections)
        server = _Server(uconfig, app.state.lmdock)
        if key is None and not is_loopback(uconfig.host):
            print(f"lmdock serve: warning: listening on {uconfig.host} without an API key: anyone who can reach this "
                  "port can use the models; set --api-key, $LMDOCK_API_KEY or [server] api_key_file",
                  file=sys.stderr, flush=True)
        shown = ", ".join(f"{sm.name} ({sm.llm.backend.name if sm.llm is not None else sm.state})" for sm in served)
        print(f"lmdock serve: {shown} on http://{uconfig.host}:{uconfig.port}/v1"
              f"{' (API key required)' if key else ''}", file=sys.stderr, flush=True)
        server.run()
    finally:
        app.state.lmdock.pool.close()  # every loaded engine shut down
        if on_ray:
            stop_ray()
    return 0


def _at_start(name: str, cfg: ConfigFile | None) -> bool:
    """Whether config model ``name`` is loaded before the server listens: the default, pinned or preloaded."""
    if cfg is None:
        return True
    mc = cfg.model(name)
    return name == cfg.default_model or mc.pin or mc.preload


def _served(name: str, entry: ModelConfig | None, path: Path | None, plan: ReplicaPlan, settings: ServerConfig,
            backend: str | None, options: dict[str, Any], template: str | None, served_name: str | None) -> ServedModel:
    """``name`` (a config name, or a path or hub id, which is pinned: it has no entry to say otherwise) as
    a model to serve, not loaded yet; on Ray Serve replicas when ``plan`` says so."""
    from lmdock._llm.facade import LLM

    mc = entry or ModelConfig(model=name)
    if plan.on_ray:
        loader: Any = replicated(served_name or name, plan, name, backend=backend, config=path, **options)
    else:
        loader = functools.partial(LLM, name, backend=backend, config=path, **options)
    return ServedModel(served_name or name, None, queue_limit(settings, mc), template, loader=loader, root=mc.model,
                       keep_alive=mc.keep_alive, pin=entry is None or mc.pin, adapters=dict(mc.adapters))
