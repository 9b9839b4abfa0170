"""lmdock: one API, one CLI and one config file for running LLMs on any inference engine.

Importing this package imports no engine, no torch and no numpy; the plugin manager is created on
first use.  The facade (``LLM``), ``RequestFuture``, ``hookimpl`` and ``lmdock.backend`` are imported on
first access (they pull asyncio, concurrent.futures and pluggy), as is ``ModelPool`` (threads),, so ``import lmdock`` stays fast.
"""

from __future__ import annotations

from lmdock._aliases import QuantAlgo
from lmdock._config import ConfigFile, config_schema, find_config, load_config
from lmdock._errors import (
    BackendError,
    ConfigError,
    EngineClosedError,
    GrammarError,
    LmdockError,
    PluginError,
    QueueFullError,
    RequestError,
    UnsupportedError,
)
from lmdock._llm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from lmdock._llm.lora import LoRARequest
from lmdock._llm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from lmdock._llm.tokenizer import Tokenizer
from lmdock._params import (
    BuildConfig,
    KvCacheConfig,
    ModelConfig,
    OffloadPolicy,
    PoolingParams,
    QuantConfig,
    SamplingParams,
    SchedulerConfig,
    ServerConfig,
    StructuredOutput,
)

#: vLLM's name for :class:`StructuredOutput` (``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``).
StructuredOutputsParams = StructuredOutput

__version__ = "0.1.0"

#: Names imported on first access: name -> (module, attribute or None for the module itself).
#: ``lmdock.backend`` is the backend authors' namespace, so ``import lmdock`` is enough to write
#: ``lmdock.backend.BackendSpec``.
_LAZY = {
    "AsyncLM": ("lmdock._llm.genlm", "AsyncLM"),
    "LLM": ("lmdock._llm.facade", "LLM"),
    "load_model_by_name": ("lmdock._llm.genlm", "load_model_by_name"),
    "ModelBusyError": ("lmdock._pool", "ModelBusyError"),
    "ModelPool": ("lmdock._pool", "ModelPool"),
    "PoolFullError": ("lmdock._pool", "PoolFullError"),
    "RequestFuture": ("lmdock._llm.streams", "RequestFuture"),
    "hookimpl": ("lmdock._hooks", "hookimpl"),
    "backend": ("lmdock.backend", None),
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'lmdock' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    value = value if attr is None else getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AsyncLM",
    "BackendError",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "BuildConfig",
    "CompletionOutput",
    "ConfigError",
    "ConfigFile",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineClosedError",
    "GrammarError",
    "KvCacheConfig",
    "LLM",
    "LmdockError",
    "LoRARequest",
    "Logprob",
    "ModelBusyError",
    "ModelConfig",
    "ModelPool",
    "OffloadPolicy",
    "PluginError",
    "PoolFullError",
    "PoolingParams",
    "QuantAlgo",
    "QuantConfig",
    "QueueFullError",
    "RequestError",
    "RequestFuture",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "ScoringOutput",
    "ScoringRequestOutput",
    "ServerConfig",
    "StructuredOutput",
    "StructuredOutputsParams",
    "Tokenizer",
    "UnsupportedError",
    "__version__",
    "config_schema",
    "find_config",
    "hookimpl",
    "load_config",
    "load_model_by_name",
]
