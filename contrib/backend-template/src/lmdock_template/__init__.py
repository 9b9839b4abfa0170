"""lmdock-template: the entry-point module.  Cheap: it imports lmdock only (no NumPy)."""

from __future__ import annotations

import importlib.util
from typing import Any

import lmdock

__version__ = "0.1.0"


def _available() -> str | None:
    missing = [m for m in ("numpy", "safetensors", "tokenizers") if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed; pip install lmdock-template" if missing else None


SPEC = lmdock.backend.BackendSpec(
    name="template",
    kind="step",
    plugin_api="1.0",
    supports=frozenset({"generate", "chat", "stream", "sampling", "logprobs", "prompt_logprobs", "next_token_logprobs", "beam_search", "structured_output"}),
    lacks={
        "embed": "a causal LM only; the template has no pooling head",
        "score": "a causal LM only; the template has no scoring head",
        "quantization": "the reference engine computes in float32 only",
        "offload": "weights are NumPy arrays in RAM",
    },
    requires=("numpy", "safetensors", "tokenizers"),
    package="lmdock-template",
    version=__version__,
    available=_available,
    priority=1,
    description="reference Llama in plain NumPy (copy me to write a backend)",
)


@lmdock.hookimpl
def lmdock_register_backends(register: Any) -> None:
    register(SPEC)


@lmdock.hookimpl
def lmdock_load_engine(backend: str, model_config: lmdock.ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
    if backend != "template":
        return None
    from lmdock_template._engine import NumpyLlama

    return NumpyLlama.load(model_config)
