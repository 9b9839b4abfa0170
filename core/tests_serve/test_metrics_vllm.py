"""``[server] metric_names = "vllm"``: ``/metrics`` as the Gateway API Inference Extension's endpoint picker
reads a model server (its model-server protocol): vLLM's ``vllm:`` gauge names, parsed with
prometheus_client's own text parser as a scraper would, from a real ``lmdock serve``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import Server

GATEWAY_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info")


@pytest.fixture(scope="module")
def vllm_names(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("vllm_names"), 'metric_names = "vllm"\n')
    yield s
    s.stop()


def _scrape(server: Server) -> dict[str, list]:
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text)
    return {f.name: (f.type, f.samples) for f in families}


def test_the_gateways_gauges_under_vllm_names(vllm_names: Server) -> None:
    """On a server with ``[server] metric_names = "vllm"``, /metrics has the gauges the picker reads under vLLM's names."""
    client = openai.OpenAI(base_url=f"{vllm_names.url}/v1", api_key="none")
    stream = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0, stream=True)
    next(iter(stream))  # a request in flight while the picker scrapes
    during = _scrape(vllm_names)
    text = "".join(ch.choices[0].text for ch in stream)
    assert text
    after = _scrape(vllm_names)
    for metrics in (during, after):
        for name in GATEWAY_GAUGES:
            kind, samples = metrics[name]
            assert kind == "gauge", name
            assert [s.labels["model_name"] for s in samples] == ["stories"], name
        for key in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
            # the same engine reading under both names, in one scrape
            assert metrics[f"vllm:{key}"][1][0].value == metrics[f"lmdock:{key}"][1][0].value, key
        assert metrics["vllm:gpu_cache_usage_perc"][1][0].value == metrics["vllm:kv_cache_usage_perc"][1][0].value
        assert 0.0 <= metrics["vllm:kv_cache_usage_perc"][1][0].value <= 1.0
        (lora,) = metrics["vllm:lora_requests_info"][1]
        # no request runs under an adapter: empty lists; max_lora is the engine's (lmdock-hf's max_loras,
        # 8 by default), as lmdock's own series says; the value is the time it was read (positive)
        assert lora.labels == {"model_name": "stories", "running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "8"}
        assert lora.labels == metrics["lmdock:lora_requests_info"][1][0].labels
        assert lora.value > 0
    assert after["vllm:num_requests_running"][1][0].value == 0  # the finished request no longer counts
    assert after["vllm:num_requests_waiting"][1][0].value == 0


def test_default_names_stay_lmdock_only(server: Server) -> None:
    metrics = _scrape(server)
    assert "lmdock:num_requests_waiting" in metrics
    assert not [name for name in metrics if name.startswith("vllm:")]
