"""No 500 from a body (issue 39): property-based fuzzing of every route of the real app (stories260K on
lmdock-hf, in-process over ASGI with Starlette's TestClient) with hypothesis, plus the four bodies that
were 500s, as named tests.

Each route has a valid seed body; hypothesis replaces one value anywhere in it (a field, a block's
``type``, a tool's ``format``...) with an arbitrary JSON value, deletes a key, adds an unknown one, or
sends bytes that are not JSON.  Every answer must be a 2xx, or a 4xx in OpenAI's error body (Anthropic's
on ``/v1/messages``); a 5xx, or an exception escaping the app (a dropped connection to a client),
fails.  Bounded: a fixed number of examples per route, derandomized so CI runs the same cases.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lmdock import LLM, ServerConfig
from lmdock.server import ServedModel, create_app
from serve_helpers import DOCUMENTED, models_dir

sys.path.insert(0, str(Path(__file__).parent))
from test_lora import _adapter  # noqa: E402

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
MESSAGES_BODY = {
    "model": "stories", "max_tokens": 4, "system": [{"type": "text", "text": "s"}], "stop_sequences": ["zz"],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "x"}, {"type": "text", "text": "a"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "r"}]}]},
    ],
    "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}],
    "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u"}, "temperature": 0,
}
RESPONSES_BODY = {
    "model": "stories", "max_output_tokens": 4, "instructions": "i", "temperature": 0,
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "g", "input": "abc"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
    ],
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}},
              {"type": "custom", "name": "g", "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]+"}}],
    "tool_choice": "auto", "text": {"format": {"type": "text"}}, "reasoning": {"effort": "low", "summary": "auto"},
    "metadata": {"k": "v"}, "include": ["reasoning.encrypted_content"],
}
#: A valid body per POST route (``{lora}``: the adapter folder); every route the app has must be here.
SEEDS: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "stories", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "logprobs": 1,
                        "echo": False, "stop": ["zz"], "n": 1, "seed": 1, "logit_bias": {"5": 1.0}},
    "/v1/chat/completions": {"model": "stories", "messages": [{"role": "system", "content": "s"},
                                                              {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                             "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 1,
                             "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    "/v1/messages": MESSAGES_BODY,
    "/v1/messages/count_tokens": {k: v for k, v in MESSAGES_BODY.items() if k not in ("max_tokens", "stop_sequences", "temperature", "metadata")},
    "/v1/responses": RESPONSES_BODY,
    "/tokenize": {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True},
    "/detokenize": {"model": "stories", "tokens": [1, 403, 407]},
    "/v1/embeddings": {"model": "stories", "input": ["a", "b"], "encoding_format": "float"},
    "/v1/score": {"model": "stories", "text_1": "a", "text_2": ["b"]},
    "/score": {"model": "stories", "text_1": "a", "text_2": ["b"]},
    "/v1/rerank": {"model": "stories", "query": "q", "documents": ["a"], "top_n": 1},
    "/rerank": {"model": "stories", "query": "q", "documents": ["a"], "top_n": 1},
    "/v1/load_lora_adapter": {"lora_name": "sql", "lora_path": "{lora}", "model": "stories"},
    "/v1/unload_lora_adapter": {"lora_name": "nope", "model": "stories"},
    "/v1/models/{model_id}/load": {},
    "/v1/models/{model_id}/unload": {},
}
#: Examples for the routes with the richest bodies (30 for the others).
RICH = {"/v1/messages": 150, "/v1/responses": 150, "/v1/chat/completions": 80, "/v1/completions": 60}
#: Routes whose path holds an id (fuzzed as arbitrary text), and those without a body.
PATH_ROUTES = {"/v1/models/{model_id}", "/v1/models/{model_id}/load", "/v1/models/{model_id}/unload", "/v1/responses/{response_id}"}
KINDS = ["text", "message", "user", "assistant", "system", "developer", "tool", "function", "custom", "grammar", "regex", "lark",
         "json_schema", "json_object", "tool_use", "tool_result", "thinking", "input_text", "auto", "any", "none", "required",
         "reasoning", "function_call", "function_call_output", "stories", "stories:sql"]

json_leaf = (st.none() | st.booleans() | st.integers(-3, 600) | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
             | st.text(max_size=12) | st.sampled_from(KINDS))
json_value = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8) | st.sampled_from(KINDS), kids, max_size=3),
                          max_leaves=8)


def _paths(value: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value (the root excluded), containers and leaves."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        out.append((*here, key))
        out += _paths(item, (*here, key))
    return out


def _mutated(seed: dict[str, Any], data: st.DataObject) -> Any:
    body = json.loads(json.dumps(seed))
    paths = _paths(body)
    how = data.draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "root"]))
    if how == "root" or not paths:
        return data.draw(json_value)
    *parent_path, key = data.draw(st.sampled_from(paths))
    parent = body
    for p in parent_path:
        parent = parent[p]
    if how == "replace":
        parent[key] = data.draw(json_value)
    elif how == "delete":
        del parent[key]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=8))] = data.draw(json_value)
    else:
        parent.append(data.draw(json_value))
    return body


def _check(route: str, r: Any) -> None:
    assert r.status_code < 500, f"{route}: {r.status_code} {r.text[:500]}"
    if r.status_code < 400:
        return
    body = r.json()
    if route.startswith("/v1/messages"):  # Anthropic's shape
        assert body["type"] == "error" and isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str), body
    else:
        assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body


APP: list[Any] = []  # the app under test, for its routes and state


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path]]:
    folder = _adapter(tmp_path_factory.mktemp("fuzz") / "sql", 1)
    llm = LLM(str(models_dir()), backend="hf", sampling={"temperature": 0.0, "max_new_tokens": 8}, backends={"hf": {"num_threads": 1}})
    settings_ = ServerConfig(allow_runtime_lora_updating=True, max_n=4, max_logprobs=5)
    application = create_app([ServedModel("stories", llm, 64, TEMPLATE)], settings_)
    APP[:] = [application]
    # raise_server_exceptions: an exception escaping the app (what a client sees as a dropped connection) fails the test
    with TestClient(application, raise_server_exceptions=True) as client:
        yield client, folder
    llm.shutdown()


def _post_routes() -> list[str]:
    """The app's POST routes, from its routers (``create_app`` includes every one of ``ROUTERS``)."""
    from lmdock.server._app import ROUTERS

    return sorted({r.path.replace(":path", "") for m in ROUTERS for r in m.router.routes if "POST" in getattr(r, "methods", ())})


