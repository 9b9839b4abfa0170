"""http(s) image URLs, fetched for a served request where ``[server] image_fetch`` is on (docs/vision.md).

A URL in a request is the client's choice of where this server connects, so each fetch is bounded:

- **where**: the host is resolved first and every address it resolves to must be public
  (``ipaddress``'s ``is_global``: no loopback, private, link-local, shared or reserved range) unless it
  lies in ``[server] image_fetch_allow`` (networks the operator names, an internal image host).  The
  connection goes to the address that was checked, never to a second resolution of the name (DNS
  rebinding), and each redirect's target is checked the same way;
- **how much**: ``image_fetch_max_bytes``, from ``Content-Length`` before the body and counted while
  reading it;
- **how long**: ``image_fetch_timeout`` seconds for the whole fetch, redirects and name resolution
  included.

It runs where the request's images are decoded: on a worker thread, never on the server's event loop.
Stdlib only (``http.client``), so the server needs no HTTP client library for it.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from lmdock._plugin.errors import RequestError

#: redirects followed before the fetch is refused (each target checked as the first URL)
MAX_REDIRECTS = 3
_REDIRECTS = {301, 302, 303, 307, 308}
_CHUNK = 65536


@dataclass(frozen=True)
class Fetcher:
    """Fetches one image URL under ``[server]``'s bounds; called as ``fetch(url, where) -> bytes``."""

    max_bytes: int
    timeout: float
    allow: tuple[Any, ...] = ()  # ipaddress networks exempt from the public-address rule

    @classmethod
    def from_settings(cls, settings: Any) -> Fetcher:
        return cls(settings.image_fetch_max_bytes, settings.image_fetch_timeout, networks(settings.image_fetch_allow))

    def __call__(self, url: str, where: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        for _ in range(MAX_REDIRECTS + 1):
            location = self._get(url, where, deadline)
            if isinstance(location, bytes):
                return location
            url = urljoin(url, location)
        raise RequestError(f"{where}: the image URL redirected more than {MAX_REDIRECTS} times; send the image's final URL or a data URL")

    def _get(self, url: str, where: str, deadline: float) -> bytes | str:
        """The body of ``url``, or the ``Location`` it redirects to."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RequestError(f"{where}: {url[:200]!r} is not an http(s) URL with a host")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = self._address(parts.hostname, port, where, deadline)
        conn = _connection(parts.scheme, parts.hostname, port, address, _left(deadline, where))
        try:
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "lmdock"})
            response = conn.getresponse()
            if response.status in _REDIRECTS:
                location = response.getheader("Location")
                if not location:
                    raise RequestError(f"{where}: the image URL answered {response.status} without a Location")
                return location
            if response.status != 200:
                raise RequestError(f"{where}: fetching the image URL gave HTTP {response.status} {response.reason}")
            return self._body(response, conn, where, deadline)
        except (OSError, http.client.HTTPException) as exc:
            raise _failed(exc, where, self.timeout) from None
        finally:
            conn.close()

    def _address(self, host: str, port: int, where: str, deadline: float) -> str:
        """The address to connect to: every address ``host`` resolves to is public or allowed."""
        addresses = _resolve(host, port, where, _left(deadline, where))
        for address in addresses:
            ip = ipaddress.ip_address(address.split("%")[0])
            ip = getattr(ip, "ipv4_mapped", None) or ip
            if not ip.is_global and not any(ip in net for net in self.allow):
                raise RequestError(f"{where}: the image URL's host {host!r} resolves to {ip}, a private, loopback or reserved "
                                   "address this server does not fetch from (add its network to [server] image_fetch_allow "
                                   "if it is yours), or send the image as a data URL")
        return addresses[0]

    def _body(self, response: Any, conn: Any, where: str, deadline: float) -> bytes:
        size = response.getheader("Content-Length")
        if size is not None and size.isdigit() and int(size) > self.max_bytes:
            raise _too_big(where, self.max_bytes, f"its Content-Length is {size} bytes")
        data = bytearray()
        while chunk := _read(response, conn, _left(deadline, where)):
            data += chunk
            if len(data) > self.max_bytes:
                raise _too_big(where, self.max_bytes, "its body is longer")
        return bytes(data)


def networks(values: Sequence[str]) -> tuple[Any, ...]:
    """``image_fetch_allow``'s entries as networks (ValueError naming a bad one)."""
    return tuple(ipaddress.ip_network(v, strict=False) for v in values)


def _left(deadline: float, where: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise RequestError(f"{where}: fetching the image URL took longer than [server] image_fetch_timeout; send a data URL")
    return left


def _resolve(host: str, port: int, where: str, timeout: float) -> list[str]:
    """``host``'s addresses, within ``timeout`` (getaddrinfo has no timeout of its own: it runs on a
    daemon thread that is left behind, not waited for, when it is slow)."""
    result: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            result.append([info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)])
        except OSError as exc:
            result.append(exc)
        done.set()

    threading.Thread(target=run, name="lmdock-image-resolve", daemon=True).start()
    if not done.wait(timeout):
        raise RequestError(f"{where}: resolving {host!r} took longer than [server] image_fetch_timeout")
    if isinstance(result[0], OSError) or not result[0]:
        raise RequestError(f"{where}: the image URL's host {host!r} does not resolve ({result[0]})")
    return list(result[0])


def _connection(scheme: str, host: str, port: int, address: str, timeout: float) -> http.client.HTTPConnection:
    """A connection to ``address`` that speaks to ``host`` (Host header, TLS server name and certificate)."""
    if scheme == "https":
        return _PinnedHTTPS(host, port, address, timeout=timeout, context=ssl.create_default_context())
    return _PinnedHTTP(host, port, address, timeout=timeout)


class _PinnedHTTP(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, address: str, **kwargs: Any) -> None:
        super().__init__(host, port, **kwargs)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, address: str, context: ssl.SSLContext, **kwargs: Any) -> None:
        super().__init__(host, port, context=context, **kwargs)
        self.address, self.tls = address, context

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self.tls.wrap_socket(sock, server_hostname=self.host)  # the name is what the certificate must match


def _read(response: Any, conn: Any, timeout: float) -> bytes:
    if conn.sock is not None:
        conn.sock.settimeout(timeout)  # each read waits at most what is left of the whole fetch's time
    return bytes(response.read1(_CHUNK))


def _too_big(where: str, limit: int, why: str) -> RequestError:
    return RequestError(f"{where}: the image URL's content is over [server] image_fetch_max_bytes ({limit} bytes): {why}; "
                        "send a smaller image")


def _failed(exc: BaseException, where: str, timeout: float) -> RequestError:
    if isinstance(exc, TimeoutError | socket.timeout):
        return RequestError(f"{where}: fetching the image URL took longer than [server] image_fetch_timeout ({timeout} s); "
                            "send a data URL")
    return RequestError(f"{where}: fetching the image URL failed ({type(exc).__name__}: {exc})")
