"""The front end's ``RemoteEngine`` (``server/_ray.py``) over a FAKE Ray Serve handle: which replica
deaths are retried and which fail the request.  The fake stands in for the deployment only, to make
a replica die at a chosen point; the real deployment is tested in ``test_replicas.py``."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator
from typing import Any

import pytest
from lmdock._llm.outputs import CompletionOutput, RequestOutput
from lmdock._llm.streams import RequestStream
from lmdock._plugin.errors import EngineClosedError
from lmdock.server._ray import RETRIES, RemoteEngine
from ray.exceptions import ActorDiedError


class FakeHandle:
    """A FAKE deployment handle: each call streams from the next of ``plans`` — ``"dies"`` (the replica
    dies before its first output), ``"dies-after-one"`` or ``"ok"`` (three snapshots)."""

    def __init__(self, plans: list[str]) -> None:
        self.plans = plans
        self.calls = 0

    def options(self, **_: Any) -> FakeHandle:
        return self

    @property
    def generate(self) -> FakeHandle:
        return self

    def remote(self, request: Any) -> AsyncIterator[Any]:
        plan = self.plans[self.calls]
        self.calls += 1
        return self._stream(request, plan, f"replica{self.calls}")

    async def _stream(self, request: Any, plan: str, replica: str) -> AsyncIterator[Any]:
        if plan == "dies":
            raise ActorDiedError()
        for i in range(3):
            if plan == "dies-after-one" and i == 1:
                raise ActorDiedError()
            out = RequestOutput(request.request_id, "p", [1], [CompletionOutput(0, "x" * (i + 1), [5] * (i + 1))], i == 2)
            yield replica, out, {"kv_cache_usage_perc": 0.5} if i in (0, 2) else None


class _Request:
    request_id = "r1"


def _run(plans: list[str]) -> tuple[list[Any], RemoteEngine, FakeHandle]:
    handle = FakeHandle(plans)
    engine = RemoteEngine({"max_seq_len": 256}, handle, "m")
    sink = RequestStream("r1", lambda rid: None)

    async def go() -> None:
        engine.submit(_Request(), sink)
        await asyncio.gather(*engine.tasks.values())

    asyncio.run(go())
    items = []
    while True:
        try:
            items.append(sink.get(timeout=0))
        except queue.Empty:
            break
    return items, engine, handle


def test_a_replica_dying_before_the_first_output_is_retried_on_another() -> None:
    items, engine, handle = _run(["dies", "ok"])
    assert handle.calls == 2 and [o.outputs[0].text for o in items] == ["x", "xx", "xxx"] and items[-1].finished
    assert engine.stats()["replica_requests"] == {"replica2": 1} and not engine.tasks and not engine.running


def test_after_the_first_output_a_dead_replica_fails_the_request_with_503() -> None:
    items, engine, handle = _run(["dies-after-one", "ok"])
    assert handle.calls == 1  # what was streamed cannot be taken back: no second attempt
    assert items[0].outputs[0].text == "x"
    assert isinstance(items[1], EngineClosedError) and "replica serving the request stopped" in str(items[1])
    assert engine.stats()["replicas"] == {"replica1": {"num_requests_running": 0, "requests_total": 1}}  # its report dropped


def test_retries_are_bounded() -> None:
    items, _, handle = _run(["dies"] * (RETRIES + 1))
    assert handle.calls == RETRIES + 1
    assert len(items) == 1 and isinstance(items[0], EngineClosedError) and "before the request started" in str(items[0])


def test_stats_sum_the_replicas_and_keep_each() -> None:
    _, engine, _ = _run(["ok"])
    stats = engine.stats()
    assert stats["kv_cache_usage_perc"] == 0.5 and stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["replicas"]["replica1"]["kv_cache_usage_perc"] == 0.5 and engine.max_seq_len == 256
    with pytest.raises(AttributeError):
        engine.hidden_size  # noqa: B018 - a fact the replica did not send is absent, as on its engine
