"""Anthropic's Messages API (the ``anthropic`` client) against a running ``lmdock serve`` (stories260K
on hf, loopback), built on the chat path: the same prompt and greedy text as ``/v1/chat/completions``.

The server's template renders each message on its own line and the tools' names (a Hermes-style
``<tool_call>`` template, so the parser is recognized from it); a forced ``tool_choice`` is what
makes this model call.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import openai
import pytest
from serve_helpers import WEATHER, Server, agent_server

TOOL = {"name": "get_weather", "description": "the weather", "input_schema": WEATHER}
ASK = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = agent_server(tmp_path_factory.mktemp("messages"))
    yield s
    s.stop()


def client(server: Server, **kw: object) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=server.url, max_retries=0, **kw)  # type: ignore[arg-type]


def chat(server: Server, messages: list[dict[str, str]], max_tokens: int, model: str = "stories", **kw: object) -> object:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **kw)  # type: ignore[call-overload]


def prompt(usage: object) -> int:
    """The prompt's tokens: those computed and those the prefix cache gave."""
    return usage.input_tokens + usage.cache_read_input_tokens  # type: ignore[attr-defined, no-any-return]


def ref_tokens(server: Server, messages: list[dict[str, str]]) -> int:
    """The prompt tokens chat counts for ``messages`` on the thinker."""
    return chat(server, messages, 1, model="thinker").usage.prompt_tokens  # type: ignore[attr-defined, no-any-return]


def test_text_is_the_chat_paths_text(served: Server) -> None:
    """``POST /v1/messages`` through the anthropic client: the chat path's text."""
    m = client(served).messages.create(model="stories", max_tokens=20, messages=ASK)  # type: ignore[arg-type]
    ref = chat(served, ASK, 20)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "stories"
    (block,) = m.content
    assert block.type == "text" and block.text == ref.choices[0].message.content  # type: ignore[attr-defined]
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (prompt(m.usage), m.usage.output_tokens) == (ref.usage.prompt_tokens, 20)  # type: ignore[attr-defined]


def test_system_as_a_field_and_as_a_role_inside_messages(served: Server) -> None:
    c = client(served)
    inside = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]}]
    m = c.messages.create(model="stories", max_tokens=8, system=[{"type": "text", "text": "Tell a story."}], messages=inside)  # type: ignore[arg-type, list-item]
    ref = chat(served, [{"role": "system", "content": "Tell a story."}, *inside[:1], ASK[0]], 8)
    assert m.content[0].text == ref.choices[0].message.content  # type: ignore[union-attr, attr-defined]
    assert prompt(m.usage) == ref.usage.prompt_tokens  # type: ignore[attr-defined]


def test_a_stop_sequence_is_named(served: Server) -> None:
    m = client(served).messages.create(model="stories", max_tokens=30, messages=ASK, stop_sequences=["Lily"])  # type: ignore[arg-type]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Lily"
    assert m.content[0].text.endswith("named ")  # type: ignore[union-attr]
    with client(served).messages.stream(model="stories", max_tokens=30, messages=ASK, stop_sequences=["Lily"]) as s:  # type: ignore[arg-type]
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "Lily")  # the chunk names the string
    assert streamed.content[0].text == m.content[0].text  # type: ignore[union-attr]


def test_streamed_events_come_in_anthropics_order(served: Server) -> None:
    c = client(served)
    with c.messages.stream(model="stories", max_tokens=20, messages=ASK) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    whole = c.messages.create(model="stories", max_tokens=20, messages=ASK)  # type: ignore[arg-type]
    raw = [e.type for e in events if e.type != "text"]  # "text": the helper's own event beside each delta
    deltas = raw.count("content_block_delta")
    assert deltas > 2
    assert raw == ["message_start", "content_block_start", *["content_block_delta"] * deltas, "content_block_stop",
                   "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage == whole.usage


def test_streamed_wire_has_event_names_and_a_ping(served: Server) -> None:
    body = {"model": "stories", "max_tokens": 5, "messages": ASK, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/messages", json=body) as r:
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-2:] == ["message_delta", "message_stop"]


def test_count_tokens_is_the_prompts_length(served: Server) -> None:
    c = client(served)
    n = c.messages.count_tokens(model="stories", system="Tell a story.", messages=ASK)  # type: ignore[arg-type]
    m = c.messages.create(model="stories", max_tokens=1, system="Tell a story.", messages=ASK)  # type: ignore[arg-type]
    assert n.input_tokens == prompt(m.usage) > 5


def test_errors_have_anthropics_shape(served: Server) -> None:
    c = client(served)
    cases = [({"max_tokens": 5, "messages": ASK, "extra_body": {"top_kk": 3}}, "top_kk"),
             ({"max_tokens": 5, "messages": []}, "at least 1"),
             ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, "'any' needs tools"),
             ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "'document' block"),
             ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]}, "'base64'"),
             ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "bogus"}}, "thinking"),
             ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "client tools only")]
    for kw, words in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="stories", **kw)  # type: ignore[call-overload]
        assert e.value.body["type"] == "error", kw  # type: ignore[index]
        assert e.value.body["error"]["type"] == "invalid_request_error", kw  # type: ignore[index]
        assert words in e.value.body["error"]["message"], kw  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="nope", max_tokens=5, messages=ASK)  # type: ignore[arg-type]
    assert e.value.body["error"] == {"type": "not_found_error", "message": "model 'nope' is not served here; served models: stories, thinker"}  # type: ignore[index]
    r = httpx.post(f"{served.url}/v1/messages", json={"model": "stories", "messages": ASK})  # the client checks this itself
    assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}
    r = httpx.post(f"{served.url}/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error" and "JSON" in r.json()["error"]["message"]


def test_x_api_key_is_the_key(strict: Server) -> None:
    # the anthropic client sends its key as x-api-key, which the server's guard reads: past it, this
    # server (which has no chat template) answers the request itself
    with pytest.raises(anthropic.BadRequestError, match="no chat template"):
        client(strict, api_key="sekret-key").messages.create(model="stories", max_tokens=3, messages=ASK)  # type: ignore[arg-type]
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(strict, api_key="wrong").messages.create(model="stories", max_tokens=3, messages=ASK)  # type: ignore[arg-type]
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",  # the guard's refusal, in Anthropic's body
                                                       "message": "wrong API key: send 'x-api-key: <key>'"}}


