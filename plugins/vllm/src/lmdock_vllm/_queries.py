"""Next-token logprobs (``RequestEngine.next_token_logprobs``) as vLLM requests, and their results.

Each query is one vLLM request for one greedy token with the whole vocabulary's logprobs (vLLM's raw
log-softmax: lmdock sets ``logprobs_mode``), genlm-backend's ``AsyncVirtualLM`` approach.  Queries for
the same prefix in flight share one request; results are kept least recently used first, ~64 MiB of
float32 rows.  Everything here runs on the engine thread, except :func:`settle`, which any thread may
call.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lmdock import RequestError

from lmdock_vllm._convert import one_token_params


@dataclass
class Query:
    key: tuple[int, ...]
    futures: list[concurrent.futures.Future[Any]]


def settle(future: concurrent.futures.Future[Any], value: Any = None, error: BaseException | None = None) -> None:
    """Set a future's outcome unless its caller cancelled it meanwhile (never raises)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


class NextTokenQueries:
    """The queries in flight (by vLLM request id) and the results cache (by prefix)."""

    def __init__(self, engine: Any, vocab_size: int, ids: Iterator[int]) -> None:
        self._engine = engine  # vLLM's LLMEngine
        self._vocab_size = vocab_size
        self._ids = ids  # shared with the beams' request ids
        self._in_flight: dict[str, Query] = {}
        self._results: OrderedDict[tuple[int, ...], Any] = OrderedDict()  # least recent first
        self._max_results = max(64, 2**24 // max(1, vocab_size))  # ~64 MiB of float32 rows, at least 64 of them

    def __len__(self) -> int:
        return len(self._in_flight)

    def owns(self, rid: str) -> bool:
        return rid in self._in_flight

    def ask(self, key: tuple[int, ...], future: concurrent.futures.Future[Any]) -> None:
        """Answer from the cache, join the same prefix in flight, or add a vLLM request."""
        cached = self._results.get(key)
        if cached is not None:
            self._results.move_to_end(key)
            settle(future, cached.copy())
            return
        for query in self._in_flight.values():  # the same prefix already asked: wait for that one
            if query.key == key:
                query.futures.append(future)
                return
        rid = f"lmdock-next-token-{next(self._ids)}"
        try:
            self._engine.add_request(rid, {"prompt_token_ids": list(key)}, one_token_params(-1))
        except Exception as exc:  # noqa: BLE001 - this query alone fails
            settle(future, error=RequestError(f"vLLM refused the next-token query: {exc}"))
            return
        self._in_flight[rid] = Query(key, [future])

    def done(self, rid: str, out: Any) -> None:
        """vLLM's output for query ``rid``: the row, cached and handed to every waiter."""
        import numpy as np

        query = self._in_flight.pop(rid)
        if not out.finished:
            self._in_flight[rid] = query  # FINAL_ONLY: not expected, wait for the final output
            return
        row = out.outputs[0].logprobs[0]
        result = np.full(self._vocab_size, -np.inf, dtype=np.float32)
        result[np.fromiter(row.keys(), dtype=np.int64, count=len(row))] = np.fromiter((lp.logprob for lp in row.values()), dtype=np.float32, count=len(row))
        self._results[query.key] = result
        while len(self._results) > self._max_results:
            self._results.popitem(last=False)
        for future in query.futures:
            settle(future, result.copy())

    def clear_results(self) -> None:
        self._results.clear()

    def fail_all(self, error: BaseException) -> None:
        for query in list(self._in_flight.values()):
            for future in query.futures:
                settle(future, error=error)
        self._in_flight.clear()