def test_every_post_route_has_a_seed(app: tuple[TestClient, Path]) -> None:
    assert set(_post_routes()) == set(SEEDS)


def _send(client: TestClient, route: str, body: Any, folder: Path, path_id: str = "stories") -> Any:
    quoted = urllib.parse.quote(path_id, safe="")
    url = route.replace("{model_id}", quoted).replace("{response_id}", quoted)
    content = json.dumps(body).replace('"{lora}"', json.dumps(str(folder))).encode() if not isinstance(body, bytes) else body
    return client.post(url, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("route", sorted(SEEDS))
def test_a_fuzzed_body_is_a_2xx_or_a_4xx_in_the_apis_error_shape(app: tuple[TestClient, Path], route: str) -> None:
    client, folder = app

    @settings(max_examples=RICH.get(route, 30), deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(["mutate"] * 6 + ["bytes"]))
        body: Any = data.draw(st.binary(max_size=40)) if kind == "bytes" else _mutated(SEEDS[route], data)
        path_id = data.draw(st.sampled_from(["stories"]) | st.text(min_size=1, max_size=10)) if route in PATH_ROUTES else "stories"
        _check(route, _send(client, route, body, folder, path_id))

    assert _send(client, route, SEEDS[route], folder).status_code < 500  # the seed itself
    run()
    stats = APP[0].state.lmdock.models["stories"].llm.stats()
    assert stats["num_sequences_held"] == 0, stats


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(path_id=st.text(min_size=1, max_size=16), method=st.sampled_from(["GET", "DELETE"]))
def test_fuzzed_ids_in_get_and_delete_routes_are_never_a_5xx(app: tuple[TestClient, Path], path_id: str, method: str) -> None:
    client, _ = app
    for route in ("/v1/models/{model_id}", "/v1/responses/{response_id}"):
        if method == "DELETE" and "models" in route:
            continue
        quoted = urllib.parse.quote(path_id, safe="")
        url = route.replace("{model_id}", quoted).replace("{response_id}", quoted)
        _check(url, client.request(method, url))


# -- the four bodies that were 500s (issue 39) ------------------------------------------------


@pytest.mark.parametrize("kind", [["text"], {"type": "text"}])
def test_a_messages_block_whose_type_is_a_list_or_an_object_is_a_400(app: tuple[TestClient, Path], kind: Any) -> None:
    client, _ = app
    body = {"model": "stories", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": kind, "text": "hi"}]}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and "messages.0.content.0.type must be a string" in r.json()["error"]["message"]


def test_a_responses_message_whose_role_is_a_list_is_a_400(app: tuple[TestClient, Path]) -> None:
    client, _ = app
    r = client.post("/v1/responses", json={"model": "stories", "input": [{"type": "message", "role": ["user"], "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input.0.role" and "must be a string" in r.json()["error"]["message"]


def test_a_responses_custom_tool_whose_format_is_a_string_is_a_400(app: tuple[TestClient, Path]) -> None:
    client, _ = app
    r = client.post("/v1/responses", json={"model": "stories", "input": "hi", "tools": [{"type": "custom", "name": "g", "format": "text"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools.0.format" and "must be an object" in r.json()["error"]["message"]


def test_after_the_fuzzing_the_known_greedy_text_is_served(app: tuple[TestClient, Path]) -> None:
    client, _ = app
    r = client.post("/v1/completions", json={"model": "stories", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0})
    assert r.json()["choices"][0]["text"] == DOCUMENTED


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_chat_message_whose_role_is_not_a_string_is_a_400(app: tuple[TestClient, Path], route: str) -> None:
    """It was rendered as if it had a role (a 200 from a body the template never understood)."""
    client, _ = app
    r = client.post(route, json={"model": "stories", "messages": [{"role": {"x": 1}, "content": "hi"}], "max_tokens": 2}
                    if route != "/tokenize" else {"model": "stories", "messages": [{"role": ["user"], "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.role" and "must be a string" in r.json()["error"]["message"]
