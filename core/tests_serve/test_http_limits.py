"""HTTP limits over a real ``lmdock serve`` (stories260K on hf) on 127.0.0.1, as a hostile client writes: huge
headers, too many headers, slow heads, connection exhaustion, shutdown past its timeout, memory after bursts,
idle keep-alive.  The last test must stay last: it checks the server that took the hostile traffic."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))



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

