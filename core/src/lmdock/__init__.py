"""lmdock: one API, one CLI and one config file for running LLMs on any inference engine.

Importing this package imports no engine, no torch and no numpy; the plugin manager is created on
first use.
"""

from __future__ import annotations

from lmdock._config import ConfigFile, config_schema, find_config, load_config
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
from lmdock._hooks import hookimpl
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
    ServerConfig,
    StructuredOutput,
)
from lmdock._sinks import RequestFuture
from lmdock._tokenizer import Tokenizer

__version__ = "0.1.0"

# The backend authors' namespace, so `import lmdock` is enough to write `lmdock.backend.BackendSpec`.
from lmdock import backend as backend  # noqa: E402

__all__ = [
    "BackendError",
    "BuildConfig",
    "CompletionOutput",
    "ConfigError",
    "ConfigFile",
    "EngineClosedError",
    "KvCacheConfig",
    "LLM",
    "LmdockError",
    "Logprob",
    "ModelConfig",
    "OffloadPolicy",
    "PluginError",
    "QuantConfig",
    "QueueFullError",
    "RequestError",
    "RequestFuture",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "ServerConfig",
    "StructuredOutput",
    "Tokenizer",
    "UnsupportedError",
    "__version__",
    "config_schema",
    "find_config",
    "hookimpl",
    "load_config",
]
