"""State a client can grow is bounded in bytes (issue 39): the Responses store keeps compact JSON, not
the request's objects, and drops its least recently used responses past ``[server]
response_store_max_bytes``.  A real ``lmdock serve`` (stories260K on hf), its RSS read with psutil."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import DOCUMENTED, Server


def big_body(i: int, kib: int = 900) -> dict[str, Any]:
    """A /v1/responses body of about ``kib`` KiB, nearly all small JSON objects (a tool's parameters,
    which the response carries back and the store keeps; ``tool_choice: none`` so nothing compiles them)."""
    count = kib * 1024 // 45
    properties = {f"p{i}_{j}": {"type": "string", "description": "d"} for j in range(count)}
    return {"model": "stories", "input": "Once upon a time", "max_output_tokens": 2, "tool_choice": "none",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": properties}}]}


def _server(tmp: Path, store_bytes: int) -> Server:
    """stories260K with a chat template (the Responses API renders one) and bodies up to 2 MiB."""
    (tmp / "t.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    return Server(tmp, f"max_body_bytes = 2097152\nresponse_store_max_bytes = {store_bytes}\n", args=("--chat-template", str(tmp / "t.jinja")))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = _server(tmp_path_factory.mktemp("bounded"), 150_000_000)
    yield s
    s.stop()


def test_sixty_stored_responses_of_0_9_mb_grow_rss_by_under_200_mb(server: Server) -> None:
    """The issue's figure: 60 such responses cost ~11 MB each (+675 MB) when the store kept the
    request's objects; as JSON bytes they cost about their size.  The first one is still readable, with its
    tools, and a turn continues it."""
    import psutil

    proc = psutil.Process(server.proc.pid)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for i in range(3):  # warm-up: the parsing path's one-time costs
            assert c.post("/v1/responses", json={**big_body(1000 + i), "store": False}).status_code == 200
        before = proc.memory_info().rss
        ids = []
        for i in range(60):
            r = c.post("/v1/responses", json=big_body(i))
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        grown = proc.memory_info().rss - before
        assert grown < 200 * 2**20, f"60 stored responses grew RSS by {grown >> 20} MiB"
        first = c.get(f"/v1/responses/{ids[0]}").json()
        assert first["id"] == ids[0] and len(first["tools"][0]["parameters"]["properties"]) == len(big_body(0)["tools"][0]["parameters"]["properties"])
        r = c.post("/v1/responses", json={"model": "stories", "previous_response_id": ids[-1], "input": "", "max_output_tokens": 2})
        assert r.status_code == 200, r.text


def test_past_the_byte_bound_the_least_recently_used_response_goes(tmp_path: Path) -> None:
    """With ``[server] response_store_max_bytes`` room for about three such responses (and
    ``max_body_bytes`` 2 MiB, for the bodies), the fourth pushes out the least recently used (the
    first, unless it was read since), and the server keeps serving the known text."""
    s = _server(tmp_path, 3_000_000)
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            ids = [c.post("/v1/responses", json=big_body(i)).json()["id"] for i in range(3)]
            assert c.get(f"/v1/responses/{ids[0]}").status_code == 200  # ids[0] used: ids[1] is now the oldest
            ids.append(c.post("/v1/responses", json=big_body(3)).json()["id"])
            assert [c.get(f"/v1/responses/{i}").status_code for i in ids] == [200, 404, 200, 200]
            r = c.post("/v1/responses", json={"model": "stories", "previous_response_id": ids[1], "input": "x"})
            assert r.status_code == 400 and "past the store's bound" in r.json()["error"]["message"]
            out = c.post("/v1/completions", json={"model": "stories", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0})
            assert out.json()["choices"][0]["text"] == DOCUMENTED
    finally:
        s.stop()
