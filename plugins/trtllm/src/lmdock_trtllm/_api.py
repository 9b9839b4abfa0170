"""Which TensorRT-LLM API generation is installed (imports tensorrt_llm: call at load time only)."""

from __future__ import annotations

import importlib
import importlib.util

from lmdock import ModelConfig, UnsupportedError

from lmdock_trtllm._translate import Api


def has_torch_api() -> bool:
    try:
        args = importlib.import_module("tensorrt_llm.llmapi.llm_args")
    except ImportError:
        return False
    return hasattr(args, "TorchLlmArgs")


def has_engine_api() -> bool:
    """The TensorRT-engine LLM (build_config, quant_config) is still there (releases <= 1.2)."""
    if importlib.util.find_spec("tensorrt_llm._tensorrt_engine") is not None:
        return True
    try:
        args = importlib.import_module("tensorrt_llm.llmapi.llm_args")
    except ImportError:
        return False
    return hasattr(args, "TrtLlmArgs") or not hasattr(args, "TorchLlmArgs")


def detect_api(mc: ModelConfig, requested: str = "auto") -> Api:
    """``current`` (PyTorch backend) unless the legacy engine API is needed and installed.

    Auto picks ``legacy`` only for what the current API cannot do (quantizing a checkpoint that is
    not pre-quantized) and only when the installed release still has the TensorRT-engine LLM.
    """
    if requested == "legacy":
        if not has_engine_api():
            raise UnsupportedError("backends.trtllm.api = 'legacy': this TensorRT-LLM no longer has the TensorRT-engine LLM (build_config / quant_config); use 'current'")
        return "legacy"
    if requested == "current":
        if not has_torch_api():
            raise UnsupportedError("backends.trtllm.api = 'current': this TensorRT-LLM predates the PyTorch LLM API; use 'legacy' or upgrade")
        return "current"
    needs_legacy = mc.quantization.enabled and not mc.quantization.checkpoint_prequantized
    if not has_torch_api() or (needs_legacy and has_engine_api()):
        return "legacy"
    return "current"
