"""Who holds KV state: the only caller of the step engine's ``release`` and ``fork``.

The rule (nano-vllm's block manager: allocate, free exactly once): a sequence's ``held`` flag is set by
:meth:`KV.hold` just before the first engine step that includes it (the engine may take KV state for
it from that moment, even if the step fails) or by a successful :meth:`KV.fork`, and cleared by the
one :meth:`KV.free` that follows, which releases the engine's state.  Every path that ends a sequence
(finish, stop, abort, failure, preemption, beam pruning, shutdown) goes through :meth:`KV.release` or,
for a preempted sequence the scheduler keeps, :meth:`KV.free`.  A prefix cache that takes a
sequence's state over (:meth:`KV.hand_over`) releases it later by id (:meth:`KV.release_ids`).

Every release is guarded the same way: an engine that fails to release is logged, and the loop goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmdock._engine.scheduler import SchedulerBase
    from lmdock._engine.sequence import QuerySeq, Seq
    from lmdock._engine.step_engine import StepEngineBase

log = logging.getLogger("lmdock.engine")


class KV:
    def __init__(self, engine: StepEngineBase, scheduler: SchedulerBase) -> None:
        self._engine = engine
        self._scheduler = scheduler

    @property
    def capacity(self) -> int | None:
        """The most KV positions the engine can hold across sequences (None: no limit it knows)."""
        return self._engine.kv_capacity_tokens

    def hold(self, plan: Iterable[tuple[Seq | QuerySeq, int]]) -> None:
        """The engine may take KV state for the plan's sequences from here on (just before the step
        that includes them)."""
        for seq, _ in plan:
            seq.held = True

    def fork(self, src: int, dst: Seq | QuerySeq, length: int) -> bool:
        """Give ``dst`` a copy of the first ``length`` positions of sequence ``src``'s KV state;
        False when the engine cannot fork (``dst`` is left as it was)."""
        if not self._engine.fork(src, dst.seq_id, length):
            return False
        dst.held = True
        dst.num_computed = length
        return True

    def fork_id(self, src: int, dst: int, length: int) -> bool:
        """:meth:`fork` into a sequence id a cache will hold (it releases it with :meth:`release_ids`)."""
        return bool(self._engine.fork(src, dst, length))

    def release(self, seq: Seq | QuerySeq) -> None:
        """End a sequence: out of the scheduler, nothing computed, its KV state freed exactly once."""
        self._scheduler.remove(seq)
        seq.num_computed = 0
        self.free(seq)

    def free(self, seq: Seq | QuerySeq) -> None:
        """Free the sequence's KV state if it holds any (a preempted sequence stays scheduled)."""
        if seq.held:
            seq.held = False
            self._release(seq.seq_id, "sequence")

    def hand_over(self, seq: Seq | QuerySeq) -> int:
        """A cache takes the sequence's KV state over, under the same id: the sequence no longer holds it."""
        seq.held = False
        return seq.seq_id

    def release_ids(self, seq_ids: Iterable[int]) -> None:
        """Release KV state a cache held (what it evicted or dropped)."""
        for seq_id in seq_ids:
            self._release(seq_id, "cached sequence")

    def _release(self, seq_id: int, what: str) -> None:
        try:
            self._engine.release(seq_id)
        except Exception:
            log.exception("the step engine failed to release %s %s", what, seq_id)
