"""http(s) image URLs (``[server] image_fetch``, lmdock.server._fetch): off by default, and when on
never to a private, loopback or link-local address (after redirects too) unless its network is in
``image_fetch_allow``, bounded in bytes and in time.  A real HTTP server on 127.0.0.1 (the only
address a test reaches) serves the images, allowed through ``image_fetch_allow``."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest
from lmdock import RequestError
from lmdock._config.server import ServerConfig
from lmdock._llm.multimodal import load_image
from lmdock.server._fetch import Fetcher, networks
from lmdock.server._images import limits

BODY = b"\x89PNG fake image bytes " * 100  # the fetcher returns bytes; decoding is load_image's (tested elsewhere)
LOCAL = networks(["127.0.0.1/32"])


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path
        if path == "/img":
            self._send(200, BODY, {"Content-Length": str(len(BODY))})
        elif path == "/chunked":  # no Content-Length: the bound is counted while reading
            self._send(200, BODY, {"Connection": "close"})
        elif path.startswith("/to?"):  # a redirect to the URL after '?'
            self._send(302, b"", {"Location": path[4:], "Content-Length": "0"})
        elif path == "/loop":
            self._send(302, b"", {"Location": "/loop", "Content-Length": "0"})
        elif path == "/slow":  # a byte a tenth of a second, 50 at most
            self.send_response(200)
            self.send_header("Content-Length", "50")
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self._send(404, b"no", {"Content-Length": "2"})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_off_by_default_names_the_setting() -> None:
    image_limits = limits(ServerConfig())
    assert image_limits.fetch is None
    with pytest.raises(RequestError, match=r"\[server\] image_fetch = true"):
        load_image("https://example.com/cat.png", "messages[0].content[1]", image_limits)


def test_on_gives_the_bounded_fetcher() -> None:
    fetch = limits(ServerConfig(image_fetch=True, image_fetch_max_bytes=1000, image_fetch_timeout=2.5,
                                image_fetch_allow=["10.1.0.0/16"])).fetch
    assert fetch == Fetcher(1000, 2.5, networks(["10.1.0.0/16"]))


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9/a.png",  # loopback
    "http://[::1]:9/a.png",
    "http://[::ffff:127.0.0.1]:9/a.png",  # loopback inside an IPv4-mapped IPv6 address
    "http://10.0.0.1/a.png",  # private
    "http://192.168.1.1/a.png",
    "http://169.254.169.254/latest/meta-data/",  # link-local: a cloud's metadata service
    "http://100.64.0.1/a.png",  # shared address space
    "http://0.0.0.0/a.png",
])
def test_private_addresses_are_refused(url: str) -> None:
    """Without [server] image_fetch_allow, no private, loopback, link-local or reserved address."""
    with pytest.raises(RequestError, match="private, loopback or reserved address.*image_fetch_allow"):
        Fetcher(10_000, 5.0)(url, "messages[0].content[0]")


def test_an_allowed_network_is_fetched(origin: str) -> None:
    assert Fetcher(10_000, 5.0, LOCAL)(f"{origin}/img", "x") == BODY


def test_a_redirect_to_a_private_address_is_refused(origin: str) -> None:
    for target in ("http://10.0.0.1/a.png", "http://169.254.169.254/", "http://127.0.0.2/"):
        with pytest.raises(RequestError, match=f"resolves to {target.split('/')[2]}, a private"):
            Fetcher(10_000, 5.0, LOCAL)(f"{origin}/to?{target}", "x")


def test_a_redirect_within_the_allowed_network_is_followed(origin: str) -> None:
    assert Fetcher(10_000, 5.0, LOCAL)(f"{origin}/to?{origin}/img", "x") == BODY


def test_redirects_are_bounded(origin: str) -> None:
    with pytest.raises(RequestError, match="redirected more than"):
        Fetcher(10_000, 5.0, LOCAL)(f"{origin}/loop", "x")


@pytest.mark.parametrize(("path", "why"), [("/img", "Content-Length"), ("/chunked", "body is longer")])
def test_the_size_bound(origin: str, path: str, why: str) -> None:
    """[server] image_fetch_max_bytes: from Content-Length, and counted while reading."""
    with pytest.raises(RequestError, match=f"over \\[server\\] image_fetch_max_bytes \\(100 bytes\\).*{why}"):
        Fetcher(100, 5.0, LOCAL)(f"{origin}{path}", "x")


def test_the_time_bound(origin: str) -> None:
    """The body arrives a byte each 0.1 s for 5 s: a 0.5 s [server] image_fetch_timeout on the whole fetch ends it."""
    with pytest.raises(RequestError, match="longer than \\[server\\] image_fetch_timeout"):
        Fetcher(10_000, 0.5, LOCAL)(f"{origin}/slow", "x")


def test_an_error_status_is_named(origin: str) -> None:
    with pytest.raises(RequestError, match="HTTP 404"):
        Fetcher(10_000, 5.0, LOCAL)(f"{origin}/missing", "x")


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("image_fetch_allow", ["not-a-net"], "not an IP network"),
    ("image_fetch_timeout", 0, "> 0 seconds"),
    ("image_fetch_max_bytes", 0, "image_fetch_max_bytes"),
])
def test_bad_settings_are_refused(key: str, value: object, needle: str) -> None:
    with pytest.raises(Exception, match=needle) as info:
        ServerConfig(**{key: value})
    assert key in str(info.value)
