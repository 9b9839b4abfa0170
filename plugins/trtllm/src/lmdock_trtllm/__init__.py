"""lmdock-trtllm: the TensorRT-LLM backend.

This entry-point module imports neither tensorrt_llm nor torch: it declares the backend, probes
availability with ``importlib.util.find_spec`` and a look for an NVIDIA driver, and imports the
engine only when a model loads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

import lmdock
from lmdock import ModelConfig
from lmdock.backend import Backend, BackendSpec, has_nvidia_gpu

__version__ = "0.1.0"


@dataclass(frozen=True)
class TrtllmOptions:
    """``[models.NAME.backends.trtllm]``: options of the TensorRT-LLM backend."""

    api: Literal["auto", "current", "legacy"] = "auto"
    skip_tokenizer_init: bool = False
    enable_chunked_prefill: bool = True
    #: Structured output's engine (TensorRT-LLM's ``guided_decoding_backend``); None: requests with
    #: ``structured_output`` are refused.
    guided_decoding_backend: Literal["xgrammar", "llguidance"] | None = None
    #: Passed to ``tensorrt_llm.LLM(...)`` as they are (TensorRT-LLM validates them).
    llm_args: dict[str, Any] = field(default_factory=dict)


def _available() -> str | None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return (
            "tensorrt_llm is not installed; it runs on Linux with an NVIDIA GPU: "
            'pip install "lmdock-trtllm[gpu]" there (PyPI has only placeholders elsewhere)'
        )
    if not has_nvidia_gpu():
        return "no NVIDIA GPU found (no /dev/nvidiactl, no nvidia-smi); TensorRT-LLM needs one"
    return None


_UNVERIFIED = "unverified: lmdock-conformance's family tests need an NVIDIA GPU and have not run on TensorRT-LLM"

SPEC = BackendSpec(
    name="trtllm",
    kind="request",
    plugin_api="1.0",
    supports=frozenset({"generate", "stream", "sampling", "logit_bias", "logprobs", "prompt_logprobs", "beam_search", "structured_output", "quantization"}),
    lacks={
        "vision": "lmdock-trtllm does not pass images to TensorRT-LLM's multimodal inputs yet (docs/vision.md)",
        "tools": "chat is not wired yet, so neither are tool calls",
        "chat": "not wired yet: TensorRT-LLM's tokenizer has apply_chat_template, lmdock-trtllm does not call it yet",
        "next_token_logprobs": "TensorRT-LLM schedules for itself; no per-prefix logprob queries",
        "embed": "TensorRT-LLM's LLM API serves causal LMs",
        "score": "TensorRT-LLM's LLM API serves causal LMs",
        "offload": "use kv_cache.cpu_space_gib for host KV offload; weights stay on the GPUs",
        "lora": "not wired: the recorded TensorRT-LLM API contract (../shared/api-contracts) names lora_request, enable_lora "
                "and lora_config but not LoRARequest's or LoraConfig's fields, so a translation could not be checked here",
        # model features: refused until a family run on a GPU shows them exact (docs/model-families.md)
        **dict.fromkeys(("sliding_window", "attention_sinks", "logit_softcapping", "recurrent_state", "moe"), _UNVERIFIED),
    },
    requires=("tensorrt_llm",),
    engine_packages=("tensorrt-llm",),
    package="lmdock-trtllm",
    version=__version__,
    available=_available,
    options=TrtllmOptions,
    tolerances={"logprobs": 2e-2},  # half-precision GPU kernels
    needs_hardware="an NVIDIA GPU",
    has_hardware=has_nvidia_gpu,
    priority=60,
    description="NVIDIA TensorRT-LLM (LLM API), GPUs only",
)


def _options(mc: ModelConfig) -> TrtllmOptions:
    return lmdock.backend.build_options(TrtllmOptions, mc.backend_options("trtllm"), source=mc.source, prefix=f"models.{mc.name}.backends.trtllm")


def _quantize(quant: lmdock.QuantConfig, model_config: ModelConfig) -> Any:
    from lmdock_trtllm._api import detect_api
    from lmdock_trtllm._translate import quant_config

    api = detect_api(model_config, _options(model_config).api)
    return quant_config(quant, model_config.kv_cache.dtype, api) or "checkpoint"


def _build(model_config: ModelConfig) -> dict[str, Any] | None:
    from lmdock_trtllm._api import detect_api
    from lmdock_trtllm._translate import llm_kwargs

    opts = _options(model_config)
    api = detect_api(model_config, opts.api)
    kwargs = llm_kwargs(model_config, api, skip_tokenizer_init=opts.skip_tokenizer_init, enable_chunked_prefill=opts.enable_chunked_prefill,
                        guided_decoding_backend=opts.guided_decoding_backend, extra=opts.llm_args)
    return {"api": api, "llm_kwargs": kwargs}


def _load(model_config: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
    from lmdock_trtllm._engine import TrtllmEngine

    return TrtllmEngine.load(model_config, build["api"], build["llm_kwargs"])


#: what the entry point names: the spec and the functions above (lmdock.backend.Backend)
plugin = Backend(SPEC, load=_load, build=_build, quantize=_quantize, parallel=True)
