"""The one error hierarchy of lmdock.

Every error says what is wrong, where (file and key path, plugin and hook, request field) and what to
do about it.  The CLI prints ``str(error)`` for these and never a traceback.
"""

from __future__ import annotations


def listed(names: object, most: int = 20, width: int = 80) -> str:
    """``names`` for an error message: at most ``most`` of them, each cut at ``width`` characters,
    then how many more (a list a client can grow, such as runtime adapters, must not grow every error)."""
    items = [str(n) if len(str(n)) <= width else str(n)[:width] + "..." for n in names]  # type: ignore[attr-defined]
    shown = ", ".join(items[:most]) or "none"
    return f"{shown} and {len(items) - most} more" if len(items) > most else shown


class LmdockError(Exception):
    """Base class of every error lmdock raises on purpose."""


class ConfigError(LmdockError, ValueError):
    """A config file, or options passed in code, are invalid.

    ``source`` is the file (or ``"<options>"``), ``key`` the dotted key path inside it.
    """

    def __init__(self, message: str, *, source: str | None = None, key: str | None = None) -> None:
        self.source = source
        self.key = key
        where = ""
        if source and key:
            where = f"{source}: {key}: "
        elif source:
            where = f"{source}: "
        elif key:
            where = f"{key}: "
        super().__init__(where + message)


class BackendError(LmdockError):
    """A backend is unknown, broken, unavailable, or declined the model."""


class PluginError(BackendError):
    """A plugin failed to import or register, or targets an incompatible plugin API."""


class RequestError(LmdockError, ValueError):
    """One request is invalid (empty prompt, too long, bad parameters).  Only that request fails."""


class GrammarError(RequestError):
    """A request's grammar (structured output, or the tool-call grammar built from its tools) was
    refused by the grammar check: it does not compile, crashed or outran the compiler in a worker
    process, or can never produce a token.  The message names which; the process is unharmed."""


class QueueFullError(LmdockError):
    """The engine's waiting queue is full; retry later or raise ``scheduler.max_waiting``."""


class EngineClosedError(LmdockError):
    """The LLM was shut down; create a new one."""


class UnsupportedError(LmdockError):
    """A backend refuses something it cannot do (a quantization algorithm, an option), with the reason."""
