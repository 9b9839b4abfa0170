"""The parsers by name: the built-in ones, then those plugins add through the
``lmdock_register_parsers`` hook (a plugin's parser replaces a built-in one of the same name)."""

from __future__ import annotations

import difflib
import logging
import threading
from typing import Any

from lmdock._plugin.errors import ConfigError
from lmdock.tools._base import ToolParser
from lmdock.tools._formats import HermesParser, Llama3JsonParser, MistralParser, PythonicParser
from lmdock.tools._reasoning import BUILTIN_REASONING, ReasoningParser

#: in the order a chat template is recognized (the first whose hints it holds)
BUILTIN: tuple[type[ToolParser], ...] = (HermesParser, MistralParser, PythonicParser, Llama3JsonParser)

_found: tuple[dict[str, type[ToolParser]], dict[str, type[ReasoningParser]]] | None = None
_lock = threading.Lock()
_log = logging.getLogger("lmdock.tools")


def _load() -> tuple[dict[str, type[ToolParser]], dict[str, type[ReasoningParser]]]:
    global _found
    with _lock:
        if _found is None:
            tools = {cls.name: cls for cls in BUILTIN}
            reasoning = {cls.name: cls for cls in BUILTIN_REASONING}

            def register(cls: Any) -> None:
                if isinstance(cls, type) and issubclass(cls, ToolParser) and cls.name:
                    tools[cls.name] = cls
                elif isinstance(cls, type) and issubclass(cls, ReasoningParser) and cls.name:
                    reasoning[cls.name] = cls
                else:
                    raise TypeError(f"register() takes a named ToolParser or ReasoningParser subclass, got {cls!r}")

            from lmdock._plugin.manager import get_registry

            for impl in get_registry().hook().lmdock_register_parsers.get_hookimpls():
                try:
                    impl.function(register=register)
                except Exception as exc:  # a broken plugin loses its parsers; the others keep theirs
                    _log.warning("plugin %r: lmdock_register_parsers failed: %s: %s", impl.plugin_name, type(exc).__name__, exc)
            _found = (tools, reasoning)
        return _found


def _pick(kind: str, known: dict[str, Any], name: str) -> Any:
    cls = known.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown {kind.replace('_', ' ')} {name!r}; {hint}known: {', '.join(sorted(known))}", key=kind)
    return cls()


def parser_names() -> list[str]:
    """The names ``tool_parser`` may take."""
    return sorted(_load()[0])


def reasoning_parser_names() -> list[str]:
    """The names ``reasoning_parser`` may take."""
    return sorted(_load()[1])


def get_parser(name: str) -> ToolParser:
    """The tool-call parser called ``name``; ConfigError naming the closest one otherwise."""
    return _pick("tool_parser", _load()[0], name)  # type: ignore[no-any-return]


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The reasoning parser called ``name``; ConfigError naming the closest one otherwise."""
    return _pick("reasoning_parser", _load()[1], name)  # type: ignore[no-any-return]


def parser_for_template(template: str | None) -> ToolParser | None:
    """The parser whose format a chat template writes (one of its hints appears in it), or None."""
    if not template:
        return None
    for cls in _load()[0].values():
        if any(h in template for h in cls.template_hints):
            return cls()
    return None


def reset() -> None:
    """Forget the parsers found (tests that register a plugin)."""
    global _found
    with _lock:
        _found = None
