"""lmdock-mlx: the entry-point module (imports neither mlx nor mlx-lm)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

import lmdock
from lmdock import ModelConfig
from lmdock.backend import Backend, BackendSpec

__version__ = "0.1.0"

#: QuantConfig.algo -> MLX bits (affine, group-wise quantization of the weights).
QUANT_BITS = {"int8_weight_only": 8, "int4_weight_only": 4}


@dataclass(frozen=True)
class MlxOptions:
    """``[models.NAME.backends.mlx]``: options of the MLX backend (unknown keys are errors)."""

    #: who samples: "mlx" (the pipeline in MLX, where the logits are) or "reference" (the core's NumPy sampler)
    sampler: Literal["mlx", "reference"] = "mlx"


def _available() -> str | None:
    if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
        return "mlx and mlx-lm are not installed; pip install lmdock-mlx (it pulls mlx[cpu] on Linux)"
    return None


SPEC = BackendSpec(
    name="mlx",
    kind="step",
    plugin_api="1.0",
    supports=frozenset({"generate", "chat", "stream", "sampling", "logit_bias", "logprobs", "prompt_logprobs", "next_token_logprobs", "beam_search", "structured_output", "tools",
                        "quantization", "lora", "moe"}),
    # families the family tests found exact although their feature is lacked in general, and families
    # refused whatever they need (docs/model-families.md)
    family_support={"recurrent_state": frozenset({"falcon_h1", "lfm2", "qwen3_next",
                                                  # on mlx-lm's granitemoehybrid, translated (lmdock_mlx._granite_hybrid)
                                                  "granitemoehybrid", "bamba"}),
                    # mlx-lm's Gemma 3 keeps its sliding layers in RotatingKVCaches of the window; lmdock-mlx passes it
                    # the layer pattern (layer_types -> sliding_window_pattern, _engine.KEY_VALUES); its gpt-oss does the
                    # same from layer_types (transformers 5's checkpoints translated in memory, lmdock_mlx._gpt_oss)
                    "sliding_window": frozenset({"gemma3_text", "gpt_oss"}),
                    "attention_sinks": frozenset({"gpt_oss"}),
                    # mlx-lm's Gemma 2 caps attention and final logits (models/gemma2.py); its port has no window, so
                    # the family tests check it with the context capped at the window (test_families, "within")
                    "logit_softcapping": frozenset({"gemma2"})},
    lacks={
        "vision": "mlx-lm runs text models only; mlx-vlm's vision models do not fit the step-engine contract here yet (docs/vision.md)",
        "embed": "mlx-lm serves causal LMs",
        "score": "mlx-lm serves causal LMs",
        "offload": "MLX keeps weights in unified memory",
        # model features: what lmdock-conformance's family tests found (docs/model-families.md)
        "sliding_window": "mlx-lm 0.32 attends past Mistral's, Phi-3's, Qwen2's and Gemma 2's windows (its ports of them have "
                          "no window: tokens differ past it); Gemma 3's and gpt-oss's it keeps",
        "attention_sinks": "unverified beyond gpt-oss, the one family of the family tests that has them",
        "logit_softcapping": "unverified beyond Gemma 2, the one family of the family tests that has it",
        "recurrent_state": "unverified beyond the family tests' hybrids: falcon_h1, lfm2, qwen3_next, granitemoehybrid and "
                           "bamba run exactly (the last two on mlx-lm's granitemoehybrid port, their configs translated)",
    },
    requires=("mlx", "mlx_lm"),
    engine_packages=("mlx", "mlx-lm"),  # mlx-lm's caches and model calls (docs/authoring-backends.md)
    package="lmdock-mlx",
    version=__version__,
    available=_available,
    options=MlxOptions,
    tolerances={"logprobs": 1e-4, "int8_weight_only": 0.1, "int4_weight_only": 1.5},  # measured: 0.035, 0.82
    priority=20,
    description="MLX / mlx-lm (Apple silicon, Linux CPU)",
)


def _quantize(quant: lmdock.QuantConfig, model_config: ModelConfig) -> Any:
    if quant.checkpoint_prequantized:
        return {"prequantized": True}
    if quant.algo not in QUANT_BITS:
        raise lmdock.UnsupportedError(
            f"quantization {quant.algo!r}: MLX quantizes weights to 4 or 8 bits; use int4_weight_only or "
            "int8_weight_only (or a pre-quantized mlx-community checkpoint with checkpoint_prequantized = true)"
        )
    return {"bits": QUANT_BITS[quant.algo], "group_size": quant.group_size or 64}


def _build(model_config: ModelConfig) -> dict[str, Any] | None:
    b = model_config.build
    if b.device not in ("auto", "cpu", "gpu", "metal"):
        raise lmdock.UnsupportedError(f"build.device {b.device!r}: MLX runs on 'cpu' or 'gpu' (Metal)")
    return {"dtype": b.dtype, "device": b.device, "max_seq_len": b.max_seq_len, "kv_max_tokens": model_config.kv_cache.max_tokens,
            "max_loras": b.max_loras, "max_lora_rank": b.max_lora_rank}


def _load(model_config: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
    from lmdock_mlx._engine import MlxStepEngine

    return MlxStepEngine.load(model_config, options, quantization, build)


#: what the entry point names: the spec and the functions above (lmdock.backend.Backend)
def _sampler(model_config: ModelConfig) -> Any:
    if model_config.backend_options("mlx").get("sampler", "mlx") == "reference":
        return None  # the core's reference sampler answers
    from lmdock_mlx._sampler import MlxSampler

    return MlxSampler()


plugin = Backend(SPEC, load=_load, build=_build, quantize=_quantize, sampler=_sampler)
