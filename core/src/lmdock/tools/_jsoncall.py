"""Reading a call written as one JSON object (``{"name": ..., "arguments": {...}}``) while it is
still being written: where its top-level values start and end, so that the name is known once its
string closes and the arguments' text can go out as it comes, exactly as the model wrote it."""

from __future__ import annotations

import json
from typing import Any

from lmdock.tools._base import PartialCall


def top_level(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The spans of the object at ``text[start]``'s top-level values, by key (end None while a value
    is unfinished), and the index just past the object (None while it is open)."""
    spans: dict[str, tuple[int, int | None]] = {}
    depth, in_str, esc = 0, False, False
    key_start = key = value_start = None
    last_key: str | None = None
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 1 and value_start is None and key_start is not None:
                    key = text[key_start:i + 1]
            continue
        if ch == '"':
            in_str = True
            if depth == 1 and value_start is None:
                key_start = i
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                if value_start is not None and last_key is not None:
                    spans[last_key] = (value_start, i)
                return spans, i + 1
        elif depth == 1 and ch == ":" and key is not None and value_start is None:
            try:
                last_key = json.loads(key)
            except ValueError:
                last_key = None
            value_start, key = i + 1, None
            if last_key is not None:
                spans[last_key] = (value_start, None)
        elif depth == 1 and ch == "," and value_start is not None:
            if last_key is not None:
                spans[last_key] = (value_start, i)
            value_start, key_start, last_key = None, None, None
    return spans, None


def json_call(text: str, start: int, args_keys: tuple[str, ...] = ("arguments",)) -> tuple[PartialCall, int | None, str | None]:
    """The call whose JSON object opens at ``text[start]``: ``(call so far, index past it or None,
    error)``.  The error says why a closed object is not a call."""
    spans, end = top_level(text, start)
    call = PartialCall()
    name = spans.get("name")
    if name is not None and name[1] is not None:
        try:
            value = json.loads(text[name[0]:name[1]])
        except ValueError:
            value = None
        call.name = value if isinstance(value, str) else None
    args = next((spans[k] for k in args_keys if k in spans), None)
    if args is not None:
        call.arguments = text[args[0]:args[1] if args[1] is not None else len(text)].strip()
    if end is None:
        return call, None, None
    return _closed(text[start:end], call, args_keys), end, _error(text[start:end], args_keys)


def _closed(raw: str, call: PartialCall, args_keys: tuple[str, ...]) -> PartialCall:
    call.complete = True
    if call.arguments.startswith('"'):
        try:
            call.arguments = json.loads(call.arguments)  # some models write the arguments as a JSON string
        except ValueError:
            pass
    if not call.arguments:
        call.arguments = "{}"  # a call written without arguments takes none
    return call


def _error(raw: str, args_keys: tuple[str, ...]) -> str | None:
    """Why a closed object is not a call: not JSON, no name, arguments that are not an object."""
    try:
        obj: Any = json.loads(raw)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return "a call needs a string \"name\""
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)  # some models write the arguments as a JSON string
        except ValueError:
            return "arguments are not JSON"
    if not isinstance(args, dict):
        return "arguments must be a JSON object"
    return None


def json_schema_of(tool: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one tool's call object: its name, and arguments under its parameters' schema."""
    fn = tool.get("function", {})
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


#: compact JSON (llguidance's option): free whitespace between tokens would let a model spend its budget on it
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def calls_schema(tools: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """One call to any of ``tools``, as a JSON schema (compact JSON)."""
    schemas = [json_schema_of(t, args_key) for t in tools]
    return {**schemas[0], **COMPACT} if len(schemas) == 1 else {"anyOf": schemas, **COMPACT}
