"""Next-token-logprob queries (genlm-backend's ``AsyncLM``): prefixes are prefilled, never sampled;
results and the KV state behind them go to a trie prefix cache, so a query that extends a cached
prefix forks its KV state instead of recomputing it."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import numpy as np

from lmdock._contract import StepEngine
from lmdock._engine.prefix_cache import PrefixCache
from lmdock._engine.sampler import log_softmax
from lmdock._engine.scheduler import Scheduler
from lmdock._engine.sequence import QuerySeq
from lmdock._errors import LmdockError


class Queries:
    def __init__(self, engine: StepEngine, scheduler: Scheduler, new_seq_id: Callable[[], int], release: Callable[[QuerySeq], None]) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.new_seq_id = new_seq_id
        self.release = release
        self.cache = PrefixCache()
        self.pending: dict[tuple[int, ...], QuerySeq] = {}

    def add(self, ids: list[int], future: concurrent.futures.Future[np.ndarray]) -> None:
        key = tuple(ids)
        if key in self.pending:  # the same prefix is already being computed
            self.pending[key].futures.append(future)
            return
        result, src, length = self.cache.lookup(ids)
        if result is not None:
            future.set_result(result.copy())
            return
        query = QuerySeq(self.new_seq_id(), ids)
        query.futures.append(future)
        if src is not None and length < len(ids) and self.engine.fork(src, query.seq_id, length):
            query.num_computed = length
            query.held = True
        try:
            self.scheduler.add(query)
        except LmdockError as exc:
            self.release(query)
            future.set_exception(exc)
            return
        self.pending[key] = query

    def finish(self, query: QuerySeq, logits: np.ndarray) -> None:
        """The query's last position is computed: its KV state moves to the prefix cache."""
        self.scheduler.remove(query)
        query.done = True
        result = log_softmax(logits[None, :])[0]
        del self.pending[tuple(query.token_ids)]
        query.held = False  # the cache holds it now, and releases what it evicts
        for seq_id in self.cache.insert(query.token_ids, result, query.seq_id):
            self.engine.release(seq_id)
        for fut in query.futures:
            _settle(fut, result=result.copy())

    def fail(self, query: QuerySeq, error: BaseException) -> None:
        query.done = True
        self.pending.pop(tuple(query.token_ids), None)
        self.release(query)
        for fut in query.futures:
            _settle(fut, error=error)

    def fail_all(self, error: BaseException) -> None:
        for query in list(self.pending.values()):
            self.fail(query, error)

    def clear(self) -> None:
        """Drop the cache and the KV state it holds."""
        for seq_id in self.cache.clear():
            self.engine.release(seq_id)


def _settle(fut: concurrent.futures.Future, result: object = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled by its caller meanwhile
        pass
