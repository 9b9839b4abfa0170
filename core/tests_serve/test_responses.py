"""OpenAI's Responses API (``client.responses``) against a running ``lmdock serve`` (stories260K on
hf, loopback), built on the chat path: the same prompt and greedy text as ``/v1/chat/completions``.

The server's template renders each message on its own line and the tools' names (a Hermes-style
``<tool_call>`` template, so the parser is recognized from it); a forced ``tool_choice`` is what
makes this model call.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import Field
from serve_helpers import WEATHER, Server, agent_server

TOOL = {"type": "function", "name": "get_weather", "description": "the weather", "parameters": WEATHER}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = agent_server(tmp_path_factory.mktemp("responses"))
    yield s
    s.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_text_is_the_chat_paths_text(served: Server) -> None:
    """``POST /v1/responses`` through the openai client: the chat path's text."""
    c = client(served)
    r = c.responses.create(model="stories", input="Once upon a time", max_output_tokens=20, temperature=0)
    chat = c.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=20,
                                     temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "stories"
    assert r.output_text == chat.choices[0].message.content and len(r.output_text) > 10
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 20)
    assert r.usage.total_tokens == r.usage.input_tokens + 20
    # cut by max_output_tokens: incomplete, saying why
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_input_items_and_instructions_make_the_chat_messages(served: Server) -> None:
    c = client(served)
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Once upon"}, {"type": "input_text", "text": "a time"}]}]
    r = c.responses.create(model="stories", input=items, instructions="Tell a story.", max_output_tokens=8)
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Once upon\na time"}]
    chat = c.chat.completions.create(model="stories", messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.instructions == "Tell a story."


def test_streamed_events_come_in_openais_order(served: Server) -> None:
    c = client(served)
    events = list(c.responses.create(model="stories", input="Once upon a time", max_output_tokens=20, stream=True))
    whole = c.responses.create(model="stories", input="Once upon a time", max_output_tokens=20)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = [e for e in events if e.type == "response.output_text.done"][0]
    assert done.text == text and done.item_id == events[2].item.id
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 20 and final.status == "incomplete"
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_previous_response_id_continues_the_conversation(served: Server) -> None:
    c = client(served)
    first = c.responses.create(model="stories", input="Once upon a time", max_output_tokens=12)
    second = c.responses.create(model="stories", input="Then", previous_response_id=first.id, max_output_tokens=5)
    alone = c.responses.create(model="stories", input="Then", max_output_tokens=5)
    # the second prompt holds the first turn: its input and its output, then the new input
    history = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "Then"}]
    chat = c.chat.completions.create(model="stories", messages=history, max_tokens=5)  # type: ignore[arg-type]
    assert second.usage.input_tokens == chat.usage.prompt_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    # a chain goes on, and the stored response reads back
    third = c.responses.create(model="stories", input="And", previous_response_id=second.id, max_output_tokens=3)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert c.responses.retrieve(first.id).output_text == first.output_text


def test_a_streamed_response_is_stored_too(served: Server) -> None:
    c = client(served)
    events = list(c.responses.create(model="stories", input="Once upon a time", max_output_tokens=6, stream=True))
    first = events[-1].response
    assert c.responses.retrieve(first.id).output_text == first.output_text
    second = c.responses.create(model="stories", input="Then", previous_response_id=first.id, max_output_tokens=2)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_store_false_keeps_nothing_and_delete_forgets(served: Server) -> None:
    c = client(served)
    kept = c.responses.create(model="stories", input="Once", max_output_tokens=2)
    gone = c.responses.create(model="stories", input="Once", max_output_tokens=2, store=False)
    assert gone.store is False
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="stories", input="Then", previous_response_id=gone.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(gone.id)
    c.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(kept.id)


