"""Requests past what the server takes are a 400 naming the field and the limit, never a 500 or a hang:
work bounds and admission, chat templates a request sends or that run away, floats out of OpenAI's
ranges, max_tokens past the context, lone surrogates, image parts, errors that name the served model.
In-process app (TestClient) over a FAKE step engine (core plumbing only)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from lmdock import ServerConfig
from lmdock.server import ServedModel, create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fake_serving import fake_llm  # noqa: E402
from fakes import FakeStepEngine  # noqa: E402


@pytest.mark.parametrize(
    ("route", "body", "param", "says"),
    [
        ("/v1/completions", {"prompt": "ab", "n": 200, "max_tokens": 1}, "n", "n=200: this server returns at most 128 completions per prompt ([server] max_n)"),
        ("/v1/completions", {"prompt": "ab", "logprobs": 512, "max_tokens": 1}, "logprobs", "512 logprobs per token asked for: this server returns at most 20 (logprobs / top_logprobs; [server] max_logprobs)"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "logprobs": True, "top_logprobs": 21, "max_tokens": 1},
         "logprobs", "at most 20"),
        ("/v1/completions", {"prompt": "ab", "stop": [f"s{i}" for i in range(65)], "max_tokens": 1}, "stop", "65 stop strings: this server takes at most 64 ([server] max_stop_strings)"),
        ("/v1/completions", {"prompt": "ab", "stop": ["x" * 1025], "max_tokens": 1}, "stop", "1025 characters: this server takes at most 1024 ([server] max_stop_length)"),
        ("/v1/completions", {"prompt": ["ab"] * 50, "n": 2, "max_tokens": 1}, None, "adds 100 sequences"),
    ],
)
def test_work_past_the_servers_bounds_is_a_400_naming_the_limit(registry: None, route: str, body: dict[str, Any],
                                                                 param: str | None, says: str) -> None:
    llm = fake_llm(FakeStepEngine)
    try:
        app = create_app([ServedModel("stories", llm, 64, "{% for m in messages %}{{ m['content'] }}{% endfor %}")], ServerConfig())
        client = TestClient(app)
        r = client.post(route, json={"model": "stories", **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert says in error["message"] and error["param"] == param
        ok = client.post("/v1/completions", json={"model": "stories", "prompt": "ab", "n": 2, "logprobs": 20, "max_tokens": 2})
        assert ok.status_code == 200  # the server and the engine carry on
        assert app.state.lmdock.models["stories"].in_flight == 0
    finally:
        llm.shutdown()


def test_admission_counts_a_requests_sequences(registry: None) -> None:
    """A request takes one queue place per sequence it adds: with 4 places, n=3 fits and n=5 cannot."""
    llm = fake_llm(FakeStepEngine)
    try:
        app = create_app([ServedModel("stories", llm, 4)], ServerConfig())
        client = TestClient(app)
        assert client.post("/v1/completions", json={"prompt": "ab", "n": 3, "max_tokens": 1}).status_code == 200
        r = client.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 3, "max_tokens": 1})
        assert r.status_code == 400 and "adds 6 sequences" in r.json()["error"]["message"]
        sm = app.state.lmdock.models["stories"]
        sm.in_flight = 2  # two sequences of other requests in flight
        r = client.post("/v1/completions", json={"prompt": "ab", "n": 3, "max_tokens": 1})
        assert r.status_code == 429 and r.headers["retry-after"]
        sm.in_flight = 0
    finally:
        llm.shutdown()


def test_server_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="max_n"):
        ServerConfig(max_n=0)
    with pytest.raises(ValueError, match="max_logprobs"):
        ServerConfig(max_logprobs=-1)
    assert ServerConfig(max_logprobs=0).max_logprobs == 0
    for name, bad in (("max_header_bytes", 0), ("max_headers", 0), ("max_connections", 0), ("header_timeout", 0.0),
                      ("keep_alive_timeout", -1.0)):
        with pytest.raises(ValueError, match=name):
            ServerConfig(**{name: bad})


class JinjaTokenizer:
    """The FAKE tokenizer rendering templates with jinja2's sandbox, as transformers does."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None, **kw: Any) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        return ImmutableSandboxedEnvironment().from_string(chat_template or self.chat_template).render(messages=messages)


class JinjaEngine(FakeStepEngine):
    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = JinjaTokenizer(self.tokenizer)


LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}x{% endfor %}{% endfor %}{% endfor %}"


def _chat(client: TestClient, **extra: Any) -> Any:
    return client.post("/v1/chat/completions", json={"model": "stories", "messages": [{"role": "user", "content": "ab"}],
                                                     "max_tokens": 2, **extra})


def test_a_requests_template_is_refused_unless_trusted(registry: None) -> None:
    llm = fake_llm(JinjaEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()))
        r = _chat(client, chat_template="{{ messages[0]['content'] }}!")
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        assert "trust_request_chat_template" in r.json()["error"]["message"]
        assert _chat(client).status_code == 200  # the model's own template renders
        trusting = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig(trust_request_chat_template=True)))
        assert _chat(trusting, chat_template="{{ messages[0]['content'] }}!").status_code == 200
    finally:
        llm.shutdown()


def test_a_runaway_template_stops_at_the_time_limit_and_the_server_answers_meanwhile(registry: None) -> None:
    import threading
    import time

    llm = fake_llm(JinjaEngine)
    try:
        settings = ServerConfig(trust_request_chat_template=True, template_timeout=1.5)
        client = TestClient(create_app([ServedModel("stories", llm, 8)], settings))
        result: dict[str, Any] = {}

        def runaway() -> None:
            t0 = time.monotonic()
            result["response"] = _chat(client, chat_template=LOOPS)
            result["seconds"] = time.monotonic() - t0

        worker = threading.Thread(target=runaway)
        worker.start()
        time.sleep(0.3)
        health = [client.get("/health").status_code for _ in range(3)]  # answered while the template runs
        assert _chat(client).status_code == 200
        worker.join(timeout=30)
        assert not worker.is_alive()
        r = result["response"]
        assert r.status_code == 400 and "took longer than 1.5 s" in r.json()["error"]["message"], r.text
        assert result["seconds"] < 10
        assert health == [200, 200, 200]
    finally:
        llm.shutdown()


