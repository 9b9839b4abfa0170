"""What a request body asks its output to match, as ``SamplingParams.structured_output``: vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and ``structured_outputs``,
OpenAI's ``response_format``.  One mapping for ``lmdock serve`` (through ``lmdock.server._structured``)
and ``lmdock batch``, on plain JSON values, so the batch runner needs no server extra.

One constraint per request: two of these together are refused naming both.  A ``json_schema``
response format with ``strict: true`` is OpenAI's strict mode (:func:`lmdock._config.json_schemas.strict_schema`);
without it the schema is used as given (step engines then bound what it leaves open, see
:mod:`lmdock._config.json_schemas`).
"""

from __future__ import annotations

from typing import Any

from lmdock._config.foreign import GUIDED
from lmdock._config.json_schemas import strict_schema

#: The keys of vLLM's ``structured_outputs`` object that lmdock honours (``json_object``: any object).
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
#: Every body field this module reads.
FIELDS = (*GUIDED, "structured_outputs", "response_format")
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


class FieldRefused(ValueError):
    """A structured-output field that cannot be honoured; ``param`` names it (``structured_outputs.regex``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_output(body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``structured_output`` a request body (JSON values) asks for, or None; FieldRefused otherwise."""
    asked = [(name, body[name]) for name in FIELDS if body.get(name) is not None
             and not (name == "response_format" and isinstance(body[name], dict) and body[name].get("type", "text") == "text")]
    if not asked:
        return None
    if len(asked) > 1:
        names = [name for name, _ in asked]
        raise FieldRefused(f"{' and '.join(names)} each constrain the output; send one of them", names[1])
    name, value = asked[0]
    if name in GUIDED:
        return {GUIDED[name]: value}
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _response_format(value)


def _structured_outputs(so: Any) -> dict[str, Any]:
    if not isinstance(so, dict):
        raise FieldRefused(f"structured_outputs is an object with one of {', '.join(STRUCTURED_KEYS)}", "structured_outputs")
    for key in so:
        if key not in STRUCTURED_KEYS:
            raise FieldRefused(f"structured_outputs.{key} is not supported; lmdock honours {', '.join(STRUCTURED_KEYS)}",
                               f"structured_outputs.{key}")
    given = [key for key in STRUCTURED_KEYS if so.get(key) not in (None, False)]
    if len(given) != 1:
        raise FieldRefused(f"structured_outputs: set exactly one of {', '.join(STRUCTURED_KEYS)}; got {', '.join(given) or 'none'}",
                           "structured_outputs")
    key = given[0]
    return {"json": {"type": "object"}} if key == "json_object" else {key: so[key]}


def _response_format(rf: Any) -> dict[str, Any]:
    kind = rf.get("type", "text") if isinstance(rf, dict) else None
    if kind not in _RESPONSE_FORMATS:
        raise FieldRefused(f"response_format.type must be one of {', '.join(_RESPONSE_FORMATS)}", "response_format.type")
    if kind == "json_object":
        return {"json": {"type": "object"}}
    spec = rf.get("json_schema") or {}
    unknown = [k for k in spec if k not in _JSON_SCHEMA_KEYS] if isinstance(spec, dict) else []
    if unknown:
        raise FieldRefused(f"response_format.json_schema.{unknown[0]} is not supported; it holds {', '.join(_JSON_SCHEMA_KEYS)}",
                           f"response_format.json_schema.{unknown[0]}")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise FieldRefused("response_format.json_schema.schema must be a JSON schema object", "response_format")
    return {"json": strict_schema(schema) if spec.get("strict") is True else schema}
