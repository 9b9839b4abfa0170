"""JSON-schema keywords llguidance does not implement (``lmdock._config.json_schemas.loosened``): llguidance
refuses each one (checked here on its own, through the engine's compile path over stories260K's
tokenizer), the loosened schema compiles, the keyword is named unless it asks for nothing, and a
tool call is checked against the schema the client sent (``jsonschema``, outside the code under test)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from lmdock import RequestError
from lmdock._config.json_schemas import UNIMPLEMENTED, loosened
from lmdock.tools import ChatPlan
from test_structured import _params, factory  # noqa: F401 - the fixture

OBJ = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
CASES: list[tuple[dict[str, Any], str]] = [
    *[({**OBJ, key: True if key == "uniqueItems" else {"type": "string"}}, key) for key in UNIMPLEMENTED if key != "propertyNames"],
    ({**OBJ, "propertyNames": {"pattern": "^[a-z]+$"}}, "propertyNames"),
    ({**OBJ, "minProperties": 1}, "minProperties"),
    ({"type": "string", "format": "semver"}, "format semver"),
    ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, "pattern (look-around)"),
]


def _raw_grammar(schema: dict[str, Any]) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})  # type: ignore[no-any-return]


@pytest.mark.parametrize("schema, keyword", CASES, ids=[k for _, k in CASES])
def test_llguidance_refuses_the_keyword_and_takes_the_loosened_schema(factory: Any, schema: dict, keyword: str) -> None:  # noqa: F811
    with pytest.raises(RequestError, match="cannot compile"):
        factory.compiled(_raw_grammar(schema))
    narrowed, names = loosened(schema)
    assert names == [keyword]
    factory.compiled(_raw_grammar(narrowed))
    (c,) = factory(_params(json=schema), 1)  # the response-format path loosens it itself
    assert not c.is_complete()


def test_property_names_as_strings_is_dropped_unnamed(factory: Any) -> None:  # noqa: F811
    schema = {"type": "object", "properties": {"env": {"type": "object", "propertyNames": {"type": "string"},
                                                       "additionalProperties": {"type": "string"}}}}
    narrowed, names = loosened(schema)
    assert names == [] and "propertyNames" not in narrowed["properties"]["env"]
    factory.compiled(_raw_grammar(narrowed))


def test_the_input_is_not_changed() -> None:
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    loosened(schema)
    assert schema["uniqueItems"] is True


TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["tags"]}


def _plan(params: dict[str, Any]) -> ChatPlan:
    tools = [{"type": "function", "function": {"name": "tag", "parameters": params}},
             {"type": "function", "function": {"name": "plain", "parameters": {"type": "object"}}}]
    return ChatPlan.make(tools, "required", None, None, model="m", tool_parser="hermes", reasoning_parser=None, template=None)


def test_a_plan_names_each_tools_loosened_keywords() -> None:
    assert _plan(TAGS).loosened == {"tag": ["uniqueItems"]}


def test_calls_are_checked_against_the_schema_sent() -> None:
    plan = _plan(TAGS)
    call = {"function": {"name": "tag", "arguments": '{"tags": ["a", "a"]}'}}
    (problem,) = plan.invalid([call, {"function": {"name": "tag", "arguments": '{"tags": ["a", "b"]}'}},
                               {"function": {"name": "plain", "arguments": '{"x": [1, 1]}'}}])
    assert re.fullmatch(r"tag: \[.a., .a.\] has non-unique elements", problem), problem