def test_json_schema_text_format_constrains_the_output_which_completes(served: Server) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
              "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "n", "schema": schema}}
    c = client(served)
    r = c.responses.create(model="stories", input="Once upon a time", max_output_tokens=60, text=fmt)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(r.output_text), schema)
    # the constrained text ends itself (before max_output_tokens): completed
    events = list(c.responses.create(model="stories", input="Once upon a time", max_output_tokens=60, text=fmt, stream=True))  # type: ignore[arg-type]
    assert events[-1].type == "response.completed" and events[-1].response.status == "completed"
    assert events[-1].response.output_text == r.output_text and events[-1].response.incomplete_details is None
    assert events[-1].response.text.format.type == "json_schema"


def test_what_it_cannot_honour_is_a_400_naming_it(served: Server) -> None:
    c = client(served)
    cases = [
        ({"input": "x", "extra_body": {"max_token": 3}}, "max_token", "did you mean 'max_output_tokens'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type", "input_file"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "item_reference"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input.0.encrypted_content", "encrypted"),
        ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input.0.colour", "colour"),
        ({"input": "x", "tools": [{"type": "local_shell"}]}, "tools.0.type", "function, custom and namespace tools"),
        ({"input": []}, "input", "empty"),
        ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "reasoning.encrypted_content only"),
        ({"input": "x", "text": {"verbosity": "high"}}, "text.verbosity", "'medium'"),
        ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort", "'minimal'"),
        ({"input": "x", "tools": [{"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "ebnf",
                                                                              "definition": "x"}}]}, "tools.0.format", "lark or regex"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
    ]
    for kw, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="stories", **kw)  # type: ignore[call-overload]
        assert e.value.body["param"] == param, kw  # type: ignore[index]
        assert words in e.value.body["message"], kw  # type: ignore[index]
    # an image is read (docs/vision.md) and refused for what is wrong with it: never fetched over http
    with pytest.raises(openai.BadRequestError, match="does not fetch images"):
        c.responses.create(model="stories", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}])


def test_errors_have_openais_shape(served: Server) -> None:
    r = httpx.post(f"{served.url}/v1/responses", json={"model": "nope", "input": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error" and "stories" in r.json()["error"]["message"]
    # metadata comes back in the response: a lone surrogate in it is a 400 before any work, not a 500 after
    r = httpx.post(f"{served.url}/v1/responses", content=b'{"input": "x", "metadata": {"k": "\\ud800"}}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("metadata.k holds a lone UTF-16 surrogate")


def _valid_call(item: object) -> dict[str, object]:
    """A function_call output item, its arguments parsed and checked against the tool's schema."""
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")  # type: ignore[attr-defined]
    args = json.loads(item.arguments)  # type: ignore[attr-defined]
    jsonschema.validate(args, WEATHER)
    return args  # type: ignore[no-any-return]


def test_a_named_function_is_called_with_valid_arguments(served: Server) -> None:
    r = client(served).responses.create(model="stories", input="Once upon a time", tools=[TOOL], tool_choice=FORCED,  # type: ignore[list-item, arg-type]
                                        max_output_tokens=100)
    (item,) = r.output
    _valid_call(item)
    assert r.status == "completed" and item.status == "completed"  # type: ignore[union-attr]
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"  # type: ignore[union-attr]


def test_function_call_output_follows_up_by_id_or_by_items(served: Server) -> None:
    c = client(served)
    first = c.responses.create(model="stories", input="Once upon a time", tools=[TOOL], tool_choice=FORCED, max_output_tokens=100)  # type: ignore[list-item, arg-type]
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}  # type: ignore[union-attr]
    by_id = c.responses.create(model="stories", previous_response_id=first.id, input=[result], tools=[TOOL], tool_choice="none",  # type: ignore[list-item]
                               max_output_tokens=10)
    items = [{"role": "user", "content": "Once upon a time"}, call.model_dump(exclude_none=True), result]
    by_items = c.responses.create(model="stories", input=items, tools=[TOOL], tool_choice="none", max_output_tokens=10)  # type: ignore[arg-type, list-item]
    # the same conversation as chat messages: the call as the assistant's tool_calls, its output a tool message
    messages = [{"role": "user", "content": "Once upon a time"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function",  # type: ignore[union-attr]
                                                                     "function": {"name": "get_weather", "arguments": call.arguments}}]},  # type: ignore[union-attr]
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]  # type: ignore[union-attr]
    chat = c.chat.completions.create(model="stories", messages=messages, tools=[{"type": "function", "function": {  # type: ignore[arg-type, list-item]
        "name": "get_weather", "description": "the weather", "parameters": WEATHER}}], tool_choice="none", max_tokens=10)
    assert by_id.usage.input_tokens == by_items.usage.input_tokens == chat.usage.prompt_tokens
    assert by_id.usage.input_tokens > first.usage.input_tokens + 5  # the call and "Result call_...: sunny"
    assert by_id.output_text == by_items.output_text == chat.choices[0].message.content
    assert by_id.output[0].type == "message"


