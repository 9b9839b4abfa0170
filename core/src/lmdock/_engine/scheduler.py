"""The default scheduler: first come, first served, with continuous batching.

Each step: every running sequence gets its pending tokens (one while decoding, a chunk of its
prompt while prefilling), within ``max_num_batched_tokens``; then waiting sequences join, oldest
first, while there is room in ``max_num_seqs``, the token budget and the KV capacity.  When the KV
state would overflow, the newest running sequence is preempted: its state is dropped and it waits at
the head of the queue to be recomputed later, rather than failed.

Before it preempts or fails anything for want of KV room, the scheduler asks ``reclaim`` (set by the
prefix cache) to free what it lacks: cached prompts go before running or waiting sequences do.

Sequences that share a ``group`` (a beam search's beams, which advance together) are preempted and
readmitted together, so no member waits for a sibling that cannot get back in; a group, or a
sequence, that cannot fit even with nothing else running fails with the reason instead of waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from lmdock._config.model import SchedulerConfig
from lmdock._plugin.errors import QueueFullError, RequestError


class SchedSeq(Protocol):
    seq_id: int
    token_ids: list[int]
    num_computed: int


class Scheduler(Protocol):
    def add(self, seq: SchedSeq) -> None: ...

    def remove(self, seq: SchedSeq) -> None: ...

    def schedule(self) -> tuple[list[tuple[SchedSeq, int]], list[SchedSeq], list[tuple[SchedSeq, str]]]:
        """Return ``(plan, preempted, failed)``: (sequence, tokens to feed) pairs, sequences whose
        KV state must be released, and sequences that can never fit, with the reason."""
        ...

    def has_work(self) -> bool: ...


class SchedulerBase:
    """What ``lmdock_make_scheduler`` returns, with the optional members filled in (a scheduler written
    without it is seen through it: ``lmdock._engine.adapters.as_scheduler``).  A subclass implements
    ``add``, ``remove``, ``schedule`` and ``has_work``."""

    #: KV positions the scheduler plans within (None: it plans by ``max_num_seqs`` alone); the prefix
    #: cache lowers it by what cached prompts hold
    capacity: int | None = None
    #: ``reclaim(tokens) -> tokens freed``, set by the prefix cache: KV room held elsewhere (cached
    #: prompts), to ask for before a sequence is preempted or failed; None until set
    reclaim: Callable[[int], int] | None = None
    #: the ``[scheduler]`` table it plans with (speculation reads its token budget); None: none
    config: SchedulerConfig | None = None
    #: the sequences running and waiting, for ``LLM.stats()`` and speculation's KV room
    running: Sequence[SchedSeq] = ()
    waiting: Sequence[SchedSeq] = ()

    def add(self, seq: SchedSeq) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement add")

    def remove(self, seq: SchedSeq) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement remove")

    def schedule(self) -> tuple[list[tuple[SchedSeq, int]], list[SchedSeq], list[tuple[SchedSeq, str]]]:
        raise NotImplementedError(f"{type(self).__name__} must implement schedule")

    def has_work(self) -> bool:
        raise NotImplementedError(f"{type(self).__name__} must implement has_work")

    def fork(self, parent: SchedSeq, child: SchedSeq) -> None:
        """Schedule a sequence forked from ``parent`` beside it (a beam search's beams advance
        together).  The default: as a new arrival."""
        self.add(child)


class FcfsScheduler(SchedulerBase):
    def __init__(self, config: SchedulerConfig, max_seq_len: int, kv_capacity_tokens: int | None) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.capacity = kv_capacity_tokens
        self.waiting: deque[SchedSeq] = deque()  # type: ignore[assignment]
        self.running: list[SchedSeq] = []  # type: ignore[assignment]
        self.reclaim: Callable[[int], int] | None = None  # the capacity grows by what it frees

    def add(self, seq: SchedSeq) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting} sequences); retry later or raise "
                "scheduler.max_waiting"
            )
        while self.capacity is not None and len(seq.token_ids) > self.capacity and self._reclaimed(len(seq.token_ids) - self.capacity):
            pass  # cached prompts gave way
        if self.capacity is not None and len(seq.token_ids) > self.capacity:
            raise RequestError(
                f"prompt of {len(seq.token_ids)} tokens exceeds the KV capacity ({self.capacity} tokens)"
            )
        self.waiting.append(seq)

    def remove(self, seq: SchedSeq) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def fork(self, parent: SchedSeq, child: SchedSeq) -> None:
        """A new beam joins the batch beside its parent (it shares the parent's KV prefix)."""
        if parent in self.running:
            self.running.insert(self.running.index(parent) + 1, child)
        else:
            self.waiting.appendleft(child)

    def schedule(self) -> tuple[list[tuple[SchedSeq, int]], list[SchedSeq], list[tuple[SchedSeq, str]]]:
        budget = self.config.max_num_batched_tokens
        plan: list[tuple[SchedSeq, int]] = []
        for seq in self.running:
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if n > 0:
                plan.append((seq, n))
                budget -= n
        preempted, failed = self._fit_capacity(plan)
        if preempted:  # do not admit in a step that had to evict
            return [p for p in plan if p[0] not in preempted], preempted, failed
        while self.waiting and budget > 0:
            members = self._head_group()
            if self.running and len(self.running) + len(members) > self.config.max_num_seqs:
                break  # (a group larger than max_num_seqs still runs, alone)
            need = sum(len(s.token_ids) for s in members) if len(members) > 1 else members[0].num_computed + min(len(members[0].token_ids) - members[0].num_computed, budget)
            if self.capacity is not None and self._kv_after(plan) + need > self.capacity:
                if self._reclaimed(self._kv_after(plan) + need - self.capacity):
                    continue  # cached prompts gave way: look at the same group again
                if not self.running:  # it cannot fit even alone: fail it rather than wait forever
                    for s in members:
                        self.waiting.remove(s)
                        failed.append((s, f"the request needs {need} tokens of KV state, more than the KV capacity ({self.capacity} tokens)"))
                    continue
                break
            for seq in members:
                if seq is self.waiting[0]:
                    self.waiting.popleft()
                else:
                    self.waiting.remove(seq)
                self.running.append(seq)
                n = min(len(seq.token_ids) - seq.num_computed, budget)
                if n > 0:
                    plan.append((seq, n))
                    budget -= n
        return plan, preempted, failed

    def _reclaimed(self, short: int) -> bool:
        """Ask ``reclaim`` for ``short`` KV positions; True if it freed any (the capacity grew)."""
        freed = self.reclaim(short) if self.reclaim is not None and self.capacity is not None else 0
        if freed > 0:
            self.capacity += freed  # type: ignore[operator]
        return freed > 0

    def _head_group(self) -> list[SchedSeq]:
        head = self.waiting[0]
        group = getattr(head, "group", None)
        if group is None:
            return [head]
        return [s for s in self.waiting if getattr(s, "group", None) == group]

    def _kv_after(self, plan: list[tuple[SchedSeq, int]]) -> int:
        planned = {id(s): n for s, n in plan}
        return sum(s.num_computed + planned.get(id(s), 0) for s in self.running)

    def _fit_capacity(self, plan: list[tuple[SchedSeq, int]]) -> tuple[list[SchedSeq], list[tuple[SchedSeq, str]]]:
        preempted: list[SchedSeq] = []
        failed: list[tuple[SchedSeq, str]] = []
        if self.capacity is None:
            return preempted, failed
        while self.running and self._kv_after(plan) > self.capacity:
            if self._reclaimed(self._kv_after(plan) - self.capacity):
                continue
            newest = self.running[-1]
            group = getattr(newest, "group", None)
            victims = [newest] if group is None else [s for s in self.running if getattr(s, "group", None) == group]
            for v in victims:
                self.running.remove(v)
            plan[:] = [p for p in plan if p[0] not in victims]
            if not self.running:
                for v in victims:
                    failed.append((v, f"the sequence needs more than the KV capacity ({self.capacity} tokens)"))
                break
            for v in reversed(victims):
                v.num_computed = 0
                self.waiting.appendleft(v)
            preempted.extend(victims)
        return preempted, failed

