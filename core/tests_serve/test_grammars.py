"""Grammars that crash llguidance's native code (issue 39) cost their request a 400, not the server.

A Lark grammar of 5,000 chained rules and a tool schema whose ``$defs`` chain 5,000 deep overflow
llguidance's stack (docs/upstream/llguidance-deep-grammar-crash.md); the server checks every grammar
in a worker process first (``lmdock._grammar.check``), so the worker dies, the request gets a 400
naming its grammar, and the next ordinary request gets stories260K's documented greedy text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import DOCUMENTED, Server, agent_server

N = 5000


def chained_lark(n: int = N) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def chained_defs(n: int = N) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "required": ["x"], "$defs": defs}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = agent_server(tmp_path_factory.mktemp("grammars"))
    yield s
    s.stop()


def still_serving(server: Server) -> None:
    assert server.proc.poll() is None, server.output()
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "stories", "prompt": "Once upon a time", "max_tokens": 40,
                                                         "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == DOCUMENTED


def refused(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    message = body["error"]["message"]
    assert "grammar" in message and "crashed the grammar compiler" in message, message
    return message


def test_a_lark_grammar_of_5000_chained_rules_is_a_400_and_the_server_keeps_serving(served: Server) -> None:
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 5, "guided_grammar": chained_lark()}
    for _ in range(2):  # the second time the verdict is cached: refused at once, no worker spent
        refused(httpx.post(f"{served.url}/v1/completions", json=body, timeout=120))
    still_serving(served)


def test_a_tool_schema_with_defs_chained_5000_deep_is_a_400_on_messages(served: Server) -> None:
    body = {"model": "stories", "max_tokens": 20, "messages": [{"role": "user", "content": "Once upon a time"}],
            "tools": [{"name": "deep", "description": "d", "input_schema": chained_defs()}], "tool_choice": {"type": "auto"}}
    r = httpx.post(f"{served.url}/v1/messages", json=body, headers={"x-api-key": "unused"}, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and "crashed the grammar compiler" in r.json()["error"]["message"]
    still_serving(served)


def test_a_tool_schema_with_defs_chained_5000_deep_is_a_400_on_chat(served: Server) -> None:
    tool = {"type": "function", "function": {"name": "deep", "parameters": chained_defs(N + 1)}}
    body = {"model": "stories", "max_tokens": 20, "messages": [{"role": "user", "content": "Once upon a time"}],
            "tools": [tool], "tool_choice": "auto"}
    refused(httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=120))
    still_serving(served)


def test_a_regex_that_can_produce_no_token_is_a_400_before_any_step(served: Server) -> None:
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 5, "guided_regex": r"[^\s\S]"}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "cannot produce a first token" in r.json()["error"]["message"], r.text
    still_serving(served)
