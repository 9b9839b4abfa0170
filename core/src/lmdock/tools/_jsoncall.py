"""Reading a call written as one JSON object (``{"name": ..., "arguments": {...}}``) while it is
still being written: where its top-level values start and end, so that the name is known once its
string closes and the arguments' text can go out as it comes, exactly as the model wrote it."""

from __future__ import annotations

import json
from typing import Any

from lmdock._config.json_schemas import bounded_numbers, closed_objects, loosened
from lmdock.tools._base import PartialCall


class ObjectScan:
    """The top-level values of the JSON object that opens at ``start``, read as far as a text goes and
    resumable: a stream hands it the same text grown, and it reads only what is new (a call's
    arguments can be thousands of characters, sent in as many deltas)."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.seen = ""  # the text read so far (a reference, to check the next one extends it)
        self.spans: dict[str, tuple[int, int | None]] = {}
        self.end: int | None = None  # just past the object, once closed
        self.depth, self.in_str, self.esc = 0, False, False
        self.key_start: int | None = None
        self.key: str | None = None
        self.value_start: int | None = None
        self.last_key: str | None = None

    def read(self, text: str) -> ObjectScan:
        """Read ``text`` (which extends the text read before) up to the object's end."""
        self.seen = text
        i = self.pos
        while self.end is None and i < len(text):
            self._char(text, i)
            i += 1
        self.pos = i
        return self

    def _char(self, text: str, i: int) -> None:
        ch = text[i]
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 1 and self.value_start is None and self.key_start is not None:
                    self.key = text[self.key_start:i + 1]
            return
        if ch == '"':
            self.in_str = True
            if self.depth == 1 and self.value_start is None:
                self.key_start = i
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._close_value(i)
                self.end = i + 1
        elif self.depth == 1 and ch == ":" and self.key is not None and self.value_start is None:
            try:
                self.last_key = json.loads(self.key)
            except ValueError:
                self.last_key = None
            self.value_start, self.key = i + 1, None
            if self.last_key is not None:
                self.spans[self.last_key] = (self.value_start, None)
        elif self.depth == 1 and ch == "," and self.value_start is not None:
            self._close_value(i)
            self.value_start, self.key_start, self.last_key = None, None, None

    def _close_value(self, i: int) -> None:
        if self.value_start is not None and self.last_key is not None:
            self.spans[self.last_key] = (self.value_start, i)


def object_scan(text: str, start: int, memo: dict[int, ObjectScan] | None) -> ObjectScan:
    """The object at ``start`` read through ``text``; ``memo`` (a stream's) resumes where the last
    read of a shorter text stopped."""
    if memo is None:
        return ObjectScan(start).read(text)
    scan = memo.get(start)
    if scan is None or not text.startswith(scan.seen):
        scan = memo[start] = ObjectScan(start)
    return scan.read(text)


def json_call(text: str, start: int, args_keys: tuple[str, ...] = ("arguments",),
              memo: dict[int, ObjectScan] | None = None) -> tuple[PartialCall, int | None, str | None]:
    """The call whose JSON object opens at ``text[start]``: ``(call so far, index past it or None,
    error)``.  The error says why a closed object is not a call.  ``memo``: see :func:`object_scan`."""
    scan = object_scan(text, start, memo)
    spans, end = scan.spans, scan.end
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


def json_schema_of(tool: dict[str, Any], args_key: str = "arguments", prefix: str = "") -> dict[str, Any]:
    """The JSON schema of one tool's call object: its name, and arguments under its parameters' schema
    (bounded as a response format's is; its ``$defs`` lifted to the root, renamed with ``prefix``)."""
    fn = tool.get("function", {})
    params, defs = arguments_schema(fn.get("parameters") or {"type": "object", "properties": {}}, prefix)
    schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
              "required": ["name", args_key], "additionalProperties": False}
    return {**schema, "$defs": defs} if defs else schema


def arguments_schema(params: dict[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(schema, defs)``: a tool's parameters schema with what it leaves open bounded (objects that list
    their properties closed, numbers in range: lmdock/_config/json_schemas.py, as for ``response_format``),
    and its ``$defs`` / ``definitions`` taken out, named ``prefix + name``, for the root of the schema
    that embeds it (a ``#/$defs/X`` reference resolves from the root, which is no longer ``params``:
    pydantic writes nested models that way, so instructor's and LangChain's tools have them).  What
    llguidance cannot constrain is loosened (``lmdock._config.json_schemas.loosened``; the plan checks it after)."""
    params = bounded_numbers(closed_objects(loosened(params)[0]))
    defs = {f"{prefix}{name}": sub for key in ("$defs", "definitions") for name, sub in (params.get(key) or {}).items()}
    if not defs:
        return params, {}
    params = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
    moved = _renamed_refs({"p": params, "d": defs}, prefix)
    return moved["p"], moved["d"]


def _renamed_refs(value: Any, prefix: str) -> Any:
    """``value`` with every local ``$ref`` into ``$defs`` / ``definitions`` pointing at ``#/$defs/<prefix>NAME``."""
    if isinstance(value, list):
        return [_renamed_refs(v, prefix) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _renamed_refs(v, prefix) for k, v in value.items()}
    ref = out.get("$ref")
    if isinstance(ref, str):
        for root in ("#/$defs/", "#/definitions/"):
            if ref.startswith(root):
                out["$ref"] = f"#/$defs/{prefix}{ref[len(root):]}"
    return out


#: compact JSON (llguidance's option): free whitespace between tokens would let a model spend its budget on it
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def calls_schema(tools: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """One call to any of ``tools``, as a JSON schema (compact JSON)."""
    if len(tools) == 1:
        return {**json_schema_of(tools[0], args_key), **COMPACT}
    schemas = [json_schema_of(t, args_key, f"t{i}_") for i, t in enumerate(tools)]
    defs = {name: sub for s in schemas for name, sub in s.pop("$defs", {}).items()}
    return {"anyOf": schemas, **({"$defs": defs} if defs else {}), **COMPACT}
