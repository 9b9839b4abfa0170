"""Tool calls and reasoning content through ``/v1/chat/completions`` with the real ``openai`` client
(and LangChain), against a running ``lmdock serve`` (stories260K on hf, loopback).

stories260K has no tool template: the server gets a Hermes-style one (``<tool_call>``, so the
parser is recognized from it) that renders the tools' names only (the model's context is 512
tokens).  A forced ``tool_choice`` is what makes this model call; the point is the protocol and the
guarantee that the arguments validate, not the model's judgement.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import Server

TEMPLATE = (
    "{{ bos_token }}{% if tools is defined and tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}. Call one as "
    "<tool_call>.\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}Result {{ m.tool_call_id }}: {{ m.content }}\n"
    "{% elif m.tool_calls is defined and m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} {{ c.function.arguments.city }}"
    "</tool_call>{% endfor %}\n{% else %}{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt and enable_thinking is defined and enable_thinking %}<think>\n{% endif %}"
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
NOARGS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "wave", "parameters": NOARGS}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tools")
    template = tmp / "tools.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    thinker = (f'[models.thinker]\nmodel = "{_model(tmp)}"\nbackend = "hf"\nreasoning_parser = "think"\n'
               '[models.thinker.sampling]\ntemperature = 0.0\nmax_new_tokens = 40\n')
    s = Server(tmp, args=("--chat-template", str(template), "--model", "stories", "--model", "thinker"), extra_models=thinker)
    yield s
    s.stop()


def _model(tmp: Path) -> str:
    from serve_helpers import models_dir

    return str(models_dir())


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _valid(call: object) -> dict[str, object]:
    """The call's arguments, parsed and checked against its tool's schema."""
    args = json.loads(call.function.arguments)  # type: ignore[attr-defined]
    jsonschema.validate(args, SCHEMAS[call.function.name])  # type: ignore[attr-defined]
    assert call.id.startswith("call_") and call.type == "function"  # type: ignore[attr-defined]
    return args  # type: ignore[no-any-return]


def test_required_returns_a_valid_call(agent: Server) -> None:
    r = client(agent).chat.completions.create(model="stories", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                                              parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    _valid(call)


def test_parallel_calls_each_validate(agent: Server) -> None:
    # this model, once calling, goes on calling until max_tokens: every closed call is valid
    r = client(agent).chat.completions.create(model="stories", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert len(calls) > 1 and len({c.id for c in calls}) == len(calls)
    for call in calls:
        _valid(call)


def test_named_function_is_the_one_called(agent: Server) -> None:
    r = client(agent).chat.completions.create(model="stories", messages=ASK, tools=TOOLS, max_tokens=200,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    args = _valid(calls[0])
    assert set(args) == {"city", "days"}
    assert r.choices[0].finish_reason == "tool_calls"


def test_named_function_without_arguments(agent: Server) -> None:
    r = client(agent).chat.completions.create(model="stories", messages=ASK, tools=TOOLS, max_tokens=200,
                                              tool_choice={"type": "function", "function": {"name": "wave"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "wave" and json.loads(call.function.arguments) == {}


def test_streamed_calls_in_openai_chunks(agent: Server) -> None:
    chunks = list(client(agent).chat.completions.create(model="stories", messages=ASK, tools=TOOLS, max_tokens=200, stream=True,
                                                        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])  # the name once, then arguments
    assert len(deltas) > 2  # the arguments come as they are written
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]


def test_streamed_and_whole_agree(agent: Server) -> None:
    c = client(agent)
    kw = {"model": "stories", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "parallel_tool_calls": False}
    whole = c.chat.completions.create(**kw).choices[0].message.tool_calls  # type: ignore[call-overload]
    chunks = list(c.chat.completions.create(**kw, stream=True))  # type: ignore[call-overload]
    streamed: dict[int, list[str]] = {}
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            streamed.setdefault(d.index, [d.function.name or "", ""])[1] += d.function.arguments or ""
    assert [(w.function.name, w.function.arguments) for w in whole] == [tuple(streamed[i]) for i in sorted(streamed)]


def test_each_of_n_choices_streams_its_own_calls(agent: Server) -> None:
    chunks = list(client(agent).chat.completions.create(model="stories", messages=ASK, tools=TOOLS, tool_choice="required", n=2,
                                                        temperature=1.0, seed=3, max_tokens=200, parallel_tool_calls=False, stream=True))
    calls: dict[int, list[str]] = {}
    for ch in chunks:
        for c in ch.choices:
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    calls[c.index] = [d.function.name, ""]
                calls[c.index][1] += d.function.arguments or ""
    assert sorted(calls) == [0, 1]
    for name, arguments in calls.values():
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_lets_the_model_write_text(agent: Server) -> None:
    c = client(agent)
    auto = c.chat.completions.create(model="stories", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=30)
    none = c.chat.completions.create(model="stories", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=30)
    assert auto.choices[0].message.tool_calls is None and none.choices[0].message.tool_calls is None
    assert auto.choices[0].message.content and auto.choices[0].message.content == none.choices[0].message.content
    assert auto.choices[0].finish_reason == "length"


def test_second_turn_with_the_tool_result(agent: Server) -> None:
    c = client(agent)
    first = c.chat.completions.create(model="stories", messages=ASK, tools=TOOLS, max_tokens=200,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = c.chat.completions.create(model="stories", messages=history, tools=TOOLS, tool_choice="none", max_tokens=10)
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    bare = httpx.post(f"{agent.url}/tokenize", json={"model": "stories", "messages": history}, timeout=30).json()
    with_tools = httpx.post(f"{agent.url}/tokenize", json={"model": "stories", "messages": history, "tools": TOOLS}, timeout=30).json()
    assert with_tools["count"] > bare["count"] > 0  # the tools are rendered as chat renders them


def test_tool_errors_name_the_field(agent: Server) -> None:
    c = client(agent)
    with pytest.raises(openai.BadRequestError, match="not in tools") as e:
        c.chat.completions.create(model="stories", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}})
    assert e.value.body["param"] == "tool_choice"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="function tools"):
        c.chat.completions.create(model="stories", messages=ASK, tools=[{"type": "web_search"}])  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(model="stories", messages=ASK, tools=TOOLS, tool_choice="required",
                                  response_format={"type": "json_object"})


def test_reasoning_content_and_thinking_off(agent: Server) -> None:
    c = client(agent)
    on = c.chat.completions.create(model="thinker", messages=ASK, max_tokens=20, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    off = c.chat.completions.create(model="thinker", messages=ASK, max_tokens=20, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the prompt opened <think>: the reply (which never closes it) is all thinking; with thinking off, all answer
    assert on.choices[0].message.reasoning_content and on.choices[0].message.content in (None, "")  # type: ignore[attr-defined]
    assert off.choices[0].message.content and getattr(off.choices[0].message, "reasoning_content", None) is None
    chunks = list(c.chat.completions.create(model="thinker", messages=ASK, max_tokens=20, stream=True,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": True}}))
    streamed = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices)
    assert streamed == on.choices[0].message.reasoning_content  # type: ignore[attr-defined]


def test_langchain_bind_tools_returns_the_call(agent: Server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{agent.url}/v1", api_key="unused", model="stories", max_tokens=200, max_retries=0)  # type: ignore[arg-type]
    msg = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Once upon a time")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER)


def test_a_model_without_a_tool_format_refuses_tools(server: Server) -> None:
    # the session server's template names no call format and its config no tool_parser: calls could
    # not be read, so tools are refused rather than dropped (issue 30: they were silently ignored)
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="no tool_parser") as e:
        c.chat.completions.create(model="stories", messages=ASK, tools=TOOLS, tool_choice="required")
    assert e.value.body["param"] == "tools"  # type: ignore[index]
    r = c.chat.completions.create(model="stories", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
