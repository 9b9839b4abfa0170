"""Placeholders for TensorRT-LLM objects, so translation needs no ``tensorrt_llm`` import.

The translation produces plain dicts whose values may be a :class:`ConfigRef` (a config class and
its keyword arguments), an :class:`EnumRef` (an enum and a member name) or a :class:`TensorRef` (a
float32 tensor's values).  The engine turns them
into real objects with the installed module (:func:`materialize`); the tests check them against the
recorded API facts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EnumRef:
    enum: str
    member: str


@dataclass(frozen=True)
class ConfigRef:
    cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorRef:
    """A float32 ``torch.Tensor`` of these values (``SamplingParams.embedding_bias``)."""

    values: tuple[float, ...]


#: Where each referenced name lives in tensorrt_llm (first match wins).
MODULES = ("tensorrt_llm.llmapi", "tensorrt_llm", "tensorrt_llm.sampling_params", "tensorrt_llm.quantization.mode", "tensorrt_llm.builder")


def _lookup(name: str) -> Any:
    import importlib

    for module in MODULES:
        try:
            obj = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if obj is not None:
            return obj
    raise LookupError(f"tensorrt_llm has no {name!r} in {', '.join(MODULES)}")


def materialize(value: Any) -> Any:
    """Turn refs (also inside dicts and lists) into TensorRT-LLM objects."""
    if isinstance(value, EnumRef):
        return getattr(_lookup(value.enum), value.member)
    if isinstance(value, ConfigRef):
        return _lookup(value.cls)(**materialize(value.kwargs))
    if isinstance(value, TensorRef):
        import torch

        return torch.tensor(value.values, dtype=torch.float32)
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [materialize(v) for v in value]
    return value
