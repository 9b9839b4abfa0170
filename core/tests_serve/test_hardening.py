"""What a clumsy or hostile client or operator must not get past (issue 28): a dead engine reported
healthy, an empty API key turning auth off, a non-ASCII key that only matched as latin-1, a port out
of range bound as another.  Request-level checks use the in-process app (TestClient) over a FAKE step
engine (core plumbing only: ``core/tests/fakes.py``); the HTTP limits, the cut at shutdown and memory
after bursts use real ``lmdock serve`` subprocesses (stories260K on hf) over raw sockets and httpx.
The last test must stay last: it checks the server that took the hostile traffic."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from lmdock import LLM, ConfigError, ServerConfig, _plugins
from lmdock.backend import Backend, BackendSpec
from lmdock.server import ServedModel, create_app
from lmdock.server._run import is_loopback, resolve_api_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fakes import FakeStepEngine  # noqa: E402


class Failing(FakeStepEngine):
    """Every step raises: after three in a row the runner declares the engine dead."""

    def step(self, chunks: Any) -> Any:
        raise RuntimeError("FAKE device lost")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A fresh registry with no autoloaded plugins, in a folder with no config file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LMDOCK_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LMDOCK_DISABLE_PLUGIN_AUTOLOAD", "1")
    _plugins.reset_registry()
    yield
    _plugins.reset_registry()


def _llm(engine: type[FakeStepEngine]) -> LLM:
    spec = BackendSpec(name="fake", kind="step", plugin_api="1.0", supports=frozenset({"generate"}), description="FAKE test backend")
    _plugins.get_registry().add_plugin(Backend(spec, load=lambda *a: engine()), "fake")
    return LLM("m", backend="fake")


def test_a_dead_engine_makes_health_503_with_the_model_and_reason(registry: None) -> None:
    llm = _llm(Failing)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()), raise_server_exceptions=False)
        assert client.get("/health").status_code == 200
        assert client.head("/health").status_code == 200
        for _ in range(3):  # three failed steps in a row: dead
            r = client.post("/v1/completions", json={"model": "stories", "prompt": "ab", "max_tokens": 2})
            assert r.status_code >= 500
        r = client.get("/health")
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "stories" in message and "declared dead" in message
        assert r.headers["retry-after"]
        assert client.head("/health").status_code == 503
    finally:
        llm.shutdown()


def test_health_is_200_and_head_works_on_a_live_engine(registry: None) -> None:
    llm = _llm(FakeStepEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()))
        r = client.post("/v1/completions", json={"model": "stories", "prompt": "ab", "max_tokens": 2})
        assert r.status_code == 200
        assert client.get("/health").json() == {"status": "ok"}
        head = client.head("/health")
        assert head.status_code == 200 and head.content == b""
    finally:
        llm.shutdown()


def test_a_non_ascii_key_matches_as_utf8(registry: None) -> None:
    key = "clé-ключ-鍵"
    llm = _llm(FakeStepEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig(), key))
        body = {"model": "stories", "prompt": "ab", "max_tokens": 1}
        ok = client.post("/v1/completions", json=body, headers={"Authorization": b"Bearer " + key.encode("utf-8")})
        assert ok.status_code == 200, ok.text  # the key's UTF-8 bytes, as clients send it
        latin1 = client.post("/v1/completions", json=body, headers={"Authorization": b"Bearer " + key.encode("utf-8")[:-1]})
        assert latin1.status_code == 401
    finally:
        llm.shutdown()


@pytest.mark.parametrize("empty", ["", "   "])
def test_an_empty_key_from_any_source_is_refused(empty: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LMDOCK_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="--api-key is empty"):
        resolve_api_key(ServerConfig(), empty)
    monkeypatch.setenv("LMDOCK_API_KEY", empty)
    with pytest.raises(ConfigError, match=r"\$LMDOCK_API_KEY is empty"):
        resolve_api_key(ServerConfig())
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key="")
    monkeypatch.setenv("LMDOCK_API_KEY", "k")
    assert resolve_api_key(ServerConfig()) == "k" and resolve_api_key(ServerConfig(), "c") == "c"


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.4", "example.org"))


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_out_of_range_is_refused_before_anything_binds(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdock._cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", port])
    assert exc.value.code == 2
    assert "is not a port: give a number from 0 to 65535" in capsys.readouterr().err


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
    llm = _llm(FakeStepEngine)
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
    llm = _llm(FakeStepEngine)
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
    llm = _llm(JinjaEngine)
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

    llm = _llm(JinjaEngine)
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
    llm = _llm(JinjaEngine)
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
    llm = _llm(JinjaEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()))
        r = client.post(route, json={"model": "stories", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        llm.shutdown()


def test_an_infinite_temperature_is_a_400(registry: None) -> None:
    llm = _llm(JinjaEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()))
        raw = b'{"model": "stories", "prompt": "ab", "max_tokens": 2, "temperature": 1e999}'
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    finally:
        llm.shutdown()


def test_max_tokens_past_the_context_is_a_400_and_a_default_is_cut(registry: None) -> None:
    llm = _llm(JinjaEngine)  # the FAKE engine's context: 256 tokens
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

    llm = _llm(JinjaEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig()), raise_server_exceptions=False)
        raw = json.dumps({"model": "stories", **body}).encode()  # json.dumps writes the surrogate as \\ud800
        r = client.post(route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert where in r.json()["error"]["message"] and "surrogate" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json={"model": "stories", "prompt": "ab", "max_tokens": 1}).status_code == 200
    finally:
        llm.shutdown()


def test_serve_help_names_every_route(registry: None, capsys: pytest.CaptureFixture[str]) -> None:
    """`lmdock serve --help` lists what the app serves (read from the app's own routes)."""
    from lmdock._cli import main

    llm = _llm(FakeStepEngine)
    try:
        app = create_app([ServedModel("stories", llm, 8)], ServerConfig())
        paths = set(app.openapi()["paths"])  # FastAPI's own list of the app's routes
    finally:
        llm.shutdown()
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert len(paths) >= 15 and "/v1/completions" in paths
    missing = sorted(p for p in paths if p.replace("{model_id}", "{id}") not in text)
    assert not missing, f"lmdock serve --help does not name {missing}"


def test_vllm_style_serve_path_with_vllms_flags(tmp_path: Path) -> None:
    """`lmdock serve PATH --served-model-name NAME --max-model-len N --dtype float32`, as `vllm serve` takes it."""
    import httpx
    from serve_helpers import DOCUMENTED, Server, models_dir

    s = Server(tmp_path, args=(str(models_dir()), "--backend", "hf", "--served-model-name", "tiny",
                               "--max-model-len", "128", "--dtype", "float32"))
    try:
        cards = httpx.get(f"{s.url}/v1/models").json()["data"]
        assert [(c["id"], c["max_model_len"], c["backend"]) for c in cards] == [("tiny", 128, "hf")]
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 40,
                                                          "temperature": 0}, timeout=120)
        assert r.json()["choices"][0]["text"] == DOCUMENTED
    finally:
        s.stop()


