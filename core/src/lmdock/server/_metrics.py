"""``/metrics``: Prometheus text with vLLM's metric names under the ``lmdock:`` prefix, labelled by model.

Gauges (requests running and waiting, KV-cache usage, preemptions, sequences held) are read from
``LLM.stats()`` at scrape time, each key defaulting to 0 where the engine does not report it; token
counts and latencies are measured by the server from what it sends.  The model pool adds loads, load
seconds, unloads by reason (``evicted``, ``keep_alive``, ``request``) and, per model, whether it is loaded
and the memory its load measured.

With ``[server] metric_names = "vllm"`` the engine gauges are exported a second time under vLLM's own
names, the ones the Gateway API Inference Extension's endpoint picker (llm-d, KServe) scrapes from a
model server (its model-server protocol): ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` and its older name ``vllm:gpu_cache_usage_perc``, and
``vllm:lora_requests_info``, whose labels name the adapters running and waiting and the most the engine
holds at once, and whose value is the time it was read (the picker keeps the newest series).

A model served by Ray Serve replicas (``lmdock serve --replicas``) reports the gauges summed over its
replicas (KV-cache usage: their mean), and each replica's under ``lmdock:replica_*`` with a ``replica``
label, with ``lmdock:replica_requests_total``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lmdock.server._spec_metrics import spec_decode_series

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_GAUGES = {
    "num_requests_running": "Requests running in the engine (a batch slot each).",
    "num_requests_waiting": "Requests waiting for a batch slot.",
    "kv_cache_usage_perc": "KV-cache usage, 0 to 1.",
    "num_sequences_held": "Sequences the backend holds KV state for.",
}


#: vLLM's name for each engine gauge the inference gateway reads (KV-cache usage under both its names).
_VLLM_GAUGES = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict[str, dict[str, Any]]], vllm_names: bool = False) -> None:
        self._stats = stats
        self._vllm_names = vllm_names

    def collect(self) -> Iterable[Any]:
        per_model = self._stats()
        for key, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"lmdock:{key}", doc, labels=["model_name"])
            for model, s in per_model.items():
                g.add_metric([model], float(s.get(key, 0) or 0))
            yield g
        yield _lora_info("lmdock:lora_requests_info", "LoRA adapters of running and waiting requests (vLLM's lora_requests_info, "
                         "for adapter-aware routers); the value is the scrape's Unix time.", per_model, every_model=False)
        c = CounterMetricFamily("lmdock:num_preemptions", "Preemptions by the scheduler.", labels=["model_name"])
        for model, s in per_model.items():
            c.add_metric([model], float(s.get("num_preemptions_total", 0) or 0))
        yield c
        yield from _replica_series(per_model)
        yield from spec_decode_series(per_model, "lmdock:")
        if self._vllm_names:
            yield from _vllm_gauges(per_model)
            yield from spec_decode_series(per_model, "vllm:")


def _replica_series(per_model: dict[str, dict[str, Any]]) -> Iterable[Any]:
    """Per Ray Serve replica of a model served by replicas (``server/_ray.py``; its stats' ``replicas``):
    the gauges it reports, labelled by replica, and the requests it has served."""
    rows = [(model, replica, s) for model, stats in per_model.items() for replica, s in (stats.get("replicas") or {}).items()]
    if not rows:
        return
    for key in ("num_requests_running", "kv_cache_usage_perc", "num_sequences_held"):
        g = GaugeMetricFamily(f"lmdock:replica_{key}", f"{_GAUGES[key]} One Ray Serve replica's (lmdock serve --replicas).",
                              labels=["model_name", "replica"])
        for model, replica, s in rows:
            if key in s:
                g.add_metric([model, replica], float(s[key]))
        yield g
    c = CounterMetricFamily("lmdock:replica_requests", "Requests each Ray Serve replica has served.", labels=["model_name", "replica"])
    for model, replica, s in rows:
        c.add_metric([model, replica], float(s.get("requests_total", 0)))
    yield c


def _vllm_gauges(per_model: dict[str, dict[str, Any]]) -> Iterable[Any]:
    """The gauges under vLLM's names; LoRA adapters from the engine's ``running_lora_adapters``,
    ``waiting_lora_adapters`` (names) and ``max_lora`` stats, empty and 0 where it reports none."""
    for key, names in _VLLM_GAUGES.items():
        for name in names:
            g = GaugeMetricFamily(name, f"{_GAUGES[key]} (vLLM's name)", labels=["model_name"])
            for model, s in per_model.items():
                g.add_metric([model], float(s.get(key, 0) or 0))
            yield g
    yield _lora_info("vllm:lora_requests_info", "LoRA adapters running and waiting; the value is when it was read.",
                     per_model, every_model=True)


def _lora_info(name: str, doc: str, per_model: dict[str, dict[str, Any]], *, every_model: bool) -> Any:
    """The ``lora_requests_info`` gauge: per model, the adapters of running and waiting requests (the
    engine's comma-separated ``running_lora_adapters`` / ``waiting_lora_adapters``) and ``max_lora``;
    ``every_model``: a series (empty, 0) for an engine that reports none too, as the gateway reads it."""
    g = GaugeMetricFamily(name, doc, labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    now = time.time()
    for model, s in per_model.items():
        if every_model or "running_lora_adapters" in s:  # a step engine's loop reports them
            g.add_metric([model, str(s.get("running_lora_adapters") or ""), str(s.get("waiting_lora_adapters") or ""),
                          str(int(s.get("max_lora", 0) or 0))], now)
    return g


class _PoolCollector:
    """Per model: loaded (1) or not (0), and the resident bytes its last load measured while it is loaded."""

    def __init__(self, models: Callable[[], dict[str, tuple[bool, int | None]]]) -> None:
        self._models = models

    def collect(self) -> Iterable[Any]:
        models = self._models()
        loaded = GaugeMetricFamily("lmdock:model_loaded", "1 while the model is loaded, else 0.", labels=["model_name"])
        resident = GaugeMetricFamily("lmdock:model_resident_bytes",
                                     "Memory the model's load took (measured: process RSS, plus GPU memory), while loaded.",
                                     labels=["model_name"])
        for model, (is_loaded, size) in models.items():
            loaded.add_metric([model], 1.0 if is_loaded else 0.0)
            resident.add_metric([model], float(size or 0) if is_loaded else 0.0)
        yield loaded
        yield resident


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, dict[str, Any]]],
                 models: Callable[[], dict[str, tuple[bool, int | None]]] | None = None, names: str = "lmdock") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = ["model_name"]
        self.prompt_tokens = Counter("lmdock:prompt_tokens", "Prompt tokens processed.", m, registry=r)
        self.generation_tokens = Counter("lmdock:generation_tokens", "Tokens generated.", m, registry=r)
        self.success = Counter("lmdock:request_success", "Requests finished, by finish reason.", [*m, "finished_reason"], registry=r)
        self.ttft = Histogram("lmdock:time_to_first_token_seconds", "Time to the first generated token.", m, buckets=_TTFT, registry=r)
        self.itl = Histogram("lmdock:inter_token_latency_seconds", "Time between generated tokens.", m, buckets=_ITL, registry=r)
        self.e2e = Histogram("lmdock:e2e_request_latency_seconds", "Arrival to last token.", m, buckets=_E2E, registry=r)
        self.queue = Histogram("lmdock:request_queue_time_seconds",
                               "Arrival to the first output from the engine (queueing plus prefill).", m, buckets=_E2E, registry=r)
        self.model_loads = Counter("lmdock:model_loads", "Model loads that succeeded.", m, registry=r)
        self.model_load_seconds = Histogram("lmdock:model_load_seconds", "Time to load a model.", m, buckets=_E2E, registry=r)
        self.model_unloads = Counter("lmdock:model_unloads", "Models unloaded, by reason (evicted, keep_alive, request).",
                                     [*m, "reason"], registry=r)
        r.register(_EngineCollector(stats, vllm_names=names == "vllm"))
        if models is not None:
            r.register(_PoolCollector(models))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one engine request's token timings from its snapshots."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.m = metrics
        self.model = model
        self.arrival = time.perf_counter()
        self.last: float | None = None
        self.tokens = 0

    def snapshot(self, out: Any) -> None:
        now = time.perf_counter()
        tokens = sum(len(o.token_ids) for o in out.outputs)
        if tokens > self.tokens:
            if self.last is None:
                self.m.ttft.labels(self.model).observe(now - self.arrival)
                self.m.queue.labels(self.model).observe(now - self.arrival)
            else:
                gap = (now - self.last) / (tokens - self.tokens)
                for _ in range(tokens - self.tokens):
                    self.m.itl.labels(self.model).observe(gap)
            self.tokens, self.last = tokens, now
        if out.finished:
            self.m.prompt_tokens.labels(self.model).inc(len(out.prompt_token_ids))
            self.m.generation_tokens.labels(self.model).inc(tokens)
            self.m.e2e.labels(self.model).observe(now - self.arrival)
            for o in out.outputs:
                self.m.success.labels(self.model, o.finish_reason or "stop").inc()
