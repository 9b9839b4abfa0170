"""lmdock._engine.kv: the only owner of the step engine's KV state (hold, fork, release exactly once)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from lmdock._engine.kv import KV
from lmdock._engine.sequence import QuerySeq

ENGINE_DIR = Path(__file__).resolve().parents[1] / "src" / "lmdock" / "_engine"


class Engine:
    def __init__(self, can_fork: bool = True, release_raises: bool = False) -> None:
        self.can_fork, self.release_raises = can_fork, release_raises
        self.released: list[int] = []
        self.forks: list[tuple[int, int, int]] = []
        self.kv_capacity_tokens = 100

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)
        if self.release_raises:
            raise RuntimeError("device lost")

    def fork(self, src: int, dst: int, length: int) -> bool:
        self.forks.append((src, dst, length))
        return self.can_fork


class Scheduler:
    def __init__(self) -> None:
        self.removed: list[int] = []

    def remove(self, seq: QuerySeq) -> None:
        self.removed.append(seq.seq_id)


def test_a_held_sequence_is_released_exactly_once() -> None:
    engine, scheduler = Engine(), Scheduler()
    kv = KV(engine, scheduler)  # type: ignore[arg-type]
    seq = QuerySeq(7, [1, 2, 3])
    kv.release(seq)  # never held: nothing to release
    assert engine.released == [] and scheduler.removed == [7]
    kv.hold([(seq, 1)])
    seq.num_computed = 3
    kv.release(seq)
    kv.release(seq)
    kv.free(seq)
    assert engine.released == [7] and seq.num_computed == 0 and not seq.held


def test_a_fork_holds_the_copy_and_a_refused_fork_leaves_it_alone() -> None:
    kv = KV(Engine(can_fork=True), Scheduler())  # type: ignore[arg-type]
    dst = QuerySeq(2, [1, 2, 3])
    assert kv.fork(1, dst, 2) and dst.held and dst.num_computed == 2
    kv = KV(Engine(can_fork=False), Scheduler())  # type: ignore[arg-type]
    dst = QuerySeq(3, [1, 2, 3])
    assert not kv.fork(1, dst, 2) and not dst.held and dst.num_computed == 0
    assert kv.capacity == 100


def test_every_release_is_guarded_the_same_way(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(release_raises=True)
    kv = KV(engine, Scheduler())  # type: ignore[arg-type]
    seq = QuerySeq(5, [1])
    kv.hold([(seq, 1)])
    with caplog.at_level(logging.ERROR, logger="lmdock.engine"):
        kv.free(seq)
        kv.release_ids([8, 9])  # what a prefix cache evicted or dropped
    assert engine.released == [5, 8, 9] and not seq.held
    assert [r.getMessage() for r in caplog.records] == [
        "the step engine failed to release sequence 5",
        "the step engine failed to release cached sequence 8",
        "the step engine failed to release cached sequence 9",
    ]


def test_a_cache_takes_a_sequences_state_over() -> None:
    engine = Engine()
    kv = KV(engine, Scheduler())  # type: ignore[arg-type]
    seq = QuerySeq(4, [1])
    kv.hold([(seq, 1)])
    assert kv.hand_over(seq) == 4 and not seq.held
    kv.release(seq)
    assert engine.released == []  # the cache releases it, by id
    kv.release_ids([4])
    assert engine.released == [4]


def test_only_kv_calls_the_engines_release_and_fork() -> None:
    calls = re.compile(r"engine\.(release|fork)\(")
    offenders = [
        f"{path.name}:{n}"
        for path in sorted(ENGINE_DIR.glob("*.py"))
        if path.name != "kv.py"
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if calls.search(line)
    ]
    assert not offenders, f"call the step engine's release/fork through lmdock._engine.kv: {offenders}"
    assert calls.search((ENGINE_DIR / "kv.py").read_text())
