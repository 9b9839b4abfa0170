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
        #: speculative decoding (vLLM's SpecDecodingStats, per step, summed); None until vLLM reports one
        self.spec: dict[str, Any] | None = None

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            self.kv_usage = float(scheduler_stats.kv_cache_usage)
            self._record_spec(getattr(scheduler_stats, "spec_decoding_stats", None))
        if iteration_stats is not None:
            self.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)

    def _record_spec(self, step: Any) -> None:
        if step is None:
            return
        if self.spec is None:
            self.spec = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
        s = self.spec
        s["drafts"] += int(step.num_drafts)
        s["draft_tokens"] += int(step.num_draft_tokens)
        s["accepted"] += int(step.num_accepted_tokens)
        pos, step_pos = s["per_pos"], list(step.num_accepted_tokens_per_pos)
        pos.extend([0] * (len(step_pos) - len(pos)))
        for i, n in enumerate(step_pos):
            pos[i] += int(n)

    def spec_snapshot(self) -> dict[str, Any]:
        """The step loop's ``spec_decode_*`` keys (lmdock._engine.speculative), from vLLM's counts."""
        if self.spec is None:
            return {}
        s = self.spec
        return {
            "spec_decode_num_drafts": s["drafts"],
            "spec_decode_num_draft_tokens": s["draft_tokens"],
            "spec_decode_num_accepted_tokens": s["accepted"],
            "spec_decode_num_accepted_tokens_per_pos": list(s["per_pos"]),
            "spec_decode_acceptance_rate": s["accepted"] / s["draft_tokens"] if s["draft_tokens"] else 0.0,
            "spec_decode_mean_accepted_length": 1 + s["accepted"] / s["drafts"] if s["drafts"] else 0.0,
        }

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
        } | self.spec_snapshot()


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
