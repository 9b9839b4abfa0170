"""LoRA adapters on the MLX engine: lmdock's own low-rank add, several adapters in one forward.

An adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``: ``lora_A`` /
``lora_B`` per target module, ``r``, ``lora_alpha``).  mlx-lm's own adapters (``adapter_path``)
change the whole model, so lmdock does as lmdock-hf does: each targeted linear layer (``nn.Linear``
or ``nn.QuantizedLinear``) gets a wrapper (:class:`LoRALinear`) that adds ``scale * (x @ A.T) @ B.T``
to the rows whose adapter has weights for that module.  The engine says, before each forward it
builds, which rows run under which adapter (:meth:`Adapters.select`, which puts the wrappers of the
targeted layers in place) and :meth:`Adapters.clear` puts the base layers back: MLX builds graphs
lazily, so both only have to hold while the forward's graph is built.  Rows under no adapter compute
exactly what the base layer does, and a forward with no adapter runs the untouched model.

``prepare`` (in the submitting thread) checks an adapter completely from its config and the
safetensors header (``lmdock.backend.read_lora_adapter``, then module names, shapes and rank), so one
that cannot load fails its request alone; its weights are read with ``mx.load`` in the engine thread
on first use, because MLX streams belong to the thread that made them.  At most ``build.max_loras``
(default 8) stay loaded; the least recently used go first, never one a sequence in flight runs under (an evicted
adapter is read again when a request names it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from lmdock import LoRARequest, RequestError
from lmdock.backend import AdapterCache, read_lora_adapter


@dataclass
class Adapter:
    """One adapter: ``tensors[name] = (lora_A key, lora_B key, scale)`` in its safetensors file, and,
    once read in the engine thread, ``modules[name] = (A.T [in, r], B.T [r, out], scale)``."""

    key: tuple[str, str]
    file: Path
    tensors: dict[str, tuple[str, str, float]]
    modules: dict[str, tuple[mx.array, mx.array, float]] = field(default_factory=dict)

    def weights(self) -> dict[str, tuple[mx.array, mx.array, float]]:
        if not self.modules:
            raw = mx.load(str(self.file))
            self.modules = {name: (raw[a].T, raw[b].T, scale) for name, (a, b, scale) in self.tensors.items()}
            mx.eval([m[:2] for m in self.modules.values()])
        return self.modules


class LoRALinear(nn.Module):
    """A linear layer plus the low-rank updates of the adapters its rows run under this forward."""

    def __init__(self, base: nn.Module, name: str, adapters: Adapters) -> None:
        super().__init__()
        self.base = base
        self.lora_name = name  # plain attributes (not arrays, lists or modules): not parameters
        self.store = adapters

    def __call__(self, x: mx.array) -> mx.array:
        out = self.base(x)
        for rows, a, b, scale in self.store.plan.get(self.lora_name, ()):
            if rows is None:  # every row of the forward
                out = out + (scale * ((x @ a) @ b)).astype(out.dtype)
            else:
                out = out.at[rows].add((scale * ((x[rows] @ a) @ b)).astype(out.dtype))
        return out


class Adapters(AdapterCache[Adapter]):
    """The adapters an engine has loaded (``lmdock.backend.AdapterCache``: least recently used out,
    rows grouped by adapter), and which rows of the forward being built use which."""

    def __init__(self, model: nn.Module, max_loras: int | None, max_rank: int | None) -> None:
        super().__init__(max_loras, max_rank)
        self.model = model
        #: the current forward's updates: module name -> [(row indices or None for all, A.T, B.T, scale)]
        self.plan: dict[str, list[tuple[mx.array | None, mx.array, mx.array, float]]] = {}
        #: module name -> (its parent, attribute, the base layer, its wrapper), made on first use
        self._wrappers: dict[str, tuple[Any, str, nn.Module, LoRALinear]] = {}

    def load(self, lora: LoRARequest) -> Adapter:
        """Checked, not read: the weights load in the engine thread (``Adapter.weights``)."""
        return check_adapter(lora, self.model, self.max_rank)

    def select(self, loras: Sequence[LoRARequest | None]) -> None:
        """Say which adapter each row of the next forward runs under, and put the wrappers of the
        layers they target in place (engine thread; ``clear`` undoes it)."""
        plan: dict[str, list[tuple[mx.array | None, mx.array, mx.array, float]]] = {}
        for adapter, rows in self.groups(loras):
            index = None if rows is None else mx.array(rows)
            for name, (a, b, scale) in adapter.weights().items():
                plan.setdefault(name, []).append((index, a, b, scale))
        for name in plan:
            parent, attr, _, wrapper = self._wrapper(name)
            setattr(parent, attr, wrapper)
        self.plan = plan

    def clear(self) -> None:
        """Put the base layers back once the forward's graph is built: a forward without adapters
        runs the model exactly as mlx-lm made it, with no wrapper in the way."""
        for name in self.plan:
            parent, attr, base, _ = self._wrappers[name]
            setattr(parent, attr, base)
        self.plan = {}

    def _wrapper(self, name: str) -> tuple[Any, str, nn.Module, LoRALinear]:
        if name not in self._wrappers:
            parent, attr = _parent(self.model, name)
            base = getattr(parent, attr)
            self._wrappers[name] = (parent, attr, base, LoRALinear(base, name, self))
        return self._wrappers[name]


def check_adapter(lora: LoRARequest, model: nn.Module, max_rank: int | None) -> Adapter:
    """An adapter's modules and scales from its PEFT folder, checked against the model without
    reading its weights; raises RequestError naming what is wrong (``read_lora_adapter``'s checks,
    a module the model lacks, a shape, a rank above ``build.max_lora_rank``)."""
    weights_file, modules = read_lora_adapter(lora)
    tensors: dict[str, tuple[str, str, float]] = {}
    for m in modules:
        m.check(lora, *_linear_shape(model, m.name, lora), max_rank)
        tensors[m.name] = (m.lora_a, m.lora_b, m.scale)
    return Adapter(lora.key, Path(weights_file), tensors)


def _parent(model: nn.Module, name: str) -> tuple[Any, str]:
    """The object holding the module ``name`` (a dotted path; numbers index lists) and its attribute."""
    *path, attr = name.split(".")
    obj: Any = model
    for part in path:
        obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part)
    if isinstance(obj, list) or not hasattr(obj, attr):
        raise AttributeError(name)
    return obj, attr


def _linear_shape(model: nn.Module, name: str, lora: LoRARequest) -> tuple[int, int]:
    """(out, in) of the linear layer ``name``, quantized or not."""
    try:
        parent, attr = _parent(model, name)
    except (AttributeError, IndexError, ValueError):
        raise RequestError(f"lora_request {lora.name!r}: the model has no module {name!r}: an adapter for another model?") from None
    layer = getattr(parent, attr)
    if isinstance(layer, LoRALinear):
        layer = layer.base
    if isinstance(layer, nn.QuantizedLinear):
        out_f, packed = layer.weight.shape
        return out_f, packed * 32 // layer.bits
    if not isinstance(layer, nn.Linear):
        raise RequestError(f"lora_request {lora.name!r}: module {name!r} is a {type(layer).__name__}; lmdock-mlx runs LoRA on linear layers only")
    out_f, in_f = layer.weight.shape
    return out_f, in_f