def test_a_streamed_call_comes_as_argument_deltas(served: Server) -> None:
    c = client(served)
    events = list(c.responses.create(model="stories", input="Once upon a time", tools=[TOOL], tool_choice=FORCED,  # type: ignore[list-item, arg-type]
                                     max_output_tokens=100, stream=True))
    whole = c.responses.create(model="stories", input="Once upon a time", tools=[TOOL], tool_choice=FORCED, max_output_tokens=100)  # type: ignore[list-item, arg-type]
    kinds = [e.type for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas > 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.status == "in_progress" and added.arguments == ""
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert events[-3].arguments == arguments == done.arguments
    assert _valid_call(done) == json.loads(whole.output[0].arguments)  # type: ignore[union-attr]
    assert done.call_id == added.call_id and events[-1].response.output[0].call_id == added.call_id


def test_tool_choice_none_writes_text(served: Server) -> None:
    r = client(served).responses.create(model="stories", input="Once upon a time", tools=[TOOL], tool_choice="none",  # type: ignore[list-item]
                                        max_output_tokens=10)
    assert [item.type for item in r.output] == ["message"] and r.output_text


def test_an_openai_agents_sdk_agent_runs_its_tool_to_completion(served: Server) -> None:
    # The Agents SDK speaks the Responses API.  Forced, this model calls; the agent runs the tool and,
    # told to stop on its first tool, finishes with the tool's result (left to go on, this model writes
    # until max_output_tokens, which the SDK takes as a failed turn).
    agents = pytest.importorskip("agents", reason="openai-agents is in the serve env (scripts/test.sh)")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    def agent() -> object:  # a client per event loop: the SDK's async client is bound to the loop it first ran on
        model = agents.OpenAIResponsesModel(model="stories", openai_client=AsyncOpenAI(base_url=f"{served.url}/v1",
                                                                                       api_key="unused", max_retries=0))
        return agents.Agent(name="teller", instructions="Tell a story.", tools=[get_weather], model=model,
                            tool_use_behavior="stop_on_first_tool",
                            model_settings=agents.ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, max_tokens=200))

    result = agents.Runner.run_sync(agent(), "Once upon a time", max_turns=2)
    (city,) = cities
    assert len(city) <= 10
    assert result.final_output == f"sunny in {city}"
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem"]

    async def streamed() -> tuple[object, list[str]]:  # the SDK reading our event stream
        run = agents.Runner.run_streamed(agent(), "Once upon a time", max_turns=2)
        kinds = [e.data.type async for e in run.stream_events() if e.type == "raw_response_event"]
        return run.final_output, kinds

    final, events = asyncio.run(streamed())
    assert final == result.final_output and events[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in events


def test_a_reasoning_model_answers_with_a_reasoning_item(served: Server) -> None:
    # "thinker" is stories260K with the think reasoning parser; the template opens <think> (as Qwen3's
    # does), and this model never closes it: all its text is reasoning
    c = client(served)
    r = c.responses.create(model="thinker", input="Once upon a time", max_output_tokens=20)
    ref = c.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=20)
    (item,) = r.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text"  # type: ignore[union-attr, index]
    assert item.content[0].text == ref.choices[0].message.reasoning_content  # type: ignore[union-attr, index, attr-defined]
    events = list(c.responses.create(model="thinker", input="Once upon a time", max_output_tokens=20, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.reasoning_text.delta")
    assert deltas > 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     *["response.reasoning_text.delta"] * deltas, "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text  # type: ignore[union-attr, index]
    # the reasoning item goes back as input (as the Agents SDK sends it), or through the store: one conversation
    by_id = c.responses.create(model="thinker", input="Then", previous_response_id=r.id, max_output_tokens=2)
    items = [{"role": "user", "content": "Once upon a time"}, item.model_dump(exclude_none=True), {"role": "user", "content": "Then"}]
    by_items = c.responses.create(model="thinker", input=items, max_output_tokens=2)  # type: ignore[arg-type]
    assert by_id.usage.input_tokens == by_items.usage.input_tokens


def test_a_client_gone_mid_stream_aborts_the_request(served: Server) -> None:
    # a schema whose string takes hundreds of tokens keeps the request running (this API has no ignore_eos)
    long = {"type": "object", "properties": {"s": {"type": "string", "minLength": 400}}, "required": ["s"]}
    body = {"model": "stories", "input": "Once", "max_output_tokens": 480, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "long", "schema": long}}}
    before = served.stats()["num_requests_aborted_total"]
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{served.url}/v1/responses", json=body) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: response.created"
        assert served.stats()["num_sequences_held"] > 0
    deadline = time.monotonic() + 60
    while (served.stats()["num_sequences_held"] or served.stats()["in_flight"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = served.stats()
    assert stats["num_sequences_held"] == 0 and stats["in_flight"] == 0, stats
    # the engine ended it on an abort, not by running it to its max tokens
    assert stats["num_requests_aborted_total"] == before + 1, stats


def test_the_store_is_bounded_least_recently_used_first_out() -> None:
    from lmdock._config.server import ServerConfig
    from lmdock.server._response_store import MAX_STORED, MAX_STORED_BYTES, ResponseStore, Stored

    # as docs/server.md says
    assert MAX_STORED == ServerConfig().response_store_max_items == 1024
    assert MAX_STORED_BYTES == ServerConfig().response_store_max_bytes == 128 * 2**20
    store = ResponseStore(limit=2)
    for name in ("a", "b"):
        store.put(name, Stored.of({"id": name}, (), []))
    assert store.get("a") is not None  # "a" used: "b" is now the least recently used
    store.put("c", Stored.of({"id": "c"}, (), []))
    assert [k for k in ("a", "b", "c") if store.get(k) is not None] == ["a", "c"]
    assert store.delete("a") and not store.delete("a")


def test_the_store_is_bounded_in_bytes_and_keeps_json_not_objects() -> None:
    from lmdock.server._response_store import ResponseStore, Stored

    big = [{"role": "user", "content": "x" * 300}]
    first = Stored.of({"id": "a"}, (), big)
    # a turn continuing "a" shares its messages' bytes objects (no copy), and counts them
    second = Stored.of({"id": "b"}, first.messages, [{"role": "assistant", "content": "y" * 300}])
    assert second.messages[0] is first.messages[0] and second.history()[0] == big[0]
    bound = first.size + second.size
    store = ResponseStore(limit=100, max_bytes=bound)
    assert store.put("a", first) and store.put("b", second) and store.bytes == bound
    store.put("c", Stored.of({"id": "c"}, (), big))  # past the bound: "a", the least recently used, goes
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None and store.bytes <= bound
    assert not store.put("d", Stored.of({"id": "d"}, (), [{"content": "z" * 2000}]))  # larger than the bound alone
    assert store.get("d") is None and store.bytes <= bound


# What Codex (openai/codex, wire_api = "responses") sends: its instructions, developer and user
# messages, its function tools and its free-form apply_patch (a custom tool with a Lark grammar),
# reasoning settings, no stored state (store: false, its reasoning carried as encrypted_content)
# and always a stream.
PATCH_GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?\n'
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
     "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                     "workdir": {"type": "string"}},
                    "required": ["command"], "additionalProperties": False}},
    {"type": "custom", "name": "apply_patch", "description": "Use the apply_patch tool to edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}},
]


