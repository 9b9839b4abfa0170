"""Faults over real HTTP: clients that go away, and SIGTERM mid-request."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import httpx
import openai
from serve_helpers import DOCUMENTED, Server

LONG = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "n": 4}


def _freed_within_a_second(server: Server) -> dict[str, int]:
    deadline = time.monotonic() + 1.0
    while True:
        stats = server.stats()
        if stats.get("num_sequences_held", 0) == 0 and stats["in_flight"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def _wait_busy(server: Server) -> dict[str, int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats.get("num_sequences_held", 0) > 0:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"the request never reached the engine: {server.stats()}")


def _next_request_is_served(server: Server) -> None:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert c.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0).choices[0].text == DOCUMENTED


def test_disconnect_mid_stream_frees_the_sequences(server: Server) -> None:
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.stats()["num_sequences_held"] > 0
    stats = _freed_within_a_second(server)
    assert stats["num_sequences_held"] == 0 and stats["in_flight"] == 0, stats
    _next_request_is_served(server)


def test_disconnect_mid_non_stream_frees_the_sequences(server: Server) -> None:
    body = json.dumps(LONG).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    busy = _wait_busy(server)
    assert busy["in_flight"] == 4  # its n=4 sequences hold four queue places
    sock.close()
    stats = _freed_within_a_second(server)
    assert stats["num_sequences_held"] == 0 and stats["in_flight"] == 0, stats
    _next_request_is_served(server)


def test_sigterm_lets_the_request_in_flight_finish_and_exits_0(tmp_path: Path) -> None:
    s = Server(tmp_path)
    try:
        body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{s.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            s.proc.send_signal(signal.SIGTERM)
            # new requests are refused (the listening socket is closed) or answered 503
            deadline = time.monotonic() + 10
            refused = None
            while refused is None and time.monotonic() < deadline:
                try:
                    resp = httpx.get(f"{s.url}/v1/models", timeout=5)
                    if resp.status_code == 503:
                        assert resp.headers["retry-after"] and resp.json()["error"]["message"]
                        refused = 503
                except httpx.ConnectError:
                    refused = "connection refused"
            assert refused is not None
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events) > 1
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
