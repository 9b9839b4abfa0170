"""What every portable config dataclass shares: copies with changes, fields settable with validation,
and the range checks their ``__post_init__`` run (each failure a :class:`~lmdock._config.schema.FieldError`
naming the field)."""

from __future__ import annotations

import dataclasses
from typing import Any

from lmdock._config.schema import check

INF = float("inf")


def in_range(name: str, value: float | None, lo: float, hi: float = INF, *, lo_open: bool = False) -> None:
    """``value`` (None: unset) lies in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), or ``name`` is refused."""
    if value is None:
        return
    ok = (value > lo if lo_open else value >= lo) and value <= hi
    bracket = "(" if lo_open else "["
    upper = "inf)" if hi == INF else f"{hi}]"
    check(ok, name, f"must be in {bracket}{lo}, {upper}, got {value!r}")


def integer(name: str, value: Any, lo: int, *, optional: bool = True) -> None:
    """``value`` is an integer >= ``lo`` (or None, when ``optional``), or ``name`` is refused."""
    if value is None and optional:
        return
    check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
    check(value >= lo, name, f"must be >= {lo}, got {value!r}")


class Replaceable:
    """``replace(**changes)``: a validated copy (every config type has it)."""

    def replace(self, **changes: Any) -> Any:
        """Return a copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


class Editable:
    """Fields may be set after construction (TensorRT-LLM's ``build_config.max_beam_width = 4``,
    vLLM's ``sp.max_tokens = 40``); each assignment is validated as construction is, and a name in the
    class's ``ALIASES`` sets the field it names."""

    def __setattr__(self, name: str, value: Any) -> None:
        name = getattr(type(self), "ALIASES", {}).get(name, name)
        if name not in {f.name for f in dataclasses.fields(self)}:  # type: ignore[arg-type]
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        if name not in self.__dict__:  # the dataclass's own __init__ setting it
            object.__setattr__(self, name, value)
            return
        new = dataclasses.replace(self, **{name: value})  # type: ignore[type-var]
        self.__dict__.update(new.__dict__)
