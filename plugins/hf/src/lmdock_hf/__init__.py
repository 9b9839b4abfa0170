"""lmdock-hf: the transformers backend.

This module is the entry point: it declares the backend and its options and imports neither torch
nor transformers.  The engine lives in ``lmdock_hf._engine`` and is imported when a model loads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

import lmdock
from lmdock import ModelConfig
from lmdock.backend import Backend, BackendSpec

__version__ = "0.1.0"


@dataclass(frozen=True)
class HFOptions:
    """``[models.NAME.backends.hf]``: options of the transformers backend."""

    attn_implementation: Literal["auto", "sdpa", "eager"] = "auto"
    num_threads: int | None = None
    low_cpu_mem_usage: bool = True
    #: who samples: "auto" (torch on the device when the model runs on an accelerator, the core's
    #: NumPy reference sampler on the CPU, where its partial selection is faster), "torch" (always
    #: torch, on any device), "reference" (always the reference: each step's logits to the host)
    sampler: Literal["auto", "torch", "reference"] = "auto"

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


def _available() -> str | None:
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed; pip install torch==<your build> lmdock-hf"
    return None


def _states_api_lacking() -> dict[str, str]:
    """``recurrent_state`` is lacked where the installed transformers predates 5.21: its hybrid models
    read their conv / recurrent states from the cache's layers directly, not through the Cache API
    that lmdock-hf's per-slot cache implements (read from package metadata: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("transformers")
    except PackageNotFoundError:
        return {}
    parts = [int(p) if p.isdigit() else 0 for p in installed.split(".")[:2]]
    if tuple(parts) >= (5, 21):
        return {}
    return {"recurrent_state": f"transformers {installed}'s hybrid models read their conv / recurrent states from the cache's "
                               "layers directly (before 5.21), which lmdock-hf's per-slot cache cannot serve: "
                               "pip install -U 'transformers>=5.21'"}


_LACKS = _states_api_lacking()

SPEC = BackendSpec(
    name="hf",
    kind="step",
    plugin_api="1.0",
    supports=frozenset({"generate", "chat", "stream", "sampling", "logit_bias", "logprobs", "prompt_logprobs", "next_token_logprobs", "beam_search",
                        "structured_output", "tools", "embed", "score", "offload", "quantization", "lora",
                        # every model feature transformers implements: lmdock-conformance's family tests hold each to its generate
                        "sliding_window", "attention_sinks", "logit_softcapping", "recurrent_state", "moe",
                        # images: LLaVA, Idefics3 / SmolVLM, Qwen2-VL / Qwen2.5-VL, Gemma 3; other vision families are refused at load (lmdock_hf._vision)
                        "vision"}) - frozenset(_LACKS),
    lacks=_LACKS,
    # |prompt logprob - transformers float32| on the conformance reference; measured 0.0038, 0.0023, 0.118
    tolerances={"int8_weight_only": 0.02, "int8_dynamic": 0.02, "int4_weight_only": 0.5},
    requires=("torch", "transformers"),
    # the engines whose internals lmdock-hf relies on (docs/authoring-backends.md); torchao only with [quant]
    engine_packages=("transformers", "torch", "torchao"),
    package="lmdock-hf",
    version=__version__,
    available=_available,
    options=HFOptions,
    priority=10,
    description="Hugging Face transformers (CPU, CUDA, MPS)",
)


def _build(model_config: ModelConfig) -> dict[str, Any] | None:
    b = model_config.build
    kv = model_config.kv_cache.dtype
    if kv not in ("auto", b.dtype):  # the cache holds what the model computes: it was silently kept in build.dtype
        raise lmdock.UnsupportedError(
            f"kv_cache.dtype {kv!r}: lmdock-hf keeps the KV cache in the model's dtype (build.dtype = {b.dtype!r}); "
            "leave kv_cache.dtype at auto, set build.dtype, or use [offload] compress_cache = true for a 4-bit cache"
        )
    return {
        "dtype": b.dtype,
        "device": b.device,
        "max_seq_len": b.max_seq_len,
        "kv_max_tokens": model_config.kv_cache.max_tokens,
        "compile": b.compile,
        "max_loras": b.max_loras,
        "max_lora_rank": b.max_lora_rank,
    }


def _quantize(quant: lmdock.QuantConfig, model_config: ModelConfig) -> Any:
    if model_config.offload.enabled:
        raise lmdock.UnsupportedError(
            f"quantization {quant.algo!r} with [offload]: lmdock-hf streams the offloaded layers as they are on disk; "
            "set offload.compress_weight = true for 4-bit weights there, or remove [offload]"
        )
    from lmdock_hf._quant import plan

    return plan(quant, model_config.model)


def _load(model_config: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
    if model_config.offload.enabled:  # FlexLLMGen's schedule: layers streamed from disk (docs/backends/hf.md)
        from lmdock_hf._offload import OffloadStepEngine

        return OffloadStepEngine.load_offloaded(model_config, options, build)
    from lmdock.backend import read_pooling_config

    pooling = read_pooling_config(model_config.model)
    if pooling["task"] is not None:  # an embedding model or a cross-encoder: the pooling engine
        from lmdock_hf._pooling import HFPoolingEngine

        return HFPoolingEngine.load(model_config, options, build, pooling, quantization)
    from lmdock_hf._engine import HFStepEngine

    return HFStepEngine.load(model_config, options, build, quantization)


def _sampler(model_config: ModelConfig) -> Any:
    mode = model_config.backend_options("hf").get("sampler", "auto")
    if mode == "reference":
        return None  # the core's reference sampler answers
    from lmdock_hf._sampler import TorchSampler

    return TorchSampler(mode)


#: what the entry point names: the spec and the functions above (lmdock.backend.Backend)
plugin = Backend(SPEC, load=_load, build=_build, quantize=_quantize, sampler=_sampler)