def test_the_guards_refusals_have_anthropics_shape(strict: Server) -> None:
    r = httpx.post(f"{strict.url}/v1/messages/count_tokens", json={"model": "stories", "messages": ASK})
    assert r.status_code == 401 and r.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": "missing API key: send 'x-api-key: <key>'"}}
    big = {"model": "stories", "max_tokens": 3, "messages": [{"role": "user", "content": "x" * 5000}]}
    with pytest.raises(anthropic.APIStatusError) as e:
        client(strict, api_key="sekret-key").messages.create(**big)  # type: ignore[arg-type]
    assert e.value.status_code == 413 and e.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    assert "max_body_bytes" in e.value.body["error"]["message"]  # type: ignore[index]
    r = httpx.post(f"{strict.url}/v1/chat/completions", json={"model": "stories", "messages": ASK})  # OpenAI's, elsewhere
    assert r.status_code == 401 and r.json()["error"]["message"] == "missing API key: send 'Authorization: Bearer <key>'"


def _valid_use(block: object) -> dict[str, object]:
    assert block.type == "tool_use" and block.name == "get_weather" and block.id  # type: ignore[attr-defined]
    jsonschema.validate(block.input, WEATHER)  # type: ignore[attr-defined]
    return block.input  # type: ignore[attr-defined, no-any-return]


def test_any_and_a_named_tool_call_with_valid_input(served: Server) -> None:
    c = client(served)
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}):
        m = c.messages.create(model="stories", max_tokens=100, messages=ASK, tools=[TOOL], tool_choice=choice)  # type: ignore[arg-type, list-item]
        (block,) = m.content
        _valid_use(block)
        assert m.stop_reason == "tool_use"


def test_tool_result_follows_up(served: Server) -> None:
    c = client(served)
    first = c.messages.create(model="stories", max_tokens=100, messages=ASK, tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"})  # type: ignore[arg-type, list-item]
    use = first.content[0]
    turn = [*ASK, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]  # type: ignore[union-attr]
    m = c.messages.create(model="stories", max_tokens=10, messages=turn, tools=[TOOL], tool_choice={"type": "none"})  # type: ignore[arg-type, list-item]
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function", "function": {  # type: ignore[union-attr]
                    "name": "get_weather", "arguments": json.dumps(use.input)}}]},  # type: ignore[union-attr]
                {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]  # type: ignore[union-attr]
    ref = chat(served, messages, 10, tools=[{"type": "function", "function": {"name": "get_weather", "description": "the weather",  # type: ignore[arg-type]
                                                                                "parameters": WEATHER}}], tool_choice="none")
    assert prompt(m.usage) == ref.usage.prompt_tokens > prompt(first.usage)  # type: ignore[attr-defined]
    assert m.content[0].text == ref.choices[0].message.content  # type: ignore[union-attr, attr-defined]
    assert c.messages.count_tokens(model="stories", messages=turn, tools=[TOOL]).input_tokens == prompt(m.usage)  # type: ignore[arg-type, list-item]


def test_a_streamed_call_comes_as_input_json_deltas(served: Server) -> None:
    c = client(served)
    kw = {"model": "stories", "max_tokens": 100, "messages": ASK, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}}
    with c.messages.stream(**kw) as stream:  # type: ignore[arg-type]
        events = [e for e in stream if e.type not in ("input_json", "text")]  # the helper's own events beside the deltas
        final = stream.get_final_message()
    whole = c.messages.create(**kw)  # type: ignore[arg-type]
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert deltas > 1
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas, "content_block_stop",
                     "message_delta", "message_stop"]
    assert events[1].content_block.type == "tool_use" and all(e.delta.type == "input_json_delta" for e in events[2:-3])  # type: ignore[union-attr]
    assert _valid_use(final.content[0]) == whole.content[0].input  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use" and prompt(final.usage) == prompt(whole.usage)
    assert prompt(events[0].message.usage) == prompt(whole.usage)  # type: ignore[union-attr]


