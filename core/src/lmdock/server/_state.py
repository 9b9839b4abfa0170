"""The state a server's routes share: model lookup (loading through the pool), sampling params."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from lmdock._config.foreign import OPENAI_FIELDS
from lmdock._config.server import ServerConfig
from lmdock._llm.lora import LoRARequest
from lmdock._plugin.errors import ConfigError, listed
from lmdock.server._errors import APIError, as_api_error
from lmdock.server._metrics import Metrics
from lmdock.server._pool import ServedModel, ServedPool


class Flag:
    """Set once, awaited by any number of requests: an ``asyncio.Event`` that binds to no loop (an
    Event binds to the first loop that waits on it, and TestClient runs each request on its own)."""

    def __init__(self) -> None:
        self._set = False
        self._waiters: set[asyncio.Future[None]] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        """Wake every waiter (call it on the loop they wait on)."""
        self._set = True
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self) -> None:
        if self._set:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)


@dataclass
class ServerState:
    """What every route reads: the served models (the first is the default), settings, key, metrics."""

    models: dict[str, ServedModel]
    settings: ServerConfig
    api_key: str | None
    metrics: Metrics
    pool: ServedPool
    draining: bool = False
    #: set at ``shutdown_timeout`` after the drain began: the requests still running are cut (503)
    cut: Flag = field(default_factory=lambda: Flag())

    @property
    def retry_after(self) -> int:
        return self.settings.retry_after

    def served(self, name: str | None) -> ServedModel:
        """The model a request names (the default when it names none), loaded or not; ``NAME:ADAPTER``
        is model NAME (run under its adapter: :meth:`adapter`); 404 naming the served ones."""
        if name is None or name == "":
            return next(iter(self.models.values()))
        sm = self.models.get(name)
        if sm is None:
            base, _, adapter = name.rpartition(":")
            sm = self.models.get(base)
            if sm is None or adapter not in sm.adapters:
                served = [*self.models, *(f"{n}:{a}" for n, m in self.models.items() for a in m.adapters)]
                raise APIError(404, f"model {listed([name], width=200)!r} is not served here; served models: {listed(served)}",
                               param="model", code="model_not_found")
        return sm

    def adapter(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a model name asks for (``NAME:ADAPTER``, after :meth:`served` accepted it),
        or None for a base model."""
        if not name or name in self.models:
            return None
        base, _, adapter = name.rpartition(":")
        return LoRARequest(adapter, self.models[base].adapters[adapter])

    async def model(self, name: str | None, request: Request, keep_alive: float | None = None) -> ServedModel:
        """The model a request names, loaded (it waits for a load under way), held until the response
        has been sent: nothing unloads it under the request.  ``keep_alive``: the request's, in seconds."""
        return await self.pool.acquire(self.served(name), request.scope, keep_alive)

    def sampling_params(self, sm: ServedModel, overrides: dict[str, Any], sent: Any = None) -> Any:
        """``sm``'s default SamplingParams with a request's overrides; a bad value, or more work than
        ``[server]`` lets one request ask for, is a 400 naming the field and the limit.  ``sent``: the
        request body (read only on an error), so an error names the one the client used (``max_tokens``, not
        ``max_new_tokens``)."""
        try:
            params = sm.llm.sampling_params(overrides)
        except ConfigError as exc:
            raise in_client_terms(exc, sent) from None
        except ValueError as exc:
            raise as_api_error(exc, self.retry_after) from None
        self._check_bounds(params)
        return params

    def _check_bounds(self, params: Any) -> None:
        s = self.settings
        if params.n > s.max_n:
            raise APIError(400, f"n={params.n}: this server returns at most {s.max_n} completions per prompt ([server] max_n)", param="n")
        for value in (params.logprobs, params.prompt_logprobs):
            if value is not None and value > s.max_logprobs:
                raise APIError(400, f"{value} logprobs per token asked for: this server returns at most {s.max_logprobs} "
                                    "(logprobs / top_logprobs; [server] max_logprobs)", param="logprobs")
        if len(params.stop) > s.max_stop_strings:
            raise APIError(400, f"{len(params.stop)} stop strings: this server takes at most {s.max_stop_strings} "
                                "([server] max_stop_strings)", param="stop")
        longest = max((len(x) for x in params.stop), default=0)
        if longest > s.max_stop_length:
            raise APIError(400, f"a stop string of {longest} characters: this server takes at most {s.max_stop_length} "
                                "([server] max_stop_length)", param="stop")


def in_client_terms(exc: ConfigError, sent: Any) -> APIError:
    """A SamplingParams error as a 400 in the request's own field names (OpenAI's, where it sent them)."""
    field = (exc.key or "").removeprefix("sampling_params.")
    names = [name for name, target in OPENAI_FIELDS.items() if target == field]
    # the last one the request sent is the one that took effect (overrides() applies the table in order)
    client = next((n for n in reversed(names) if getattr(sent, n, None) is not None), names[0] if names else field) or None
    message = str(exc).split(": ", 2)[-1] if exc.key else str(exc)
    return APIError(400, f"{client}: {message}" if client else message, param=client)


def state_of(request: Request) -> ServerState:
    """The server state of the app ``request`` arrived at."""
    return request.app.state.lmdock  # type: ignore[no-any-return]


def engine_stats(sm: ServedModel) -> dict[str, Any]:
    """``sm``'s engine counts, or ``{}`` from an unloaded or dead engine (``/health`` says why)."""
    if sm.llm is None:
        return {}
    try:
        return sm.llm.stats()  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - a dead engine reports nothing; /health says why
        return {}
