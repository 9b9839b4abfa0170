"""The request fields that constrain the output, mapped to ``structured_output`` once for the server
and ``lmdock batch`` (lmdock._config.structured_fields): what each becomes, and each refusal naming its field."""

from __future__ import annotations

from typing import Any

import pytest
from lmdock._config.structured_fields import FieldRefused, structured_output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("body", "want"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_choice": ["x", "y"]}, {"choice": ["x", "y"]}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"structured_outputs": {"json_object": True}}, {"json": {"type": "object"}}),
    ({"structured_outputs": {"regex": "a+", "json_object": False}}, {"regex": "a+"}),
    ({"response_format": {"type": "json_object"}}, {"json": {"type": "object"}}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}, {"json": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     {"json": {**SCHEMA, "additionalProperties": False, "required": ["a"]}}),
])
def test_each_field_becomes_one_structured_output(body: dict[str, Any], want: Any) -> None:
    assert structured_output(body) == want


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": "a"}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "stric": True}}}, "response_format.json_schema.stric"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(FieldRefused) as exc:
        structured_output(body)
    assert exc.value.param == param
