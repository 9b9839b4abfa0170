"""Speculative decoding's counters on ``/metrics`` (issue 42), with vLLM's names: drafts (verify rows),
draft tokens, accepted tokens, and accepted tokens per draft position (label ``position``), each a
counter under the ``lmdock:`` prefix and, with ``[server] metric_names = "vllm"``, under ``vllm:``
too.  Read from ``LLM.stats()``; only models whose engine reports them (a step engine's loop) appear."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily

_COUNTERS = {
    "spec_decode_num_drafts": "Speculative verify rows: a sequence's drafts checked in one step.",
    "spec_decode_num_draft_tokens": "Draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens the target accepted.",
}


def spec_decode_series(per_model: dict[str, dict[str, Any]], prefix: str) -> Iterable[Any]:
    models = {m: s for m, s in per_model.items() if "spec_decode_num_drafts" in s}
    if not models:
        return
    for key, doc in _COUNTERS.items():
        c = CounterMetricFamily(f"{prefix}{key}", doc, labels=["model_name"])
        for model, s in models.items():
            c.add_metric([model], float(s.get(key, 0) or 0))
        yield c
    c = CounterMetricFamily(f"{prefix}spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
                            labels=["model_name", "position"])
    for model, s in models.items():
        for pos, n in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos") or ()):
            c.add_metric([model, str(pos)], float(n))
    yield c
