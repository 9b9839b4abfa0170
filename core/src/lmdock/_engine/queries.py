"""Next-token-logprob queries (genlm-backend's ``AsyncLM``): prefixes are prefilled, never sampled;
results and the KV state behind them go to a trie prefix cache, so a query that extends a cached
prefix forks its KV state instead of recomputing it."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import numpy as np

from lmdock._engine.failures import settle_future
from lmdock._engine.kv import KV
from lmdock._engine.prefix_cache import PrefixCache
from lmdock._engine.sampler import log_softmax
from lmdock._engine.scheduler import SchedulerBase
from lmdock._engine.sequence import QuerySeq
from lmdock._plugin.errors import LmdockError


class Queries:
    def __init__(self, kv: KV, scheduler: SchedulerBase, new_seq_id: Callable[[], int]) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.new_seq_id = new_seq_id
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
        if src is not None and length < len(ids):
            self.kv.fork(src, query, length)
        try:
            self.scheduler.add(query)
        except LmdockError as exc:
            self.kv.release(query)
            future.set_exception(exc)
            return
        self.pending[key] = query

    def finish(self, query: QuerySeq, logits: np.ndarray) -> None:
        """The query's last position is computed: its KV state moves to the prefix cache."""
        self.scheduler.remove(query)
        query.done = True
        result = log_softmax(logits[None, :])[0]
        del self.pending[tuple(query.token_ids)]
        seq_id = self.kv.hand_over(query)  # the cache holds it now, and releases what it evicts
        self.kv.release_ids(self.cache.insert(query.token_ids, result, seq_id))
        for fut in query.futures:
            settle_future(fut, result=result.copy())

    def fail(self, query: QuerySeq, error: BaseException) -> None:
        query.done = True
        self.pending.pop(tuple(query.token_ids), None)
        self.kv.release(query)
        for fut in query.futures:
            settle_future(fut, error=error)

    def fail_all(self, error: BaseException) -> None:
        for query in list(self.pending.values()):
            self.fail(query, error)

    def clear(self) -> None:
        """Drop the cache and the KV state it holds."""
        self.kv.release_ids(self.cache.clear())