def test_served_model_name_names_one_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdock._cli import main

    (tmp_path / "lmdock.toml").write_text('[models.a]\nmodel = "x"\n[models.b]\nmodel = "y"\n', encoding="utf-8")
    code = main(["serve", "--config", str(tmp_path / "lmdock.toml"), "-m", "a", "-m", "b", "--served-model-name", "z"])
    assert code == 2 and "--served-model-name names one model; 2 are served" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "param"),
    [({"min_tokens": -1}, "min_tokens"), ({"max_completion_tokens": -3}, "max_completion_tokens"), ({"max_tokens": 0}, "max_tokens")],
)
def test_errors_name_the_field_the_client_sent(registry: None, body: dict[str, Any], param: str) -> None:
    """Not lmdock's own names (``max_new_tokens``, ``min_new_tokens``) for what the client called otherwise."""
    llm = _llm(JinjaEngine)
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
    llm = _llm(JinjaEngine)
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


def test_cors_preflights_allowed_and_refused_in_openais_shape(registry: None) -> None:
    llm = _llm(FakeStepEngine)
    try:
        client = TestClient(create_app([ServedModel("stories", llm, 8)], ServerConfig(cors_origins=("https://app.example",))))
        ask = {"Access-Control-Request-Method": "POST"}
        ok = client.options("/v1/completions", headers={"Origin": "https://app.example", **ask})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        refused = client.options("/v1/completions", headers={"Origin": "https://evil.example", **ask})
        assert refused.status_code == 400 and refused.headers["content-type"].startswith("application/json")
        error = refused.json()["error"]
        assert "Disallowed CORS origin" in error["message"] and "cors_origins" in error["message"]
    finally:
        llm.shutdown()


