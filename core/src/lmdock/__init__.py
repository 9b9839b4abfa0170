"""lmdock: one API, one CLI and one config file for running LLMs on any inference engine.

Importing this package imports no engine, no torch and no numpy; the plugin manager is created on
first use.
"""

from __future__ import annotations

from typing import Any

import pluggy

from lmdock._config import ConfigFile, config_schema, find_config, load_config
from lmdock._contract import (
    CAPABILITIES,
    PLUGIN_API_VERSION,
    BackendSpec,
    EngineRequest,
    OutputSink,
    RequestEngine,
    SeqChunk,
    StepEngine,
    StepOutput,
)
from lmdock._errors import (
    BackendError,
    ConfigError,
    EngineClosedError,
    LmdockError,
    PluginError,
    QueueFullError,
    RequestError,
    UnsupportedError,
)
from lmdock._files import read_model_json
from lmdock._llm import LLM
from lmdock._outputs import CompletionOutput, Logprob, RequestOutput
from lmdock._params import (
    BuildConfig,
    KvCacheConfig,
    ModelConfig,
    OffloadPolicy,
    QuantConfig,
    SamplingParams,
    SchedulerConfig,
    StructuredOutput,
)
from lmdock._sinks import RequestFuture
from lmdock._tokenizer import Tokenizer

__version__ = "0.1.0"

#: Marks a plugin's hook implementations: ``@lmdock.hookimpl``.
hookimpl = pluggy.HookimplMarker("lmdock")

# Names that live beside NumPy code: resolved on first access so `import lmdock` stays light.
_LAZY = {
    "FcfsScheduler": "lmdock._engine.scheduler",
    "ReferenceSampler": "lmdock._engine.sampler",
    "Sample": "lmdock._engine.sampler",
    "SampleRow": "lmdock._engine.sampler",
    "Sampler": "lmdock._engine.sampler",
    "Scheduler": "lmdock._engine.scheduler",
    "SlotTable": "lmdock._engine.slots",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lmdock' has no attribute {name!r}")


__all__ = [
    "BackendError",
    "BackendSpec",
    "BuildConfig",
    "CAPABILITIES",
    "CompletionOutput",
    "ConfigError",
    "ConfigFile",
    "EngineClosedError",
    "EngineRequest",
    "FcfsScheduler",
    "KvCacheConfig",
    "LLM",
    "LmdockError",
    "Logprob",
    "ModelConfig",
    "OffloadPolicy",
    "OutputSink",
    "PLUGIN_API_VERSION",
    "PluginError",
    "QuantConfig",
    "QueueFullError",
    "ReferenceSampler",
    "RequestEngine",
    "RequestError",
    "RequestFuture",
    "RequestOutput",
    "Sample",
    "SampleRow",
    "Sampler",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SeqChunk",
    "SlotTable",
    "StepEngine",
    "StepOutput",
    "StructuredOutput",
    "Tokenizer",
    "UnsupportedError",
    "__version__",
    "config_schema",
    "find_config",
    "hookimpl",
    "load_config",
    "read_model_json",
]