def codex_request(**over: object) -> dict[str, object]:
    return {"model": "thinker", "instructions": "You are a coding agent.",
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: none"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]}],
            "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
            "text": {"verbosity": "medium"}, **over}


def _events(server: Server, body: dict[str, object]) -> list[dict[str, object]]:
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_a_codex_shaped_request_is_answered_streamed_and_whole(served: Server) -> None:
    events = _events(served, codex_request())
    final = events[-1]["response"]
    assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    (item,) = final["output"]  # type: ignore[index]
    # the thinker never closes <think>: all its text is reasoning, its summary the same text, and the
    # token carries it back
    text = item["content"][0]["text"]
    assert item["type"] == "reasoning" and text and item["summary"] == [{"type": "summary_text", "text": text}]
    assert item["encrypted_content"].startswith("lmdock-reasoning-v1.")
    assert final["reasoning"] == {"effort": "medium", "summary": "auto"} and final["store"] is False  # type: ignore[index]
    summary = [e for e in events if e["type"].startswith("response.reasoning_summary")]  # type: ignore[union-attr]
    deltas = [e["delta"] for e in summary if e["type"] == "response.reasoning_summary_text.delta"]
    assert [e["type"] for e in summary] == ["response.reasoning_summary_part.added", *["response.reasoning_summary_text.delta"] * len(deltas),
                                            "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"]
    assert "".join(deltas) == summary[-2]["text"] == text  # type: ignore[arg-type]
    r = httpx.get(f"{served.url}/v1/responses/{final['id']}")  # type: ignore[index]
    assert r.status_code == 404  # store: false
    sdk = list(client(served).responses.create(**codex_request()))  # type: ignore[arg-type]  # the openai SDK reads the same events
    undelta = [e.type for e in sdk if not e.type.endswith(".delta")]  # how many deltas depends on how tokens arrive
    assert undelta == [e["type"] for e in events if not e["type"].endswith(".delta")]  # type: ignore[union-attr]
    assert sdk[-1].response.output[0].summary[0].text == text  # type: ignore[union-attr]
    whole = client(served).responses.create(**codex_request(stream=False))  # type: ignore[arg-type]
    assert whole.output[0].type == "reasoning" and whole.output[0].content[0].text == text  # type: ignore[union-attr, index]
    assert whole.output[0].encrypted_content == item["encrypted_content"]  # type: ignore[union-attr]


