"""The schema rewrites of lmdock._config.json_schemas: each narrows the schema (every document the copy allows
is valid under the original) and takes only subschemas for schemas."""

from __future__ import annotations

import jsonschema
from lmdock._config.json_schemas import SAFE_INTEGER, bounded_numbers, closed_objects, strict_schema

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                            "properties": {"type": "object", "properties": {"x": {"const": {"type": "integer"}}}}},
          "$defs": {"pet": {"properties": {"kind": {"enum": [{"type": "number"}]}}}}}


def test_closed_objects_close_what_lists_properties_and_nothing_else() -> None:
    out = closed_objects(PERSON)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False  # a property named "properties" is a schema
    assert "additionalProperties" not in out["properties"]  # ... and the map of properties is not
    assert out["$defs"]["pet"]["additionalProperties"] is False
    assert out["properties"]["properties"]["properties"]["x"] == {"const": {"type": "integer"}}  # values untouched
    assert closed_objects({"type": "object"}) == {"type": "object"}  # any object stays any object
    assert closed_objects({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"] is True
    both = closed_objects({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in s for s in both["allOf"])  # members of an allOf add up
    assert "additionalProperties" not in PERSON


def test_bounded_numbers_fill_only_missing_bounds() -> None:
    out = bounded_numbers({"type": "object", "properties": {
        "i": {"type": "integer"}, "low": {"type": "integer", "minimum": 0}, "n": {"type": ["number", "null"]},
        "big": {"type": "integer", "minimum": 2**60}, "step": {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 3}}})
    p = out["properties"]
    assert p["i"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert p["low"] == {"type": "integer", "minimum": 0, "maximum": SAFE_INTEGER}
    assert p["n"]["multipleOf"] == 1e-9 and p["n"]["maximum"] == SAFE_INTEGER
    assert p["big"] == {"type": "integer", "minimum": 2**60}  # no maximum below its minimum
    assert bounded_numbers({"type": "integer", "minimum": 1, "exclusiveMinimum": True})["maximum"] == SAFE_INTEGER  # draft 4
    assert p["step"] == {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 3, "minimum": -SAFE_INTEGER}


def test_every_rewrite_narrows() -> None:
    doc = {"name": "Lily", "age": 3, "properties": {"x": {"type": "integer"}}}
    for rewrite in (strict_schema, closed_objects, bounded_numbers):
        jsonschema.validate(doc, rewrite(PERSON))
    jsonschema.validate(doc, PERSON)
    assert not jsonschema.Draft202012Validator(closed_objects(PERSON)).is_valid({**doc, "other": 1})
    assert jsonschema.Draft202012Validator(PERSON).is_valid({**doc, "other": 1})
