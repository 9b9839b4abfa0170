"""What a model takes: the process's memory measured, and given back when a model goes.

Memory is measured, never guessed from file sizes: the process's resident set (plus the GPU memory
torch holds when torch has a GPU up) across the load, then what the model's unload gave back, the
larger of the two at its next load.  The first load of a backend also counts the backend's imports
(torch, transformers), which stay after an unload; weights a backend maps from disk count as they
are first read, after the load; the unload's measure sees both right.  An engine that runs in other
processes is not seen by this measure.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from typing import Any

GIB = 2**30


def resident_bytes() -> int:
    """The process's resident memory now, plus the GPU memory torch has reserved if it has a GPU up."""
    try:
        with open("/proc/self/statm", "rb") as f:
            total = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux
        try:
            import psutil
        except ImportError:
            return 0
        total = psutil.Process().memory_info().rss
    torch = sys.modules.get("torch")  # never imported here: only a process that already has it has a GPU up
    if torch is not None and torch.cuda.is_initialized():
        total += sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))
    return total


def free_llm(box: list[Any]) -> None:
    """Shut the LLM in ``box`` down and give its memory back: the last reference goes, then the cycles,
    then the GPU cache and glibc's free lists (without ``malloc_trim`` freed heap stays resident)."""
    llm = box.pop()
    llm.shutdown()
    del llm
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl)
            pass


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f}"
