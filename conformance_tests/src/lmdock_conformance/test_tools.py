"""Tool calls (capability ``tools``): ``LLM.chat`` with a forced ``tool_choice`` returns calls whose
arguments validate against their tool's JSON schema (``jsonschema``, independent of the grammar
engine), in the format of the model's tool parser, streamed or not.

The 260K-parameter test model has no tool template: the tests pass a Hermes-style one (``<tool_call>``,
so the ``hermes`` parser is recognized from it) that renders the tools' names only (the model's
context is 512 tokens).  The forced choice is what makes this model call."""

from __future__ import annotations

import json
from typing import Any

import pytest
from lmdock import RequestError

pytestmark = pytest.mark.requires("tools")

TEMPLATE = (
    "{{ bos_token }}{% if tools is defined and tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}. Call one as "
    "<tool_call>.\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}Result: {{ m.content }}\n"
    "{% elif m.tool_calls is defined and m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}\n"
    "{% else %}{{ m.content }}\n{% endif %}{% endfor %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "wave", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Once upon a time"}]
GREEDY = {"temperature": 0, "max_new_tokens": 200}


def _calls(llm: Any, tool_choice: Any, **kw: Any) -> Any:
    return llm.chat(ASK, {**GREEDY, **kw.pop("params", {})}, chat_template=TEMPLATE, tools=TOOLS, tool_choice=tool_choice, **kw)[0].outputs[0]


@pytest.mark.parametrize("seed", [None, 5])
def test_required_call_validates(llm: Any, seed: int | None) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    params = {} if seed is None else {"temperature": 1.0, "seed": seed}
    out = _calls(llm, "required", parallel_tool_calls=False, params=params)
    (call,) = out.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert out.finish_reason == "stop" and out.content is None


def test_named_function_is_called(llm: Any) -> None:
    out = _calls(llm, {"type": "function", "function": {"name": "wave"}})
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("wave", {})]


def test_none_reads_no_calls(llm: Any) -> None:
    out = _calls(llm, "none", params={"max_new_tokens": 12})
    assert out.tool_calls is None or out.tool_calls == []
    assert out.text


def test_a_function_not_in_tools_is_refused(llm: Any) -> None:
    with pytest.raises(RequestError, match="not in tools"):
        _calls(llm, {"type": "function", "function": {"name": "fly"}})
