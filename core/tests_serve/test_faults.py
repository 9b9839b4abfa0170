"""Faults over real HTTP: clients that go away, and SIGTERM mid-request."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
from serve_helpers import DOCUMENTED, Server

LONG = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "n": 4}
#: LONG's length, one sequence, started before it: see :func:`_witness`
WITNESS = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}


@contextlib.contextmanager
def _witness(server: Server) -> Iterator[None]:
    """A stream as long as LONG, running (unread) while inside.  It starts first and runs in the same
    engine steps as LONG, so a LONG run to its end would end after it: LONG's four sequences going
    while the witness still holds its one means LONG was aborted.  (A one-second limit on the freeing
    instead was a race: it failed on a slow machine and passed without the abort on a fast one.)"""
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json=WITNESS) as r:
        lines = r.iter_lines()  # kept: a dropped line iterator closes the response
        assert next(lines).startswith("data: ")
        yield


def _first_change(server: Server, held: int) -> dict[str, int]:
    """The stats once ``num_sequences_held`` is no longer ``held``."""
    deadline = time.monotonic() + 60
    while (stats := server.stats())["num_sequences_held"] == held and time.monotonic() < deadline:
        time.sleep(0.01)
    return stats


def _freed(server: Server) -> dict[str, int]:
    deadline = time.monotonic() + 60
    while ((stats := server.stats())["num_sequences_held"] or stats["in_flight"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return stats


def _wait_busy(server: Server, held: int) -> dict[str, int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats.get("num_sequences_held", 0) == held:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"the request never reached the engine: {server.stats()}")


def _next_request_is_served(server: Server) -> None:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert c.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0).choices[0].text == DOCUMENTED


def test_disconnect_mid_stream_frees_the_sequences(server: Server) -> None:
    with _witness(server):
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert server.stats()["num_sequences_held"] == 5  # its four and the witness's one
        stats = _first_change(server, 5)
        assert stats["num_sequences_held"] == 1, stats  # the witness's alone: aborted
    stats = _freed(server)
    assert stats["num_sequences_held"] == 0 and stats["in_flight"] == 0, stats
    _next_request_is_served(server)


def test_disconnect_mid_non_stream_frees_the_sequences(server: Server) -> None:
    body = json.dumps(LONG).encode()
    with _witness(server):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        busy = _wait_busy(server, 5)
        assert busy["in_flight"] == 5  # its n=4 sequences hold four queue places, the witness one
        sock.close()
        stats = _first_change(server, 5)
        assert stats["num_sequences_held"] == 1, stats  # the witness's alone: aborted
    stats = _freed(server)
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
