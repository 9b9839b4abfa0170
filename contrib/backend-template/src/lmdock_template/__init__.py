"""lmdock-template: the entry-point module.  Cheap: it imports lmdock only (no NumPy)."""

from __future__ import annotations

import importlib.util
from typing import Any

import lmdock
from lmdock.backend import Backend

__version__ = "0.1.0"


def _available() -> str | None:
    missing = [m for m in ("numpy", "safetensors", "tokenizers") if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed; pip install lmdock-template" if missing else None


SPEC = lmdock.backend.BackendSpec(
    name="template",
    kind="step",
    plugin_api="1.0",
    supports=frozenset({"generate", "chat", "stream", "sampling", "logit_bias", "logprobs", "prompt_logprobs", "next_token_logprobs", "beam_search", "structured_output",
                        "tools"}),
    lacks={
        "vision": "the template backend runs text only",
        "embed": "a causal LM only; the template has no pooling head",
        "score": "a causal LM only; the template has no scoring head",
        "quantization": "the reference engine computes in float32 only",
        "offload": "weights are NumPy arrays in RAM",
        "lora": "the template runs no adapters",
        # model features: what a Llama needs and nothing more (a copy that adds one declares it)
        "sliding_window": "the reference Llama attends to the whole context",
        "attention_sinks": "the reference Llama has plain softmax attention",
        "logit_softcapping": "the reference Llama does not soft-cap logits",
        "recurrent_state": "the reference Llama has attention layers only",
        "moe": "the reference Llama has dense MLPs only",
    },
    # Llama's relatives whose layers differ in ways the reference Llama does not implement; any other
    # model_type is refused by the engine as it loads (lmdock_template._engine)
    refuses_families={
        "qwen2": "the reference Llama has no q/k/v projection biases",
        "qwen3": "the reference Llama has no per-head q/k norms",
        "olmo2": "the reference Llama has no q/k norms and normalises before, not after, each block",
        "granite": "the reference Llama has no embedding, residual, attention or logit multipliers",
        "phi3": "the reference Llama reads separate q/k/v and gate/up projections, not Phi-3's fused ones",
        "gpt2": "the reference Llama has rotary positions, not learned absolute ones, and RMSNorm, not LayerNorm",
    },
    requires=("numpy", "safetensors", "tokenizers"),
    # The template runs its own NumPy forward: no engine, so no engine_packages.  A backend over an
    # engine names the distributions whose internals it relies on, and bounds each in pyproject.toml
    # at the releases CI tests (both ends), e.g. dependencies = ["mything>=1.4,<1.7"]:
    #     engine_packages=("mything",),
    # `lmdock backends` then shows the installed mything and warns when it is outside >=1.4,<1.7.
    engine_packages=(),
    package="lmdock-template",
    version=__version__,
    available=_available,
    priority=1,
    description="reference Llama in plain NumPy (copy me to write a backend)",
)


def _load(model_config: lmdock.ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
    from lmdock_template._engine import NumpyLlama

    return NumpyLlama.load(model_config)


#: what the entry point names: the spec and the functions above (lmdock.backend.Backend)
plugin = Backend(SPEC, load=_load)
