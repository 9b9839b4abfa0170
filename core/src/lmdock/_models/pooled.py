"""One model of a pool (:class:`PooledModel`), its ``keep_alive``, and the errors a pool raises."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from lmdock._plugin.errors import LmdockError


class PoolFullError(LmdockError):
    """No room to load a model: the models that would have to go are in use or pinned.  Retry once
    one of them is let go, or raise ``memory_budget_gib`` / ``max_loaded_models``."""


class ModelBusyError(LmdockError):
    """A model cannot be unloaded now: it is pinned, or in use (unload it once it is let go)."""


@dataclass(eq=False)  # one model: compared by identity
class PooledModel:
    """One model of a pool: its name, the ``LLM`` (None while unloaded) and what the pool needs to load
    it again and decide when to unload it.

    ``loader`` builds the ``LLM``; without one the model was handed over loaded and stays so.
    ``holds``: users that took the model and have not let go (a held model is never unloaded).
    Everything but ``name`` and ``llm`` is keyword-only, so a subclass (the server's ``ServedModel``)
    adds positional fields of its own."""

    name: str
    llm: Any
    loader: Callable[[], Any] | None = field(default=None, kw_only=True)
    keep_alive: float = field(default=-1.0, kw_only=True)
    pin: bool = field(default=False, kw_only=True)
    holds: int = field(default=0, kw_only=True)
    last_used: float = field(default=0.0, kw_only=True)  # time.time() of the last hold or release; 0: never
    memory_bytes: int | None = field(default=None, kw_only=True)
    loading: Future[Any] | None = field(default=None, kw_only=True)  # the load under way
    unloading: bool = field(default=False, kw_only=True)  # its engine is being shut down (``llm`` is None already)

    @property
    def state(self) -> str:
        """``loaded``, ``loading``, ``unloading`` or ``unloaded``."""
        if self.llm is not None:
            return "loaded"
        return "loading" if self.loading is not None else "unloading" if self.unloading else "unloaded"

    @property
    def busy(self) -> bool:
        """Whether someone holds the model (or waits for its load)."""
        return self.holds > 0

    @property
    def evictable(self) -> bool:
        """Whether the pool may unload the model now: it can be loaded again, is not pinned, nobody holds it."""
        return self.loader is not None and not self.pin and not self.busy and self.loading is None


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