def test_reasoning_effort_none_turns_thinking_off(served: Server) -> None:
    c = client(served)
    off = c.responses.create(**codex_request(stream=False, reasoning={"effort": "none"}))  # type: ignore[arg-type]
    on = c.responses.create(**codex_request(stream=False, reasoning={"effort": "high"}))  # type: ignore[arg-type]
    assert [i.type for i in off.output] == ["message"] and [i.type for i in on.output] == ["reasoning"]
    assert off.usage.input_tokens < on.usage.input_tokens  # the template leaves <think> out
    assert not hasattr(on.output[0], "encrypted_content") or on.output[0].encrypted_content  # type: ignore[union-attr]


def test_encrypted_reasoning_goes_back_as_the_turns_reasoning(served: Server) -> None:
    from lmdock.server._responses_items import input_messages

    c = client(served)
    first = c.responses.create(**codex_request(stream=False))  # type: ignore[arg-type]
    item = first.output[0].model_dump(exclude_none=True)
    text = item["content"][0]["text"]
    # as Codex sends it back: the item with its summary and token, no content
    sent = {k: v for k, v in item.items() if k != "content"}
    then = [*codex_request()["input"], sent, {"type": "message", "role": "user", "content": "Then"}]  # type: ignore[list-item]
    again = c.responses.create(**codex_request(stream=False, input=then))  # type: ignore[arg-type]
    assert again.status in ("completed", "incomplete")
    assert input_messages([{**sent, "summary": []}])[0]["reasoning_content"] == text  # the token alone carries the text
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(**codex_request(stream=False, input=[{**sent, "encrypted_content": sent["encrypted_content"][:-4] + "AAAA"},  # type: ignore[arg-type]
                                                               *then[-1:]]))
    assert e.value.body["param"] == "input.0.encrypted_content"  # type: ignore[index]