def test_errors_name_the_served_model_never_its_path(registry: None, tmp_path: Path) -> None:
    """A chat with no template, embeddings from a generating model: the client reads the served name."""
    llm = _llm(FakeStepEngine)  # the FAKE tokenizer has no chat template; its model "path" is "m"
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


# -- HTTP limits, over a real `lmdock serve` on 127.0.0.1 (raw sockets, as a hostile client writes) ----


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server with small HTTP limits: 8 KiB of headers, 20 header lines, 16 connections, heads within 2 s."""
    from serve_helpers import Server

    s = Server(tmp_path_factory.mktemp("limited"),
               "max_header_bytes = 8192\nmax_headers = 20\nmax_connections = 16\nheader_timeout = 2.0\nkeep_alive_timeout = 1.0\n")
    yield s
    s.stop()


def _status(sock: Any) -> tuple[int, bytes]:
    """The status of the answer on ``sock`` and all it read, up to the server's close."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return (int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0), data


def test_a_64_mb_header_is_refused_with_431_without_growing_memory(limited: Any) -> None:
    import socket

    import psutil

    rss = psutil.Process(limited.proc.pid).memory_info().rss
    sock = socket.create_connection(("127.0.0.1", limited.port), timeout=30)
    sent = 0
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
        chunk = b"a" * (1 << 20)
        for _ in range(64):
            sock.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    status, data = _status(sock)
    sock.close()
    assert sent < 32 << 20, "the server read the header on and on"
    assert status in (431, 0), data[:200]  # 431, unless the reset overtook it
    if status:
        assert b"max_header_bytes" in data
    assert psutil.Process(limited.proc.pid).memory_info().rss - rss < 16 << 20
    assert httpx.get(f"{limited.url}/health", timeout=10).status_code == 200


def test_max_connections_past_the_open_files_limit_is_warned_of(capsys: pytest.CaptureFixture[str]) -> None:
    from lmdock.server._run import raise_fd_limit

    raise_fd_limit(1)
    assert capsys.readouterr().err == ""
    raise_fd_limit(10**9)  # more than any hard limit: the kernel would refuse connections before any 503
    assert "fewer than [server] max_connections (1000000000)" in capsys.readouterr().err


def test_more_headers_than_the_limit_is_a_431(limited: Any) -> None:
    """``[server] max_headers`` (20 on ``limited``)."""
    headers = {f"x-h{i}": "v" for i in range(30)}
    r = httpx.get(f"{limited.url}/v1/models", headers=headers, timeout=10)
    assert r.status_code == 431 and "max_headers" in r.json()["error"]["message"]
    r = httpx.get(f"{limited.url}/v1/models", headers={"x-big": "a" * 20000}, timeout=10)  # whole in one read
    assert r.status_code == 431 and "max_header_bytes" in r.json()["error"]["message"]
    assert httpx.get(f"{limited.url}/v1/models", timeout=10).status_code == 200


def test_slow_heads_time_out_and_exhaustion_is_a_503_not_a_lock_out(limited: Any) -> None:
    """20 connections sending their headers a byte at a time (slowloris), past max_connections (16): a
    client meanwhile gets 503 with Retry-After, the slow ones are answered 408 and closed at
    header_timeout, and then the client is served."""
    import socket
    import threading

    stop = threading.Event()
    socks = [socket.create_connection(("127.0.0.1", limited.port), timeout=30) for _ in range(20)]

    def trickle(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
            while not stop.wait(0.2):
                sock.sendall(b"x")  # never a complete header line

    threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in socks]
    for t in threads:
        t.start()
    try:
        # at once: the server accepts connections in order, so the slow ones are counted first, and
        # the 503 must come before their header_timeout (2 s) closes them (a pause here only ate into it)
        r = httpx.get(f"{limited.url}/v1/models", timeout=10)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] and "max_connections" in r.json()["error"]["message"]
        answers = [_status(s) for s in socks]  # each ends when the server closes it
        assert [a[0] for a in answers] == [408] * 20, answers[0]
        assert b"header_timeout" in answers[0][1]
        served = httpx.get(f"{limited.url}/v1/models", timeout=10)
        assert served.status_code == 200
    finally:
        stop.set()
        for s in socks:
            s.close()


