"""What a clumsy or hostile client or operator must not get past (issue 28), health and auth: a dead engine
reported healthy, an empty API key turning auth off, a non-ASCII key that only matched as latin-1, a port
out of range bound as another.  In-process app (TestClient) over a FAKE step engine (core plumbing only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from lmdock import ConfigError, ServerConfig
from lmdock.server import ServedModel, create_app
from lmdock.server._run import is_loopback, resolve_api_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fake_serving import Failing, fake_llm  # noqa: E402
from fakes import FakeStepEngine  # noqa: E402


def test_a_dead_engine_makes_health_503_with_the_model_and_reason(registry: None) -> None:
    llm = fake_llm(Failing)
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
    llm = fake_llm(FakeStepEngine)
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
    llm = fake_llm(FakeStepEngine)
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
    from lmdock._cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", port])
    assert exc.value.code == 2
    assert "is not a port: give a number from 0 to 65535" in capsys.readouterr().err


def test_cors_preflights_allowed_and_refused_in_openais_shape(registry: None) -> None:
    llm = fake_llm(FakeStepEngine)
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
