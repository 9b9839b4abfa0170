"""The agent routes' field policy (``lmdock.server._advisory``) against a running ``lmdock serve``
(stories260K on hf, loopback): every advisory field is accepted and named in ``x-lmdock-ignored``,
the honoured ones do what the table says, and the bodies Claude Code and Codex send answer 200.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from lmdock.server._advisory import HEADER, POLICY, markdown
from serve_helpers import AGENT_TEMPLATE, WEATHER, Server, agent_server

#: the agent template, reading a reasoning_effort knob too
EFFORT_TEMPLATE = "{% if reasoning_effort is defined %}Effort: {{ reasoning_effort }}\n{% endif %}" + AGENT_TEMPLATE
TOOL = {"name": "get_weather", "description": "the weather", "input_schema": WEATHER}
ASK = [{"role": "user", "content": "Once upon a time"}]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = agent_server(tmp_path_factory.mktemp("agents"), EFFORT_TEMPLATE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The agent template, whose only reasoning knob is ``enable_thinking``; the OpenAI routes clamp ``max_tokens``."""
    s = agent_server(tmp_path_factory.mktemp("agents-plain"), server_table='max_tokens_past_context = "clamp"\n')
    yield s
    s.stop()


def messages(server: Server, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/messages", json={"model": "stories", "max_tokens": 5, "messages": ASK, **body},
                      timeout=120, **kw)


def responses(server: Server, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json={"model": "stories", "max_output_tokens": 5, "input": "Once upon a time",
                                                          **body}, timeout=120, **kw)


