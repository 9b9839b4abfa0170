"""lmdock._engine.scheduler: the FCFS scheduler on its own, over plain sequence records (no engine).

Each test drives ``schedule()`` step by step and reads the plan: which sequences run, how many tokens
each feeds, which are preempted or failed (docs/engine.md, "Scheduling")."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from lmdock import QueueFullError, RequestError, SchedulerConfig
from lmdock._engine.scheduler import FcfsScheduler


@dataclass(eq=False)
class S:
    """A sequence as the scheduler sees it: its tokens, how many have been computed, its beam group."""

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    group: int | None = None


def seq(seq_id: int, prompt: int, group: int | None = None) -> S:
    return S(seq_id, list(range(prompt)), 0, group)


def run(plan: list[tuple[S, int]]) -> None:
    """What the runner does after a step: the planned tokens are computed, a decode appends one."""
    for s, n in plan:
        s.num_computed += n
        if s.num_computed == len(s.token_ids):
            s.token_ids.append(0)


def ids(plan: list[tuple[S, int]]) -> list[tuple[int, int]]:
    return [(s.seq_id, n) for s, n in plan]


def sched(capacity: int | None = None, **config: int) -> FcfsScheduler:
    return FcfsScheduler(SchedulerConfig(**config), max_seq_len=1024, kv_capacity_tokens=capacity)


def test_oldest_first_within_max_num_seqs() -> None:
    s = sched(max_num_seqs=2)
    a, b, c = seq(1, 3), seq(2, 3), seq(3, 3)
    for x in (a, b, c):
        s.add(x)
    plan, preempted, failed = s.schedule()
    assert ids(plan) == [(1, 3), (2, 3)] and not preempted and not failed
    run(plan)
    plan, _, _ = s.schedule()
    assert ids(plan) == [(1, 1), (2, 1)]  # decoding: one token each; c still waits
    s.remove(a)
    plan, _, _ = s.schedule()
    assert ids(plan) == [(2, 1), (3, 3)]  # a's place goes to c


def test_prefill_is_chunked_by_the_token_budget_and_running_sequences_go_first() -> None:
    s = sched(max_num_batched_tokens=4)
    a, b = seq(1, 6), seq(2, 3)
    s.add(a)
    s.add(b)
    plan, _, _ = s.schedule()
    assert ids(plan) == [(1, 4)]  # a's first chunk fills the budget; b waits
    run(plan)
    plan, _, _ = s.schedule()
    assert ids(plan) == [(1, 2), (2, 2)]  # a finishes its prompt, b starts within what is left


def test_the_newest_running_sequence_is_preempted_when_kv_would_overflow() -> None:
    s = sched(capacity=10)
    a, b = seq(1, 4), seq(2, 4)
    s.add(a)
    s.add(b)
    run(s.schedule()[0])  # 8 of 10 positions, plus one generated token each
    run(s.schedule()[0])  # 10 of 10
    plan, preempted, failed = s.schedule()
    assert preempted == [b] and not failed and ids(plan) == [(1, 1)]
    assert b.num_computed == 0 and s.waiting[0] is b  # recomputed later, at the head of the queue


def test_a_prompt_larger_than_the_kv_capacity_is_refused_at_add() -> None:
    with pytest.raises(RequestError, match="exceeds the KV capacity"):
        sched(capacity=8).add(seq(1, 9))


def test_cached_prompts_give_way_before_a_refusal() -> None:
    s = sched(capacity=8)
    asked: list[int] = []
    s.reclaim = lambda tokens: asked.append(tokens) or tokens
    s.add(seq(1, 9))
    assert asked == [1] and s.capacity == 9


def test_a_full_waiting_queue_is_a_queue_full_error() -> None:
    s = sched(max_waiting=1)
    s.add(seq(1, 2))
    with pytest.raises(QueueFullError, match="max_waiting"):
        s.add(seq(2, 2))


def test_a_beam_group_is_admitted_and_preempted_together() -> None:
    s = sched(capacity=20, max_num_seqs=4)
    a = seq(1, 4)
    s.add(a)
    run(s.schedule()[0])
    b1, b2 = seq(2, 4, group=7), seq(3, 4, group=7)
    s.add(b1)
    s.add(b2)
    plan, _, _ = s.schedule()
    assert {x for x, _ in plan} == {a, b1, b2}
    run(plan)
    for _ in range(6):
        plan, preempted, failed = s.schedule()
        if preempted:
            break
        run(plan)
    assert preempted == [b1, b2] and not failed  # both beams go, never one of them


def test_a_fork_joins_beside_its_parent() -> None:
    s = sched()
    a, b = seq(1, 2), seq(2, 2)
    s.add(a)
    s.add(b)
    run(s.schedule()[0])
    child = seq(3, 3)
    s.fork(a, child)
    assert s.running == [a, child, b]
