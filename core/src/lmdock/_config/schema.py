"""Typed, strict construction of the portable config dataclasses from plain data.

One mechanism serves the TOML file, keyword options in code and the JSON Schema export: the dataclass
type hints are the schema.  Unknown keys and wrong types raise :class:`ConfigError` naming the key path.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, TypeVar, Union

from lmdock._plugin.errors import ConfigError

T = TypeVar("T")


class FieldError(ValueError):
    """A value is out of range; ``field`` names it so callers can prefix the key path."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def check(cond: bool, field: str, message: str) -> None:
    """Raise :class:`FieldError` for ``field`` unless ``cond`` holds."""
    if not cond:
        raise FieldError(field, message)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass (cached: they are read on every construction)."""
    return typing.get_type_hints(cls, include_extras=False)


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if origin in (list, tuple):
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    if origin is dict:
        return "table"
    if hint is type(None):
        return "none"
    return getattr(hint, "__name__", str(hint))


def coerce(value: Any, hint: Any, path: str, source: str | None) -> Any:
    """Check ``value`` against ``hint``; return it (lists become tuples where the hint says tuple)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return coerce(value, arg, path, source)
            except ConfigError:
                continue
        raise _wrong_type(value, hint, path, source)
    if origin is Literal:
        if value in typing.get_args(hint):
            return value
        raise ConfigError(
            f"{value!r} is not allowed; choose one of {_type_name(hint)}", source=source, key=path
        )
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _wrong_type(value, hint, path, source)
        item = typing.get_args(hint)[0]
        items = [coerce(v, item, f"{path}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong_type(value, hint, path, source)
        return dict(value)
    if hint is type(None):
        if value is None:
            return None
        raise _wrong_type(value, hint, path, source)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            return build(hint, value, source=source, prefix=path)
        raise _wrong_type(value, hint, path, source)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, bool):
        raise _wrong_type(value, hint, path, source)
    if isinstance(value, hint):
        return value
    raise _wrong_type(value, hint, path, source)


def _wrong_type(value: Any, hint: Any, path: str, source: str | None) -> ConfigError:
    return ConfigError(
        f"expected {_type_name(hint)}, got {type(value).__name__} {value!r}", source=source, key=path
    )


def unknown_key(key: str, allowed: Any, aliases: dict[str, str] | None = None) -> str:
    """"unknown key 'x'; did you mean 'y'?" (another tool's spelling, or a close match), else the list."""
    allowed = sorted(allowed)
    if aliases and key in aliases:
        return f"unknown key {key!r}; did you mean {aliases[key]!r}? ({key!r} is another tool's name for it)"
    import difflib

    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    if close:
        return f"unknown key {key!r}; did you mean {close[0]!r}? (allowed keys: {', '.join(allowed)})"
    return f"unknown key {key!r}; allowed keys: {', '.join(allowed)}"


def resolve_aliases(cls: type, data: dict[str, Any], *, source: str | None = None, prefix: str = "") -> dict[str, Any]:
    """``data`` with each key in the class's ``ALIASES`` read as the field it names; both given with
    different values is a ConfigError naming the alias."""
    aliases: dict[str, str] = getattr(cls, "ALIASES", {})
    if not any(k in aliases for k in data):
        return data
    data = dict(data)
    for alias, name in aliases.items():
        if alias in data:
            if name in data and data[name] != data[alias]:
                key = f"{prefix}.{alias}" if prefix else alias
                raise ConfigError(f"{alias!r} is another name for {name!r}: give one of them", source=source, key=key)
            data[name] = data.pop(alias)
    return data


def build(cls: type[T], data: dict[str, Any], *, source: str | None = None, prefix: str = "") -> T:
    """Construct dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types.

    A key in the class's ``ALIASES`` (``SamplingParams``: vLLM's and OpenAI's ``max_tokens``...) is
    read as the field it names."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    data = resolve_aliases(cls, data, source=source, prefix=prefix)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(unknown_key(unknown[0], fields), source=source, key=key)
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        kwargs[name] = coerce(value, hints(cls)[name], path, source)
    try:
        return cls(**kwargs)
    except FieldError as exc:
        key = f"{prefix}.{exc.field}" if prefix else exc.field
        raise ConfigError(str(exc).split(": ", 1)[1], source=source, key=key) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc), source=source, key=prefix or None) from None


def json_schema(cls: type) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a dataclass; unknown keys are not allowed."""
    props = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        props[f.name] = _hint_schema(hints(cls)[f.name])
        if f.metadata.get("doc"):
            props[f.name]["description"] = f.metadata["doc"]
        default = f.default
        if default is not dataclasses.MISSING and isinstance(default, (int, float, str, bool)):
            props[f.name]["default"] = default
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if cls.__doc__:
        schema["description"] = cls.__doc__.strip().splitlines()[0]
    return schema


def _hint_schema(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return {"anyOf": [_hint_schema(a) for a in typing.get_args(hint)]}
    if origin is Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin in (list, tuple):
        return {"type": "array", "items": _hint_schema(typing.get_args(hint)[0])}
    if origin is dict:
        return {"type": "object"}
    if dataclasses.is_dataclass(hint):
        return json_schema(hint)  # type: ignore[arg-type]
    simple = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
    return {"type": simple.get(hint, "string")} if hint is not Any else {}
