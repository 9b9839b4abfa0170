"""The default scheduler: first come, first served, with continuous batching.

Each step: every running sequence gets its pending tokens (one while decoding, a chunk of its
prompt while prefilling), within ``max_num_batched_tokens``; then waiting sequences join, oldest
first, while there is room in ``max_num_seqs``, the token budget and the KV capacity.  When the KV
state would overflow, the newest running sequence is preempted: its state is dropped and it waits at
the head of the queue to be recomputed later, rather than failed.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from lmdock._errors import QueueFullError, RequestError
from lmdock._params import SchedulerConfig


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


class FcfsScheduler:
    def __init__(self, config: SchedulerConfig, max_seq_len: int, kv_capacity_tokens: int | None) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.capacity = kv_capacity_tokens
        self.waiting: deque[SchedSeq] = deque()
        self.running: list[SchedSeq] = []

    def add(self, seq: SchedSeq) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting} sequences); retry later or raise "
                "scheduler.max_waiting"
            )
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
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if self.capacity is not None and self._kv_after(plan) + seq.num_computed + n > self.capacity:
                break
            self.waiting.popleft()
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan, preempted, failed

    def _kv_after(self, plan: list[tuple[SchedSeq, int]]) -> int:
        planned = {id(s): n for s, n in plan}
        return sum(s.num_computed + planned.get(id(s), 0) for s in self.running)

    def _fit_capacity(self, plan: list[tuple[SchedSeq, int]]) -> tuple[list[SchedSeq], list[tuple[SchedSeq, str]]]:
        preempted: list[SchedSeq] = []
        failed: list[tuple[SchedSeq, str]] = []
        if self.capacity is None:
            return preempted, failed
        while self.running and self._kv_after(plan) > self.capacity:
            victim = self.running.pop()  # the newest
            plan[:] = [p for p in plan if p[0] is not victim]
            if not self.running:
                failed.append((victim, f"the sequence needs more than the KV capacity ({self.capacity} tokens)"))
                break
            victim.num_computed = 0
            self.waiting.appendleft(victim)
            preempted.append(victim)
        return preempted, failed
