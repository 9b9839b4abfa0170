"""The models a server answers for and the state its routes share: model lookup, sampling params."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from lmdock._errors import ConfigError
from lmdock._params import ServerConfig
from lmdock.server._errors import APIError, as_api_error
from lmdock.server._metrics import Metrics


@dataclass
class ServedModel:
    """One model the server answers for: its public name, the loaded ``LLM``, its admission bound."""

    name: str
    llm: Any
    max_queue: int
    chat_template: str | None = None
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ServerState:
    """What every route reads: the served models (the first is the default), settings, key, metrics."""

    models: dict[str, ServedModel]
    settings: ServerConfig
    api_key: str | None
    metrics: Metrics
    draining: bool = False

    @property
    def retry_after(self) -> int:
        return self.settings.retry_after

    def model(self, name: str | None) -> ServedModel:
        """The model a request names (the default when it names none); 404 naming the served ones."""
        if name is None or name == "":
            return next(iter(self.models.values()))
        sm = self.models.get(name)
        if sm is None:
            raise APIError(404, f"model {name!r} is not served here; served models: {', '.join(self.models)}",
                           param="model", code="model_not_found")
        return sm

    def sampling_params(self, sm: ServedModel, overrides: dict[str, Any]) -> Any:
        """``sm``'s default SamplingParams with a request's overrides; a bad value is a 400 naming it."""
        try:
            return sm.llm.sampling_params(overrides)
        except (ConfigError, ValueError) as exc:
            raise as_api_error(exc, self.retry_after) from None


def state_of(request: Request) -> ServerState:
    """The server state of the app ``request`` arrived at."""
    return request.app.state.lmdock  # type: ignore[no-any-return]


def engine_stats(sm: ServedModel) -> dict[str, Any]:
    """``sm``'s engine counts, or ``{}`` from a dead engine (``/health`` says why)."""
    try:
        return sm.llm.stats()  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - a dead engine reports nothing; /health says why
        return {}
