"""Automatic prefix caching of generate prompts (``kv_cache.enable_prefix_caching``): the policy.

When a request's prompt is computed, a sequence forked from it holds its KV state in a
:class:`~lmdock._engine.prefix_cache.PromptCache`; a new prompt forks the longest prefix it shares
with a cached one and computes only the rest, under the same LoRA adapter only (:func:`adapter_of`).  Cached prompts hold KV state the scheduler does not
see, so the scheduler plans within what they leave, and the cache gives way first: it is dropped when
it would hold more than half the capacity, and a scheduler that would otherwise preempt or fail a
sequence for want of KV room first asks :meth:`PromptCaching.reclaim` for it (least recently used
prompts go first).  The first time the engine cannot fork a computed prompt into the cache, caching
is off for good; an engine that forks a prompt whole but refuses some shorter prefix of it (lmdock-hf's
sliding-window layers hold only their window) makes that lookup a miss.

An engine whose state cannot be cut back (``fork_truncates = False``: a recurrent / SSM state covers
every position it has seen) reuses a cached prompt only where the new prompt extends all of it: the
cached state then stands exactly at the shared boundary.  ``mode`` says which (``LLM.stats()``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lmdock._engine.kv import KV
from lmdock._engine.prefix_cache import PromptCache
from lmdock._engine.scheduler import SchedulerBase
from lmdock._engine.sequence import Seq

log = logging.getLogger("lmdock.engine")


class PromptCaching:
    def __init__(self, kv: KV, scheduler: SchedulerBase, new_seq_id: Callable[[], int], enabled: bool, whole: bool = False) -> None:
        self.kv = kv
        #: reuse only whole cached prompts (the engine's state cannot be truncated)
        self.whole = whole
        if enabled and whole:
            log.info("prefix caching: the engine's state cannot be truncated (recurrent layers); "
                     "a cached prompt is reused only by prompts that extend all of it")
        self.scheduler = scheduler
        self.new_seq_id = new_seq_id
        #: None: caching is off (not asked for, or the engine could not fork)
        self.cache: PromptCache | None = PromptCache() if enabled else None
        if enabled:  # the scheduler asks before it evicts (one that cannot ignores it)
            scheduler.reclaim = self.reclaim

    @property
    def mode(self) -> str:
        """``off``, ``prefixes`` (any shared prefix) or ``whole prompts`` (state that cannot be truncated)."""
        if self.cache is None:
            return "off"
        return "whole prompts" if self.whole else "prefixes"

    @property
    def held(self) -> int:
        """Sequences the cache holds KV state for."""
        return len(self.cache) if self.cache is not None else 0

    @property
    def hit_tokens(self) -> int:
        return self.cache.hit_tokens if self.cache is not None else 0

    def reuse(self, seq: Seq) -> None:
        """Fork the KV state of the longest prefix the prompt shares with a cached one (at least one
        prompt token is left to compute: its logits start the output)."""
        if self.cache is None:
            return
        tokens = seq.token_ids[: seq.prompt_len - 1] if self.whole else seq.token_ids
        src, length = self.cache.lookup(tokens, adapter_of(seq), whole=self.whole)
        length = min(length, seq.prompt_len - 1)
        if src is None or length <= 0:
            return
        if self.kv.fork(src, seq, length):  # refused: a miss (store() turns caching off for an engine that cannot fork)
            self.cache.hit_tokens += length
            if seq.req is not None:
                seq.req.cached_tokens = length

    def wants(self, seq: Seq) -> bool:
        """The sequence has just computed a prompt not cached yet."""
        return self.cache is not None and seq.index == 0 and seq.num_output == 0 and not seq.req.cached  # type: ignore[union-attr]

    def store(self, seq: Seq) -> None:
        """Cache the prompt ``seq`` has just computed, in a forked sequence."""
        assert self.cache is not None and seq.req is not None  # noqa: S101 - after wants()
        seq.req.cached = True
        cache_id = self.new_seq_id()
        try:
            forked = self.kv.fork_id(seq.seq_id, cache_id, seq.prompt_len)
        except Exception:
            log.exception("forking a prompt into the prefix cache failed; prefix caching is off")
            forked = False
        if not forked:
            self.drop(disable=True)
            return
        self.kv.release_ids(self.cache.insert(seq.token_ids[: seq.prompt_len], cache_id, adapter_of(seq)))
        self._reserve_capacity()

    def _reserve_capacity(self) -> None:
        """The scheduler plans within what cached prompts leave; they are dropped before that would
        leave less than half the capacity."""
        capacity = self.kv.capacity
        if capacity is None or self.cache is None:
            return
        cached = self.cache.tokens
        if cached > capacity // 2:
            self.drop()
            cached = 0
        self.scheduler.capacity = capacity - cached

    def reclaim(self, tokens: int) -> int:
        """The scheduler lacks ``tokens`` KV positions: release least recently used cached prompts
        until it has them (or the cache is empty); return the positions freed, by which the
        scheduler's capacity grows."""
        if self.cache is None or not len(self.cache):
            return 0
        evicted, freed = self.cache.evict(tokens)
        self.kv.release_ids(evicted)
        return freed

    def drop(self, disable: bool = False) -> None:
        """Release every cached prompt (KV pressure, ``clear_cache``); ``disable``: and stop caching."""
        if self.cache is None:
            return
        self.kv.release_ids(self.cache.clear())
        if disable:
            self.cache = None
        capacity = self.kv.capacity
        if capacity is not None:
            self.scheduler.capacity = capacity


def adapter_of(seq: Seq) -> Any:
    """What the sequence's KV state was computed under besides its tokens: its LoRA adapter's key
    (None for the base model), and its images' content hashes: a prompt whose image placeholders
    stand for other images never reuses that KV state."""
    request = seq.req.request if seq.req is not None else None
    lora = request.lora_request if request is not None else None
    key = lora.key if lora is not None else None
    images = request.multi_modal if request is not None else None
    return key if images is None else (key, images.key)
