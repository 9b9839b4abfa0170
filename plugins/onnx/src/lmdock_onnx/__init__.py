"""lmdock-onnx: the ONNX Runtime backend.

This module is the entry point: it declares the backend and its options and imports neither
onnxruntime nor numpy.  Exporting lives in ``lmdock_onnx._export`` (torch, transformers, onnx), the
engine in ``lmdock_onnx._engine`` (onnxruntime, numpy); both are imported when a model loads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

import lmdock
from lmdock import ModelConfig
from lmdock.backend import Backend, BackendSpec

__version__ = "0.1.0"

#: QuantConfig algorithms onnxruntime.quantization does for lmdock-onnx.
QUANT_ALGOS = ("int8_dynamic", "int8_weight_only", "int4_weight_only")


@dataclass(frozen=True)
class OnnxOptions:
    """``[models.NAME.backends.onnx]``: options of the ONNX Runtime backend."""

    #: Threads inside one operator (ONNX Runtime's default: one per physical core).
    intra_op_num_threads: int | None = None
    #: Threads across independent operators (used only with parallel execution).
    inter_op_num_threads: int | None = None
    #: ONNX Runtime's graph optimization level.
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    #: ONNX Runtime's memory-pattern planning, which it redoes for every new input shape: decoding
    #: has a new shape at every step (the attention mask grows), and planning made steps 2.5x slower.
    enable_mem_pattern: bool = False
    #: Extra ``SessionOptions.add_session_config_entry`` keys (``"session.intra_op.allow_spinning" = "0"``).
    session_config: dict[str, str] = field(default_factory=dict)
    #: Execution providers in order of preference; empty: from build.device ("cpu", "cuda").
    providers: tuple[str, ...] = ()
    #: ONNX opset of exports.
    opset: int = 17
    #: Where exports are cached; default ``$LMDOCK_CACHE_DIR/onnx`` or ``~/.cache/lmdock/onnx``.
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("intra_op_num_threads", "inter_op_num_threads"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (0: ONNX Runtime's default), got {value}")
        if not 14 <= self.opset <= 21:
            raise ValueError(f"opset must be between 14 and 21, got {self.opset}")
        object.__setattr__(self, "providers", tuple(self.providers))


def _available() -> str | None:
    missing = [m for m in ("onnxruntime", "numpy") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed; pip install lmdock-onnx"
    return None


def _engine_info() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return None


SPEC = BackendSpec(
    name="onnx",
    kind="step",
    plugin_api="1.0",
    supports=frozenset({"generate", "chat", "stream", "sampling", "logit_bias", "logprobs", "prompt_logprobs", "next_token_logprobs", "beam_search",
                        "structured_output", "tools", "quantization", "embed", "score", "logit_softcapping",
                        # windows by token position (a contiguous past), experts exported as batched matmuls
                        # (docs/backends/onnx.md); what lmdock-conformance's family tests found: docs/model-families.md
                        "sliding_window", "attention_sinks", "moe"}),
    lacks={
        "vision": "the ONNX export covers the text decoder only; no vision encoder is exported or run (docs/vision.md)",
        "offload": "ONNX Runtime holds the whole graph in one session; no OffloadPolicy",
        "lora": "not wired yet: onnxruntime-genai's Multi-LoRA adapters are not passed through (issue 33)",
        "recurrent_state": "the export's KV wrapper holds attention caches only: hybrid SSM / conv models fail with "
                           "'Cannot get conv state'",
    },
    requires=("onnxruntime", "numpy"),
    # onnxruntime runs the graph (a GPU build instead where installed); transformers loads tokenizers and,
    # with torch and onnx from [export], traces the export (docs/authoring-backends.md)
    engine_packages=("onnxruntime", "onnxruntime-gpu", "transformers", "torch", "onnx"),
    package="lmdock-onnx",
    version=__version__,
    available=_available,
    engine_info=_engine_info,
    options=OnnxOptions,
    # measured on stories260K against the float32 reference (docs/backends/onnx.md)
    tolerances={"logprobs": 1e-4, "int8_dynamic": 0.2, "int8_weight_only": 0.1, "int4_weight_only": 1.5},  # measured: 0.088, 0.021, 0.74
    priority=15,
    description="ONNX Runtime (exports transformers checkpoints with KV cache; int8/int4)",
)


def _quantize(quant: lmdock.QuantConfig, model_config: ModelConfig) -> Any:
    if quant.checkpoint_prequantized:
        return {"prequantized": True}
    if quant.algo not in QUANT_ALGOS:
        raise lmdock.UnsupportedError(
            f"quantization {quant.algo!r}: lmdock-onnx quantizes through onnxruntime.quantization, which does "
            f"{', '.join(QUANT_ALGOS)}; use one of those, or load a folder already quantized "
            "(checkpoint_prequantized = true)"
        )
    if quant.algo == "int8_dynamic" and quant.group_size is not None:
        raise lmdock.UnsupportedError("quantization int8_dynamic quantizes per tensor: remove group_size "
                                      "(int8_weight_only and int4_weight_only take one)")
    return {"algo": quant.algo, "group_size": quant.group_size}


def _build(model_config: ModelConfig) -> dict[str, Any] | None:
    b = model_config.build
    if model_config.kv_cache.dtype not in ("auto", b.dtype):
        raise lmdock.UnsupportedError(f"kv_cache.dtype {model_config.kv_cache.dtype!r}: lmdock-onnx keeps KV in the "
                                      "model's dtype; remove kv_cache.dtype or set build.dtype")
    dtype = b.dtype
    if dtype == "auto":  # float32 on CPU, where ONNX Runtime's half-precision kernels are few
        dtype = "float16" if b.device.startswith("cuda") else "float32"
    if dtype == "bfloat16":
        raise lmdock.UnsupportedError("build.dtype 'bfloat16': ONNX Runtime's CPU kernels lack it; use float32 "
                                      "(or float16 on CUDA)")
    return {"dtype": dtype, "device": b.device, "max_seq_len": b.max_seq_len, "kv_max_tokens": model_config.kv_cache.max_tokens}


def _load(model_config: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
    from lmdock.backend import read_pooling_config

    pooling = read_pooling_config(model_config.model)
    if pooling["task"] is not None:  # an embedding model or a cross-encoder: the pooling engine
        if quantization:
            raise lmdock.UnsupportedError("lmdock-onnx quantizes causal LMs only; remove [quantization] for an embedding model")
        from lmdock_onnx._pooling import OnnxPoolingEngine

        return OnnxPoolingEngine.load(model_config, options, build, pooling)
    from lmdock_onnx._load import load

    return load(model_config, options, quantization, build)


#: what the entry point names: the spec and the functions above (lmdock.backend.Backend)
plugin = Backend(SPEC, load=_load, build=_build, quantize=_quantize)
