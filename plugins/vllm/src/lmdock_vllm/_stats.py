"""vLLM's scheduler statistics, kept for :meth:`lmdock_vllm._engine.VllmEngine.stats` (the server's /metrics).

vLLM hands its scheduler and iteration statistics to stat loggers only, wherever its engine core runs
(this process or its own); :func:`stat_logger` is a logger class that records them into :class:`Stats`
and logs nothing.
"""

from __future__ import annotations

from typing import Any


class Stats:
    """The latest counts from vLLM's scheduler, and the preemptions seen so far."""

    def __init__(self) -> None:
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.preemptions = 0
        self.running_requests = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            self.kv_usage = float(scheduler_stats.kv_cache_usage)
        if iteration_stats is not None:
            self.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)

    def idle(self) -> None:
        self.running = self.waiting = 0
        self.kv_usage = 0.0

    def reset(self) -> None:
        self.idle()
        self.running_requests = 0

    def snapshot(self) -> dict[str, Any]:
        return {
            "num_requests_running": self.running,
            "num_requests_waiting": self.waiting,
            "kv_cache_usage_perc": self.kv_usage,
            "num_preemptions_total": self.preemptions,
            # vLLM holds KV blocks for its running requests (a preempted one frees them and waits)
            "num_sequences_held": self.running,
        }


def stat_logger(stats: Stats) -> Any:
    """A vLLM stat-logger factory feeding ``stats`` (and logging nothing)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            stats.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return Recorder
