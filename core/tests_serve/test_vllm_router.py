"""vLLM's Rust router (``vllm-router``, a test tool) round-robining two real ``lmdock serve`` processes:
each is an ordinary OpenAI server to it (docs/scale-out.md's recipe)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import DOCUMENTED, Server, free_port


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Server]]]:
    workers = [Server(tmp_path_factory.mktemp(f"worker{i}")) for i in range(2)]
    port = free_port()
    log = open(tmp_path_factory.mktemp("router") / "router.log", "w+b")  # noqa: SIM115 - closed below
    exe = Path(sys.executable).with_name("vllm-router")
    proc = subprocess.Popen([str(exe), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                             "--worker-urls", *(w.url for w in workers)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.seek(0) or log.read().decode(errors="replace")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vllm-router did not answer /v1/models"
            time.sleep(0.2)
        yield url, workers
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        for w in workers:
            w.stop()


def _finished(server: Server) -> float:
    """The requests ``server`` finished (``lmdock:request_success_total``, over every finish reason)."""
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text):
        if family.name == "lmdock:request_success":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return 0.0


def test_round_robin_over_two_lmdock_servers(router: tuple[str, list[Server]]) -> None:
    url, workers = router
    before = [_finished(w) for w in workers]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    for _ in range(10):
        reply = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0)
        assert reply.choices[0].text == DOCUMENTED
    served = [_finished(w) - b for w, b in zip(workers, before)]
    assert served == [5.0, 5.0], served  # round robin: every other request to each


#: what vllm-router 0.1.17 adds to a chat body it forwards (SGLang's fields, at their defaults)
ROUTER_CHAT_FIELDS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                      "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                      "return_hidden_states": False, "include_reasoning": True}


def test_the_routers_added_fields_are_taken_at_lmdocks_behaviour_and_refused_otherwise(server: Server) -> None:
    body = {"model": "stories", "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 4}
    assert httpx.post(f"{server.url}/v1/chat/completions", json={**body, **ROUTER_CHAT_FIELDS}, timeout=60).status_code == 200
    for field, value in (("no_stop_trim", True), ("include_reasoning", False), ("return_hidden_states", True)):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "what it does anyway" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "stories", "prompt": "Once", "separate_reasoning": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "separate_reasoning"  # a chat field only