def test_shutdown_past_its_timeout_ends_streams_with_an_error_event_and_answers_keep_alive_requests_503(tmp_path: Path) -> None:
    """shutdown_timeout = 0: a stream in flight at SIGTERM gets an error event (503, retry) then
    ``[DONE]``; a request sent meanwhile on an idle keep-alive connection gets 503 with Retry-After
    (uvicorn had closed that connection: the client read nothing)."""
    import json
    import signal
    import time

    from serve_helpers import Server

    s = Server(tmp_path, "shutdown_timeout = 0\nkeep_alive_timeout = 30.0\n")
    try:
        with httpx.Client(timeout=60) as idle, httpx.Client(timeout=60) as streaming:
            assert idle.get(f"{s.url}/v1/models").status_code == 200  # leaves a keep-alive connection open
            body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "n": 8, "stream": True}
            with streaming.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                s.proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
            time.sleep(0.2)
            again = idle.get(f"{s.url}/v1/models")
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert "shutting down" in error["message"] and error["code"] == "503", error
        assert again.status_code == 503 and again.headers["retry-after"], again.text
        assert again.headers["connection"] == "close" and "shutting down" in again.json()["error"]["message"]
        assert s.proc.wait(60) == 0
    finally:
        s.stop()


def test_memory_returns_after_a_burst_of_large_n_and_logprobs(tmp_path: Path) -> None:
    """After a burst of n=128 and logprobs=20 requests the server's RSS comes back within 5% of its level
    before (it stayed at the burst's peak: the KV slots a burst grew were kept, and glibc kept what
    was freed).  The warm-up pays the one-time costs of the logprobs path first; the burst's KV
    slots (512 sequences) are what must come back."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import psutil
    from serve_helpers import Server

    s = Server(tmp_path, "max_queue = 1024\n")
    try:
        proc = psutil.Process(s.proc.pid)
        lp = {"n": 16, "max_tokens": 64, "logprobs": 20, "temperature": 1.0}
        wide = {"n": 128, "max_tokens": 64, "temperature": 1.0}

        def burst(bodies: list[dict[str, Any]]) -> None:
            def one(body: dict[str, Any]) -> int:
                return httpx.post(f"{s.url}/v1/completions", json={"model": "stories", "prompt": "Once upon a time", **body},
                                  timeout=300).status_code

            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(one, bodies)) == [200] * len(bodies)

        for _ in range(2):  # warm-up: the logprobs path's one-time costs (its allocator arenas) reach their plateau
            burst([lp] * 4 + [{**wide, "n": 8}])
        time.sleep(3)  # idle: the server trims after a quiet second
        before = proc.memory_info().rss
        burst([wide] * 4 + [lp] * 4)
        deadline = time.monotonic() + 30
        while (after := proc.memory_info().rss) > before * 1.05 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert after <= before * 1.05, f"RSS {before >> 20} MiB before the burst, {after >> 20} MiB after"
        assert s.stats()["num_sequences_held"] == 0
    finally:
        s.stop()


def test_an_idle_keep_alive_connection_closes_after_keep_alive_timeout(limited: Any) -> None:
    """``[server] keep_alive_timeout`` (1 s on ``limited``): a second request on the connection at once
    is answered; idle past the timeout, the server has closed it."""
    import socket
    import time

    def ask(sock: Any) -> bytes:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data

    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as sock:
        assert ask(sock).startswith(b"HTTP/1.1 200") and ask(sock).startswith(b"HTTP/1.1 200")
        time.sleep(3)
        assert sock.recv(65536) == b""  # closed by the server


# -- keep last: the server that took the hostile traffic above still serves, and holds nothing -------


def test_after_the_hostile_suite_the_known_greedy_text_is_served_and_nothing_is_held(limited: Any) -> None:
    """Last in this file on purpose (pytest runs a file in order): ``limited`` took the oversized and
    countless headers and the slow connections above.  Passes on its own too (a fresh server)."""
    import time

    import openai
    from serve_helpers import DOCUMENTED

    client = openai.OpenAI(base_url=f"{limited.url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0)
    assert out.choices[0].text == DOCUMENTED
    deadline = time.monotonic() + 10  # the last request's sequences are released as its answer goes out
    while (stats := limited.stats())["num_sequences_held"] or stats["in_flight"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["num_sequences_held"] == 0 and stats["in_flight"] == 0