#: for each advisory row of the table: (request keywords, what the header names)
ADVISORY: dict[tuple[str, str], tuple[dict[str, Any], str]] = {
    ("messages", "context_management"): ({"json": {"context_management": {"edits": [{"type": "clear_thinking_20251015"}]}}},
                                         "context_management"),
    ("messages", "anthropic-beta (header)"): ({"headers": {"anthropic-beta": "interleaved-thinking-2025-05-14"}},
                                              "anthropic-beta (interleaved-thinking-2025-05-14)"),
    ("messages", "beta (query)"): ({"params": {"beta": "true"}}, "beta (query)"),
    ("messages", "cache_control"): ({"json": {"system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]}},
                                    "cache_control"),
    ("messages", "metadata.user_id"): ({"json": {"metadata": {"user_id": "user_abc"}}}, "metadata.user_id"),
    ("messages", "service_tier"): ({"json": {"service_tier": "auto"}}, "service_tier"),
    ("messages", "server tools (web_search_*, web_fetch_*, code_execution_*)"): (
        {"json": {"tools": [TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}},
        "tools[1] (web_search_20250305: no search backend)"),
    ("responses", "prompt_cache_key"): ({"json": {"prompt_cache_key": "0199a1b2-c3d4"}}, "prompt_cache_key"),
    ("responses", "client_metadata"): ({"json": {"client_metadata": {"originator": "codex_exec"}}}, "client_metadata"),
    ("responses", "service_tier"): ({"json": {"service_tier": "flex"}}, "service_tier"),
    ("responses", "hosted tools (web_search, file_search, code_interpreter, image_generation, mcp, ...)"): (
        {"json": {"tools": [{"type": "web_search", "search_context_size": "low"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}},
        "tools[0] (web_search: no search backend), tools[1] (file_search: no vector store)"),
}


def test_the_table_in_the_docs_is_the_codes() -> None:
    text = DOCS.read_text(encoding="utf-8")
    found = re.search(r"<!-- field-policy:start -->\n(.*?)<!-- field-policy:end -->", text, re.S)
    assert found is not None and found.group(1) == markdown()


def test_every_advisory_field_has_a_case_here() -> None:
    assert set(ADVISORY) == {(f.api, f.name) for f in POLICY if f.outcome == "advisory"}


@pytest.mark.parametrize("key", list(ADVISORY), ids=lambda k: f"{k[0]}:{k[1]}")
def test_an_advisory_field_is_accepted_and_named(served: Server, key: tuple[str, str]) -> None:
    kw, named = ADVISORY[key]
    send = messages if key[0] == "messages" else responses
    r = send(served, kw.get("json", {}), **{k: v for k, v in kw.items() if k != "json"})
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == named


def test_hosted_tools_alone_under_auto_leave_a_plain_answer(served: Server) -> None:
    r = responses(served, {"tools": [{"type": "web_search"}], "tool_choice": "auto"})
    assert r.status_code == 200 and r.headers[HEADER] == "tools[0] (web_search: no search backend)", r.text
    r = messages(served, {"tools": [{"type": "web_search_20250305", "name": "web_search"}], "tool_choice": {"type": "auto"}})
    assert r.status_code == 200 and r.headers[HEADER] == "tools[0] (web_search_20250305: no search backend)", r.text
    r = responses(served, {"tools": [{"type": "web_search"}], "tool_choice": "required"})  # a call to nothing: refused
    assert r.status_code == 400, r.text


def test_a_plain_request_names_nothing(served: Server) -> None:
    assert HEADER not in messages(served, {}).headers
    assert HEADER not in responses(served, {}).headers


def test_thinking_adaptive_is_the_models_default_and_disabled_turns_it_off(served: Server) -> None:
    kinds = {}
    for kind in ("adaptive", "enabled", "disabled"):
        r = messages(served, {"model": "thinker", "max_tokens": 8, "thinking": {"type": kind}})
        assert r.status_code == 200 and HEADER not in r.headers, r.text
        kinds[kind] = [b["type"] for b in r.json()["content"]]
    assert kinds["adaptive"] == kinds["enabled"] == ["thinking"]  # the template opens a thinking span unless told not to
    assert "thinking" not in kinds["disabled"]


def test_thinking_enabled_on_a_model_that_does_not_think_is_named(served: Server) -> None:
    r = messages(served, {"thinking": {"type": "enabled"}})
    assert r.status_code == 200 and r.headers[HEADER] == "thinking (the model does not think: it has no reasoning parser)"
    r = messages(served, {"thinking": {"type": "enabled", "budget_tokens": 4}})
    assert r.headers[HEADER] == ("thinking (the model does not think: it has no reasoning parser), thinking.budget_tokens "
                                 "(not held: the engine samples outside lmdock's step loop, or the prompt opens no thinking span)")


def test_a_thinking_budget_is_held(served: Server) -> None:
    """stories260K never writes </think>: unbounded, the whole answer is thinking; with a budget the
    marker is forced after that many tokens, and the answer follows as text."""
    free = messages(served, {"model": "thinker", "max_tokens": 40, "thinking": {"type": "enabled"}}).json()
    assert [b["type"] for b in free["content"]] == ["thinking"]
    for stream in (False, True):
        r = messages(served, {"model": "thinker", "max_tokens": 40, "thinking": {"type": "enabled", "budget_tokens": 6}, "stream": stream})
        assert r.status_code == 200 and HEADER not in r.headers, r.text
        if stream:
            assert '"type":"thinking_delta"' in r.text and '"type":"text_delta"' in r.text
            continue
        thinking, text = r.json()["content"]
        assert thinking["type"] == "thinking" and text["type"] == "text" and text["text"]
        assert free["content"][0]["thinking"].startswith(thinking["thinking"].strip())  # greedy: the same start, cut
        assert len(thinking["thinking"]) < len(free["content"][0]["thinking"])


def count(server: Server, body: dict[str, Any]) -> int:
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", json={"model": "stories", "messages": ASK, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["input_tokens"])


def test_effort_goes_to_a_templates_reasoning_effort(served: Server) -> None:
    """The template renders ``Effort: high`` when it gets the knob: the prompt grows, nothing is named."""
    assert count(served, {"output_config": {"effort": "high"}}) > count(served, {})
    r = messages(served, {"output_config": {"effort": "max"}})
    assert r.status_code == 200 and HEADER not in r.headers
    plain, graded = responses(served, {}), responses(served, {"reasoning": {"effort": "low"}})
    assert HEADER not in graded.headers
    assert graded.json()["usage"]["input_tokens"] > plain.json()["usage"]["input_tokens"]


def test_effort_without_a_knob_is_named(plain: Server) -> None:
    r = messages(plain, {"output_config": {"effort": "high"}})
    assert r.status_code == 200 and r.headers[HEADER] == "output_config.effort (the chat template has no reasoning_effort)"
    r = responses(plain, {"reasoning": {"effort": "high"}})
    assert r.headers[HEADER] == "reasoning.effort=high (the template's knob is enable_thinking: on, ungraded)"
    r = responses(plain, {"reasoning": {"effort": "none"}})  # off is what the knob can do: honoured, nothing named
    assert r.status_code == 200 and HEADER not in r.headers


def test_output_config_format_constrains_the_answer(served: Server) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
              "additionalProperties": False}
    r = messages(served, {"max_tokens": 60, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["content"][0]["text"]), schema)


NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Agents.",
             "tools": [{"type": "function", "name": "spawn_agent", "description": "spawn one", "parameters": WEATHER,
                        "defer_loading": False}]}


def test_a_namespace_tool_is_called_by_its_namespace_and_name(served: Server) -> None:
    r = responses(served, {"max_output_tokens": 200, "tools": [NAMESPACE], "tool_choice": "required", "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    (call,) = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert (call["namespace"], call["name"]) == ("multi_agent_v1", "spawn_agent")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    follow = [{"role": "user", "content": "Once upon a time"}, {k: call[k] for k in ("type", "call_id", "name", "arguments", "namespace")},
              {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
    r = responses(served, {"input": follow, "tools": [NAMESPACE]})
    assert r.status_code == 200, r.text


def test_a_streamed_namespace_call_names_its_namespace(served: Server) -> None:
    r = responses(served, {"max_output_tokens": 200, "tools": [NAMESPACE], "tool_choice": "required", "parallel_tool_calls": False, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert [(i["namespace"], i["name"]) for i in done] == [("multi_agent_v1", "spawn_agent")]


def test_claude_codes_first_request_answers(served: Server) -> None:
    """The fields Claude Code 2.1 sends on its first ``/v1/messages?beta=true``, streamed."""
    body = {"model": "thinker", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Once upon a time", "cache_control": {"type": "ephemeral"}}]}],
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "tools": [TOOL], "metadata": {"user_id": "user_0123"}, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}}
    r = httpx.post(f"{served.url}/v1/messages", params={"beta": "true"}, json=body, timeout=120,
                   headers={"anthropic-beta": "claude-code-20250219,context-management-2025-06-27", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == ("anthropic-beta (claude-code-20250219,context-management-2025-06-27), beta (query), "
                                 "metadata.user_id, context_management, cache_control")
    assert "event: message_stop" in r.text


def test_codexs_first_request_answers(served: Server) -> None:
    """The fields Codex 0.171 sends on ``/v1/responses`` (``wire_api = "responses"``), streamed."""
    body = {"model": "thinker", "instructions": "You are Codex.", "stream": True, "store": False, "max_output_tokens": 64,
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: read-only"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]}],
            "tools": [{"type": "function", "name": "shell", "description": "run", "parameters": WEATHER, "strict": False},
                      NAMESPACE, {"type": "web_search"}],
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199a1b2", "client_metadata": {"originator": "codex_exec"}}
    r = httpx.post(f"{served.url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == "prompt_cache_key, client_metadata, tools[2] (web_search: no search backend)"
    assert "event: response.completed" in r.text or "event: response.incomplete" in r.text


ENV = {"type": "object", "properties": {"env": {"type": "object", "propertyNames": {"type": "string"},
                                                "properties": {"HOME": {"type": "string", "maxLength": 4}}, "required": ["HOME"]}},
       "required": ["env"], "additionalProperties": False}
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2,
                                                  "uniqueItems": True}}, "required": ["tags"], "additionalProperties": False}


def test_a_keyword_the_grammar_lacks_is_loosened_not_refused(served: Server) -> None:
    """Claude Code's tools carry ``propertyNames: {type: string}`` (a no-op: dropped unnamed); ``uniqueItems``
    is loosened, named, and the call checked after generation."""
    tools = [TOOL, {"name": "run", "input_schema": ENV}, {"name": "tag", "input_schema": TAGS}]
    for name, schema in (("run", ENV), ("tag", TAGS)):
        r = messages(served, {"max_tokens": 200, "tools": tools, "tool_choice": {"type": "tool", "name": name}})
        assert r.status_code == 200, r.text
        assert r.headers.get(HEADER) == "tools.tag: uniqueItems (loosened; checked after generation)"
        (call,) = [b for b in r.json()["content"] if b["type"] == "tool_use"]
        try:
            jsonschema.validate(call["input"], schema)
        except jsonschema.ValidationError as exc:  # only what was loosened may fail, and then it is named
            assert exc.validator == "uniqueItems" and "x-lmdock-invalid-arguments" in r.headers, exc
        else:
            assert "x-lmdock-invalid-arguments" not in r.headers


def test_a_response_format_keyword_the_grammar_lacks_is_named(served: Server) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6, "not": {"const": "x"}}},
              "required": ["name"], "additionalProperties": False}
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=120, json={
        "model": "stories", "max_tokens": 40, "messages": ASK,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == "response_format: not (loosened)"
    json.loads(r.json()["choices"][0]["message"]["content"])
    r = responses(served, {"max_output_tokens": 40, "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}})
    assert r.status_code == 200 and r.headers[HEADER] == "text.format: not (loosened)", r.text


LONG = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. " * 2


def test_a_repeated_prompt_reports_its_cached_tokens_on_every_api(served: Server) -> None:
    """The second of two equal prompts takes its prefix from the prefix cache; each API says how much."""
    ask = [{"role": "user", "content": LONG}]
    for stream in (False, True):
        first = messages(served, {"messages": ask, "stream": stream})
        assert first.status_code == 200, first.text
        r = messages(served, {"messages": ask, "stream": stream})
        usage = r.json()["usage"] if not stream else json.loads(
            next(line[6:] for line in r.text.splitlines() if line.startswith('data: {"type":"message_start"')))["message"]["usage"]
        prompt = count(served, {"messages": ask})
        assert usage["cache_read_input_tokens"] > 0 and usage["cache_creation_input_tokens"] == 0
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
    body = {"model": "stories", "max_tokens": 5, "messages": ask}
    for _ in range(2):
        r = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=120).json()
    assert 0 < r["usage"]["prompt_tokens_details"]["cached_tokens"] < r["usage"]["prompt_tokens"]
    r = httpx.post(f"{served.url}/v1/completions", json={"model": "stories", "max_tokens": 5, "prompt": LONG}, timeout=120).json()
    r = httpx.post(f"{served.url}/v1/completions", json={"model": "stories", "max_tokens": 5, "prompt": LONG}, timeout=120).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for _ in range(2):
        r = responses(served, {"input": LONG})
    assert 0 < r.json()["usage"]["input_tokens_details"]["cached_tokens"] < r.json()["usage"]["input_tokens"]


def test_a_new_prompt_reports_no_cached_tokens(served: Server) -> None:
    r = httpx.post(f"{served.url}/v1/completions", json={"model": "stories", "max_tokens": 5, "prompt": "Tom had a red car."}, timeout=120)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] <= 1  # at most the BOS earlier prompts share


def test_agents_max_tokens_past_the_context_is_clamped(served: Server) -> None:
    """Claude Code sends max_tokens 32000 whatever the context (stories260K's is 512): the answer is cut
    at the context, and says so where it gets there."""
    r = messages(served, {"max_tokens": 100_000})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"]
    assert prompt + body["usage"]["output_tokens"] <= 512
    assert body["stop_reason"] == ("max_tokens" if prompt + body["usage"]["output_tokens"] == 512 else "end_turn")
    r = responses(served, {"max_output_tokens": 100_000})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] <= 512
    assert r.json()["status"] == ("incomplete" if usage["total_tokens"] == 512 else "completed")


def test_openai_routes_refuse_past_the_context_by_default(served: Server) -> None:
    r = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "stories", "max_tokens": 100_000, "messages": ASK}, timeout=60)
    assert r.status_code == 400 and "ask for at most" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_tokens"


def test_openai_routes_clamp_when_configured(plain: Server) -> None:
    for route, body in (("chat/completions", {"messages": ASK}), ("completions", {"prompt": "Once upon a time"})):
        r = httpx.post(f"{plain.url}/v1/{route}", json={"model": "stories", "max_tokens": 100_000, "ignore_eos": True, **body}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] == 512 and r.json()["choices"][0]["finish_reason"] == "length"


def test_max_tokens_past_context_is_checked_in_the_config() -> None:
    from lmdock._config.schema import build
    from lmdock._config.server import ServerConfig
    from lmdock._plugin.errors import ConfigError

    assert build(ServerConfig, {"max_tokens_past_context": "clamp"}).max_tokens_past_context == "clamp"
    with pytest.raises(ConfigError, match="max_tokens_past_context"):
        build(ServerConfig, {"max_tokens_past_context": "truncate"})
