"""lmdock._engine.inbox: typed messages into the loop, refused with the loop's error once it stops."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
from lmdock import EngineClosedError
from lmdock._engine.inbox import Abort, Add, ClearCache, Inbox, Query


class Sink:
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def put(self, output: Any) -> None:
        raise AssertionError("a refused request gets no output")

    def fail(self, error: BaseException) -> None:
        self.errors.append(error)


def test_messages_are_taken_in_order_and_refused_with_the_error_when_the_loop_dies() -> None:
    inbox, sink = Inbox(), Sink()
    query: concurrent.futures.Future[Any] = concurrent.futures.Future()
    clear: concurrent.futures.Future[None] = concurrent.futures.Future()
    add = Add(request=None, sink=sink, processors=(), constraints=None)  # type: ignore[arg-type]
    for message in (add, Abort("r1"), Query([1, 2], query), ClearCache(clear)):
        inbox.post(message)
    error = EngineClosedError("boom")
    waiting = inbox.close(error, dead=True)
    assert [type(m).__name__ for m in waiting] == ["Add", "Abort", "Query", "ClearCache"]
    for message in waiting:
        message.refuse(error)
    assert sink.errors == [error] and query.exception() is error and clear.exception() is error
    with pytest.raises(EngineClosedError, match="the engine is dead: boom"):
        inbox.post(Abort("r2"))


def test_a_shut_down_inbox_refuses_new_messages_and_drops_aborts() -> None:
    inbox = Inbox()
    inbox.shut_down()
    inbox.post_abort(Abort("r1"))  # shutdown fails whatever is in flight: nothing to abort
    messages, closing = inbox.wait(lambda: False)  # returns at once: the loop is to stop
    assert not messages and closing
    with pytest.raises(EngineClosedError, match="shut down; create a new one"):
        inbox.post(Abort("r2"))