PIN = {"type": "custom", "name": "pin", "description": "a short code", "format": {"type": "grammar", "syntax": "regex",
                                                                                 "definition": "[a-z]{2,6}-[0-9]{2}"}}


def test_a_custom_tool_call_round_trip(served: Server) -> None:
    c = client(served)
    kw = {"model": "stories", "input": "Once upon a time", "tools": [PIN], "tool_choice": {"type": "custom", "name": "pin"},
          "max_output_tokens": 60}
    r = c.responses.create(**kw)  # type: ignore[arg-type]
    (call,) = r.output
    assert call.type == "custom_tool_call" and call.name == "pin" and call.call_id.startswith("call_")  # type: ignore[union-attr]
    assert re.fullmatch("[a-z]{2,6}-[0-9]{2}", call.input)  # type: ignore[union-attr]  # the regex format holds the input
    events = _events(served, {**kw, "stream": True})
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.custom_tool_call_input.delta",
                     "response.custom_tool_call_input.done", "response.output_item.done", "response.completed"]
    assert events[4]["input"] == events[5]["item"]["input"] == call.input  # type: ignore[index, union-attr]
    # its output goes back; the conversation is chat's, the call's input as {"input": ...} arguments
    result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "ok"}  # type: ignore[union-attr]
    items = [{"role": "user", "content": "Once upon a time"}, call.model_dump(exclude_none=True), result]
    after = c.responses.create(model="stories", input=items, tools=[PIN], tool_choice="none", max_output_tokens=5)  # type: ignore[arg-type, list-item]
    by_id = c.responses.create(model="stories", previous_response_id=r.id, input=[result], tools=[PIN], tool_choice="none",  # type: ignore[arg-type, list-item]
                               max_output_tokens=5)
    messages = [{"role": "user", "content": "Once upon a time"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {  # type: ignore[union-attr]
                    "name": "pin", "arguments": json.dumps({"input": call.input})}}]},  # type: ignore[union-attr]
                {"role": "tool", "tool_call_id": call.call_id, "content": "ok"}]  # type: ignore[union-attr]
    chat = c.chat.completions.create(model="stories", messages=messages, max_tokens=5, tools=[{"type": "function", "function": {  # type: ignore[arg-type, list-item]
        "name": "pin", "parameters": {"type": "object", "properties": {"input": {"type": "string"}}}}}], tool_choice="none")
    assert after.usage.input_tokens == by_id.usage.input_tokens == chat.usage.prompt_tokens
    assert after.output_text == chat.choices[0].message.content
    # a regex the grammar engine cannot hold (a look-around) is loosened, named, and the call checked after
    bad = {**PIN, "format": {"type": "grammar", "syntax": "regex", "definition": "(?=a)b"}}
    raw = c.responses.with_raw_response.create(**{**kw, "tools": [bad], "stream": False})  # type: ignore[arg-type]
    assert raw.headers["x-lmdock-ignored"] == "tools.pin: pattern (look-around) (loosened; checked after generation)"
