"""Admission: a model's queue places (sequences in flight), held by one HTTP request; 429 with
Retry-After when they are taken, 400 when the request could never fit."""

from __future__ import annotations

from typing import Any

from lmdock.server._errors import APIError
from lmdock.server._state import ServedModel


def sequences(prompts: int, params: Any) -> int:
    """The sequences a request adds to the engine: each prompt's ``n`` completions, or its beams."""
    return prompts * max(params.n, params.beam_width)


class Admission:
    """Holds ``count`` of a model's queue places (sequences) for one HTTP request: 429 with Retry-After
    when they are taken, 400 when the request could never fit."""

    def __init__(self, sm: ServedModel, count: int, retry_after: int) -> None:
        if count > sm.max_queue:
            raise APIError(400, f"the request adds {count} sequences (prompts x n, or beams), more than model {sm.name!r} "
                                f"ever holds at once ({sm.max_queue}; [server] max_queue): split it")
        if sm.in_flight + count > sm.max_queue:
            raise APIError(429, f"model {sm.name!r} has {sm.in_flight} sequences in flight, its limit is {sm.max_queue}; "
                                "retry after the Retry-After seconds", headers={"Retry-After": str(retry_after)})
        sm.in_flight += count
        self.sm, self.count = sm, count

    def release(self) -> None:
        if self.count:
            self.sm.in_flight -= self.count
            self.count = 0