def test_a_template_that_renders_too_much_text_is_refused(registry: None) -> None:
    llm = fake_llm(JinjaEngine)
    try:
        settings = ServerConfig(trust_request_chat_template=True, max_prompt_chars=1000)
        client = TestClient(create_app([ServedModel("stories", llm, 8)], settings))
        r = _chat(client, chat_template="{{ 'a' * 5000 }}")
        assert r.status_code == 400 and "rendered 5000 characters, more than 1000" in r.json()["error"]["message"]
        assert _chat(client).status_code == 200
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": "ab", "temperature": 3}, "temperature"),
        ("/v1/completions", {"prompt": "ab", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "ab", "frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "ab", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "ab", "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "temperature": -0.5}, "temperature"),
    ],
)
def test_floats_out_of_openais_ranges_are_a_400_naming_the_field(registry: None, route: str, body: dict[str, Any], param: str) -> None:
    llm = fake_llm(JinjaEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()))
        r = client.post(route, json={"model": "stories", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        llm.shutdown()


def test_an_infinite_temperature_is_a_400(registry: None) -> None:
    llm = fake_llm(JinjaEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()))
        raw = b'{"model": "stories", "prompt": "ab", "max_tokens": 2, "temperature": 1e999}'
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    finally:
        llm.shutdown()


def test_max_tokens_past_the_context_is_a_400_and_a_default_is_cut(registry: None) -> None:
    llm = fake_llm(JinjaEngine)  # the FAKE engine's context: 256 tokens
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()))
        r = client.post("/v1/completions", json={"model": "stories", "prompt": "ab", "max_tokens": 1_000_000_000})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "max_tokens" and "context is 256" in error["message"]
        r = _chat(client, max_completion_tokens=300)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
        ok = client.post("/v1/completions", json={"model": "stories", "prompt": "ab", "max_tokens": 250})
        assert ok.status_code == 200
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("route", "body", "where"),
    [
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x\udfffy"}], "max_tokens": 2}, "messages.0.content"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_not_a_500(registry: None, route: str, body: dict[str, Any], where: str) -> None:
    import json

    llm = fake_llm(JinjaEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()), raise_server_exceptions=False)
        raw = json.dumps({"model": "stories", **body}).encode()  # json.dumps writes the surrogate as \\ud800
        r = client.post(route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert where in r.json()["error"]["message"] and "surrogate" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json={"model": "stories", "prompt": "ab", "max_tokens": 1}).status_code == 200
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("body", "param"),
    [({"min_tokens": -1}, "min_tokens"), ({"max_completion_tokens": -3}, "max_completion_tokens"), ({"max_tokens": 0}, "max_tokens")],
)
def test_errors_name_the_field_the_client_sent(registry: None, body: dict[str, Any], param: str) -> None:
    """Not lmdock's own names (``max_new_tokens``, ``min_new_tokens``) for what the client called otherwise."""
    llm = fake_llm(JinjaEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()))
        r = _chat(client, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(param) and "_new_tokens" not in r.json()["error"]["message"]
    finally:
        llm.shutdown()


def test_an_image_part_is_refused_not_ignored(registry: None) -> None:
    """On the FAKE backend (no vision capability) an image is a 400 saying so; a part lmdock never
    reads (audio) is a 400 naming it (docs/vision.md)."""
    llm = fake_llm(JinjaEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()), raise_server_exceptions=False)
        parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        r = client.post("/v1/chat/completions", json={"model": "stories", "messages": [{"role": "user", "content": parts}], "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "backend 'fake' cannot read images" in r.json()["error"]["message"]
        parts[1] = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
        r = client.post("/v1/chat/completions", json={"model": "stories", "messages": [{"role": "user", "content": parts}], "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages.0.content.1.type" and "'input_audio'" in error["message"]
    finally:
        llm.shutdown()


def test_errors_name_the_served_model_never_its_path(registry: None, tmp_path: Path) -> None:
    """A chat with no template, embeddings from a generating model: the client reads the served name."""
    llm = fake_llm(FakeStepEngine)  # the FAKE tokenizer has no chat template; its model "path" is "m"
    secret = str(tmp_path / "models" / "private-checkpoint")
    object.__setattr__(llm.model_config, "model", secret)  # as a model loaded from a folder on the server
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()), raise_server_exceptions=False)
        for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}),
                            ("/v1/embeddings", {"input": "ab"}),
                            ("/tokenize", {"messages": [{"role": "user", "content": "ab"}]})):
            r = client.post(route, json={"model": "stories", **body})
            assert r.status_code == 400, (route, r.text)
            assert secret not in r.text and "private-checkpoint" not in r.text, (route, r.text)
            assert "stories" in r.json()["error"]["message"], (route, r.text)
    finally:
        llm.shutdown()


def test_a_request_cut_by_shutdown_is_a_503_with_retry_after() -> None:
    """Past shutdown_timeout uvicorn cancels what still runs: that is a 503 to retry, not a 500."""
    import asyncio

    from lmdock.server._errors import as_api_error

    error = as_api_error(asyncio.CancelledError(), 3)
    assert error.status == 503 and error.headers == {"Retry-After": "3"}
    assert "shutting down" in error.body()["error"]["message"]
