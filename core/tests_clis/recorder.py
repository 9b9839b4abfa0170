"""A loopback HTTP proxy that records each request's path and JSON body and streams the answer back
unchanged: the tests read what the CLIs sent to ``lmdock serve``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "accept-encoding"}


class Recorder:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.bodies: list[tuple[str, Any]] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                try:
                    recorder.bodies.append((self.path, json.loads(body)))
                except ValueError:
                    recorder.bodies.append((self.path, None))
                self._forward(body)

            def _forward(self, body: bytes | None) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                with httpx.stream(self.command, recorder.upstream + self.path, headers=headers, content=body, timeout=600) as r:
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in HOP and k.lower() != "content-encoding":
                            self.send_header(k, v)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for chunk in r.iter_bytes():  # decoded; SSE events pass as they come
                        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args: object) -> None:
                pass

        return Handler
