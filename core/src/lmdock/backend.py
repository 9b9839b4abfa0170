"""What backend authors implement against: the engine contracts, the declaration, and the core's parts
a backend may reuse (the engines' and schedulers' base classes, the LoRA adapter cache, slot bookkeeping, the
sampler and scheduler interfaces).

Users import from ``lmdock``; plugins import from here (and ``lmdock`` for the portable configs and
errors they share with users).  Importing this module, like ``lmdock``, imports no engine and no numpy:
the names that live beside NumPy code resolve on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmdock._config.model import ModelConfig
from lmdock._config.pooling import PoolingParams
from lmdock._engine.adapter_cache import AdapterCache
from lmdock._engine.request_engine import PoolingEngineBase, RequestEngineBase
from lmdock._engine.step_engine import StepEngineBase
from lmdock._llm.lora import LoRAModule, read_lora_adapter
from lmdock._llm.outputs import CompletionOutput, Logprob, RequestOutput
from lmdock._llm.streams import safe_fail, safe_put
from lmdock._llm.tokenizer import Tokenizer
from lmdock._plugin.contract import (
    CAPABILITIES,
    PLUGIN_API_VERSION,
    BackendSpec,
    EngineRequest,
    OutputSink,
    PoolingEngine,
    PoolingInput,
    RequestEngine,
    SeqChunk,
    StepEngine,
    StepOutput,
)
from lmdock._plugin.declare import Backend, has_nvidia_gpu
from lmdock._plugin.errors import BackendError, EngineClosedError, RequestError, UnsupportedError
from lmdock._plugin.markers import hookimpl
from lmdock._plugin.model_files import read_model_json

if TYPE_CHECKING:
    from lmdock._engine.beam import BeamSearch
    from lmdock._engine.pooling import pool_hidden, read_pooling_config
    from lmdock._engine.sampler import ReferenceSampler, Sample, Sampler, SampleRow, host_array
    from lmdock._engine.scheduler import FcfsScheduler, Scheduler, SchedulerBase
    from lmdock._engine.slots import SlotTable

_LAZY = {
    "BeamSearch": "lmdock._engine.beam",
    "FcfsScheduler": "lmdock._engine.scheduler",
    "ReferenceSampler": "lmdock._engine.sampler",
    "host_array": "lmdock._engine.sampler",
    "Sample": "lmdock._engine.sampler",
    "SampleRow": "lmdock._engine.sampler",
    "Sampler": "lmdock._engine.sampler",
    "Scheduler": "lmdock._engine.scheduler",
    "SchedulerBase": "lmdock._engine.scheduler",
    "SlotTable": "lmdock._engine.slots",
    "pool_hidden": "lmdock._engine.pooling",
    "read_pooling_config": "lmdock._engine.pooling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lmdock.backend' has no attribute {name!r}")


def build_options(cls: type, data: dict[str, Any], *, source: str | None = None, prefix: str = "") -> Any:
    """Build a backend's options dataclass from a config table, with lmdock's validation and errors
    (a ``ConfigError`` naming the file and key path)."""
    from lmdock._config.schema import build

    return build(cls, data, source=source, prefix=prefix)


__all__ = [
    "AdapterCache",
    "Backend",
    "BackendError",
    "BackendSpec",
    "BeamSearch",
    "CAPABILITIES",
    "CompletionOutput",
    "EngineClosedError",
    "EngineRequest",
    "FcfsScheduler",
    "LoRAModule",
    "Logprob",
    "ModelConfig",
    "OutputSink",
    "PLUGIN_API_VERSION",
    "PoolingEngine",
    "PoolingEngineBase",
    "PoolingInput",
    "PoolingParams",
    "ReferenceSampler",
    "RequestEngine",
    "RequestEngineBase",
    "RequestError",
    "RequestOutput",
    "Sample",
    "SampleRow",
    "Sampler",
    "Scheduler",
    "SchedulerBase",
    "SeqChunk",
    "SlotTable",
    "StepEngine",
    "StepEngineBase",
    "StepOutput",
    "Tokenizer",
    "UnsupportedError",
    "build_options",
    "has_nvidia_gpu",
    "hookimpl",
    "host_array",
    "pool_hidden",
    "read_lora_adapter",
    "read_model_json",
    "read_pooling_config",
    "safe_fail",
    "safe_put",
]
