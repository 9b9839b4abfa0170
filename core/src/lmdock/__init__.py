"""lmdock: one API, one CLI and one config file for running LLMs on any inference engine.

Importing this package imports no engine, no torch and no numpy; the plugin manager is created on
first use.  The facade (``LLM``), ``RequestFuture``, ``hookimpl`` and ``lmdock.backend`` are imported on
first access (they pull asyncio, concurrent.futures and pluggy), as is ``ModelPool`` (threads),, so ``import lmdock`` stays fast.
"""

from __future__ import annotations

from lmdock._config.file import ConfigFile, config_schema, find_config, load_config
from lmdock._config.model import BuildConfig, KvCacheConfig, ModelConfig, OffloadPolicy, QuantConfig, SchedulerConfig
from lmdock._config.pooling import PoolingParams
from lmdock._config.quant_algo import QuantAlgo
from lmdock._config.sampling import SamplingParams, StructuredOutput
from lmdock._config.server import ServerConfig
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
from lmdock._plugin.errors import (
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
    "ModelBusyError": ("lmdock._models.pool", "ModelBusyError"),
    "ModelPool": ("lmdock._models.pool", "ModelPool"),
    "PoolFullError": ("lmdock._models.pool", "PoolFullError"),
    "RequestFuture": ("lmdock._llm.streams", "RequestFuture"),
    "hookimpl": ("lmdock._plugin.markers", "hookimpl"),
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
