"""What a request asks its output to match, as ``SamplingParams.structured_output``: vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and ``structured_outputs``
(completions and chat), OpenAI's ``response_format`` (chat).

One constraint per request: two of these together are a 400 naming both.  A ``json_schema``
response format with ``strict: true`` is OpenAI's strict mode (:func:`strict_schema`); without it
the schema is used as given.
"""

from __future__ import annotations

from typing import Any

from lmdock.server._errors import APIError

#: vLLM's request fields -> the StructuredOutput field each sets.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
#: The keys of vLLM's ``structured_outputs`` object that lmdock honours (``json_object``: any object).
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_output(body: Any) -> dict[str, Any] | None:
    """The ``structured_output`` a request body asks for, or None."""
    asked = [(name, value) for name, value in ((n, getattr(body, n, None)) for n in (*GUIDED, "structured_outputs", "response_format"))
             if value is not None and not (name == "response_format" and value.type == "text")]
    if not asked:
        return None
    if len(asked) > 1:
        names = [name for name, _ in asked]
        raise APIError(400, f"{' and '.join(names)} each constrain the output; send one of them", param=names[1])
    name, value = asked[0]
    if name in GUIDED:
        return {GUIDED[name]: value}
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _response_format(value)


def _structured_outputs(so: Any) -> dict[str, Any]:
    values = so.model_dump(by_alias=True)
    given = [key for key in STRUCTURED_KEYS if values[key] not in (None, False)]
    if len(given) != 1:
        raise APIError(400, f"structured_outputs: set exactly one of {', '.join(STRUCTURED_KEYS)}; got {', '.join(given) or 'none'}",
                       param="structured_outputs")
    key = given[0]
    return {"json": {"type": "object"}} if key == "json_object" else {key: values[key]}


def _response_format(rf: Any) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"json": {"type": "object"}}
    spec = rf.json_schema or {}
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON schema object", param="response_format")
    return {"json": strict_schema(schema) if spec.get("strict") is True else schema}


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: every object schema in ``schema`` takes no properties beyond its own
    (``additionalProperties: false`` unless it says otherwise) and requires all of them.  A copy;
    every document it allows is valid under ``schema`` too."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in ("items", "prefixItems", "additionalItems", "contains", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
                "additionalProperties", "unevaluatedProperties", "propertyNames"):
        if isinstance(out.get(key), (dict, list)):
            out[key] = strict_schema(out[key])
    kind = out.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind) or (kind is None and isinstance(out.get("properties"), dict)):
        out.setdefault("additionalProperties", False)
        names = list(out.get("properties") or {})
        out["required"] = list(dict.fromkeys([*out.get("required", []), *names]))
    return out