def test_a_reasoning_model_answers_with_a_thinking_block(served: Server) -> None:
    # "thinker" is stories260K with the think reasoning parser; the template opens <think> (as Qwen3's
    # does) unless thinking is disabled, and this model never closes it: all its text is thinking
    c = client(served)
    m = c.messages.create(model="thinker", max_tokens=20, messages=ASK)  # type: ignore[arg-type]
    ref = chat(served, ASK, 20, model="thinker")
    (block,) = m.content
    assert block.type == "thinking" and block.thinking == ref.choices[0].message.reasoning_content  # type: ignore[union-attr, attr-defined]
    with c.messages.stream(model="thinker", max_tokens=20, messages=ASK) as stream:  # type: ignore[arg-type]
        deltas = [e.delta.thinking for e in stream if e.type == "content_block_delta"]  # type: ignore[union-attr]
        assert "".join(deltas) == stream.get_final_message().content[0].thinking == block.thinking  # type: ignore[union-attr]
    off = c.messages.create(model="thinker", max_tokens=20, messages=ASK, thinking={"type": "disabled"})  # type: ignore[arg-type]
    assert [b.type for b in off.content] == ["text"]
    # the prompt without the opened <think>: shorter, and count_tokens renders it the same way
    counted = c.messages.count_tokens(model="thinker", messages=ASK, thinking={"type": "disabled"})  # type: ignore[arg-type]
    assert counted.input_tokens == prompt(off.usage) < prompt(m.usage)
    # a thinking block in the history goes back to the template as the turn's reasoning_content
    turn = [*ASK, {"role": "assistant", "content": [block.model_dump(), {"type": "text", "text": "Hi."}]},
            {"role": "user", "content": "Then"}]
    again = c.messages.create(model="thinker", max_tokens=2, messages=turn)  # type: ignore[arg-type]
    history = [*ASK, {"role": "assistant", "content": "Hi.", "reasoning_content": block.thinking}, {"role": "user", "content": "Then"}]  # type: ignore[union-attr]
    assert prompt(again.usage) == ref_tokens(served, history)


def test_an_error_after_the_start_is_each_apis_error_event() -> None:
    # No real backend fails on cue mid-stream: this feeds the SSE re-encoder the lines the chat
    # route's stream writes (an event, then the error event of a failure in the called API's
    # dialect, then [DONE]).
    import asyncio
    from types import SimpleNamespace

    from lmdock.server._chat_bridge import _named
    from lmdock.server._errors import APIError
    from lmdock.server._responses_output import EventSequence
    from lmdock.server._sse import DONE, error_event, sse

    def lines(path: str) -> object:
        async def gen() -> object:
            for line in (sse({"type": "ping"}), error_event(SimpleNamespace(scope={"path": path}), APIError(503, "engine died")), DONE):
                yield line
        return gen()

    async def encoded(path: str, on_error: object) -> list[str]:
        return [x async for x in _named(lines(path), on_error)]  # type: ignore[arg-type]

    ping, error = asyncio.run(encoded("/v1/messages", None))
    assert ping == 'event: ping\ndata: {"type":"ping"}\n\n'
    assert error == 'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"engine died"}}\n\n'
    seq = EventSequence()
    seq.number = 7
    _, error = asyncio.run(encoded("/v1/responses", seq.error))
    head, data = error.split("\n", 1)
    assert head == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {"type": "error", "sequence_number": 7, "code": "503",
                                                       "message": "engine died", "param": None}


def test_a_client_gone_mid_stream_aborts_the_request(served: Server) -> None:
    # a forced call whose argument takes hundreds of tokens keeps the request running (no ignore_eos here)
    long = {"name": "note", "input_schema": {"type": "object", "properties": {"s": {"type": "string", "minLength": 400}}, "required": ["s"]}}
    body = {"model": "stories", "max_tokens": 460, "messages": ASK, "stream": True, "tools": [long],
            "tool_choice": {"type": "tool", "name": "note"}}
    before = served.stats()["num_requests_aborted_total"]
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{served.url}/v1/messages", json=body) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: message_start"
        assert served.stats()["num_sequences_held"] > 0
    deadline = time.monotonic() + 60
    while (served.stats()["num_sequences_held"] or served.stats()["in_flight"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = served.stats()
    assert stats["num_sequences_held"] == 0 and stats["in_flight"] == 0, stats
    # the engine ended it on an abort, not by running it to its max tokens
    assert stats["num_requests_aborted_total"] == before + 1, stats
