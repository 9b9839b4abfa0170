"""JSON schemas rewritten into narrower ones: OpenAI's strict mode, and the bounds lmdock's llguidance
path puts on what a schema leaves open (see docs/structured-output.md).

Each function returns a copy; every document the copy allows is valid under the schema given, so the
output of a constrained request always validates against what the client sent.  The walk knows the
keywords that hold subschemas, so property names, ``enum`` / ``const`` values and examples are never
taken for schemas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Keywords whose value is a map of name -> subschema.
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: Keywords whose value is a subschema or a list of them.
_SUBS = ("items", "prefixItems", "additionalItems", "contains", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
         "additionalProperties", "unevaluatedProperties", "propertyNames")

#: The integers every JSON parser reads exactly (RFC 7493, I-JSON: IEEE 754 doubles): ±(2**53 - 1).
SAFE_INTEGER = 2**53 - 1
#: The finest step of a number the schema leaves unbounded: at most 9 digits after the point.
NUMBER_STEP = 1e-9


def map_schemas(schema: Any, fn: Callable[[dict[str, Any], bool], dict[str, Any]], in_all_of: bool = False) -> Any:
    """``schema`` with ``fn(subschema, in_all_of)`` applied to it and to every subschema, innermost
    first; ``in_all_of`` is True for the members of an ``allOf`` (which a rewrite may need to leave
    alone: each member constrains the same object)."""
    if isinstance(schema, list):
        return [map_schemas(s, fn, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: map_schemas(sub, fn) for name, sub in out[key].items()}
    for key in _SUBS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = map_schemas(out[key], fn, key == "allOf")
    return fn(out, in_all_of)


def _is(schema: dict[str, Any], kind: str) -> bool:
    t = schema.get("type")
    return t == kind or (isinstance(t, list) and kind in t)


def _number(value: Any) -> bool:
    """A bound's value (draft 4's boolean ``exclusiveMinimum`` is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: every object schema takes no properties beyond its own
    (``additionalProperties: false`` unless it says otherwise) and requires all of them."""

    def strict(s: dict[str, Any], _: bool) -> dict[str, Any]:
        if _is(s, "object") or ("type" not in s and isinstance(s.get("properties"), dict)):
            s.setdefault("additionalProperties", False)
            s["required"] = list(dict.fromkeys([*s.get("required", []), *(s.get("properties") or {})]))
        return s

    return map_schemas(schema, strict)


def closed_objects(schema: Any) -> Any:
    """Each object schema that lists ``properties`` or ``patternProperties`` and says nothing of
    ``additionalProperties`` (or ``unevaluatedProperties``) takes no other keys: what vLLM's default
    grammar backend (xgrammar, strict mode) does, and its llguidance backend with
    ``disable_additional_properties``.  An object without listed properties (``{"type": "object"}``)
    stays open; so do the members of an ``allOf``, whose properties add up."""

    def close(s: dict[str, Any], in_all_of: bool) -> dict[str, Any]:
        listed = isinstance(s.get("properties"), dict) or isinstance(s.get("patternProperties"), dict)
        if listed and not in_all_of and "additionalProperties" not in s and "unevaluatedProperties" not in s:
            s["additionalProperties"] = False
        return s

    return map_schemas(schema, close)


def bounded_numbers(schema: Any) -> Any:
    """Integers and numbers that a schema leaves unbounded get bounds, so a model cannot write digits
    until its token budget runs out: a missing minimum / maximum becomes ∓``SAFE_INTEGER`` (unless the other bound lies beyond it), and a
    ``number`` without ``multipleOf`` gets ``NUMBER_STEP`` (at most 9 digits after the point)."""

    def bound(s: dict[str, Any], _: bool) -> dict[str, Any]:
        if not (_is(s, "integer") or _is(s, "number")):
            return s
        low = max((s[k] for k in ("minimum", "exclusiveMinimum") if _number(s.get(k))), default=None)
        high = min((s[k] for k in ("maximum", "exclusiveMaximum") if _number(s.get(k))), default=None)
        if low is None and (high is None or high > -SAFE_INTEGER):
            s["minimum"] = -SAFE_INTEGER
        if high is None and (low is None or low < SAFE_INTEGER):
            s["maximum"] = SAFE_INTEGER
        if _is(s, "number") and "multipleOf" not in s:
            s["multipleOf"] = NUMBER_STEP
        return s

    return map_schemas(schema, bound)


#: keywords llguidance (1.9) does not implement: it refuses a schema holding one ("Unimplemented keys")
UNIMPLEMENTED = ("propertyNames", "uniqueItems", "contains", "minContains", "maxContains", "dependentRequired",
                 "dependentSchemas", "dependencies", "if", "then", "else", "not", "unevaluatedProperties",
                 "unevaluatedItems", "$dynamicRef", "$dynamicAnchor")
#: the string formats llguidance implements (another one is refused: "Unknown format")
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                     "unknown"})
#: a regex look-around, which llguidance's regex engine cannot hold
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def loosened(schema: Any) -> tuple[Any, list[str]]:
    """``(schema, names)``: ``schema`` without what llguidance cannot constrain, and the keywords so
    loosened (each once, in order).  A keyword that asks for nothing (``propertyNames: {type:
    string}``: property names are strings) is dropped unnamed; the others (``uniqueItems``,
    ``contains``, ``if``, ``not``..., ``min/maxProperties`` over optional properties, an unknown
    ``format``, a ``pattern`` with look-around) are dropped from the grammar's schema, named, and left
    for a validator to check on the output (every document ``schema`` allows, the loosened one allows)."""
    names: list[str] = []

    def note(name: str) -> None:
        if name not in names:
            names.append(name)

    def loosen(s: dict[str, Any], _: bool) -> dict[str, Any]:
        if s.get("propertyNames") in ({}, True, {"type": "string"}):
            del s["propertyNames"]
        for key in UNIMPLEMENTED:
            if key in s:
                del s[key]
                note(key)
        props = s.get("properties")
        partial = isinstance(props, dict) and not set(props) <= set(s.get("required") or ())
        for key in ("minProperties", "maxProperties"):
            if key in s and partial:
                del s[key]
                note(key)
        if isinstance(s.get("format"), str) and s["format"] not in FORMATS:
            note(f"format {s.pop('format')}")
        if isinstance(s.get("pattern"), str) and any(x in s["pattern"] for x in _LOOKAROUND):
            del s["pattern"]
            note("pattern (look-around)")
        return s

    return map_schemas(schema, loosen), names
