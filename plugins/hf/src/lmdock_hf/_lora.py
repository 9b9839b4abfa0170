"""LoRA adapters on the transformers engine: lmdock's own low-rank add, several adapters in one forward.

An adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``: ``lora_A`` /
``lora_B`` per target module, ``r``, ``lora_alpha``).  The base weights are never changed: each
targeted ``nn.Linear`` is wrapped (:class:`LoRALinear`) the first time an adapter targets it, and the
wrapper adds ``scale * (x @ A.T) @ B.T`` to the rows whose adapter has weights for that module.  The
engine says, before each forward, which rows run under which adapter (:meth:`Adapters.select`), so a
batch mixing the base model and several adapters runs in one forward; rows under no adapter compute
exactly what the unwrapped layer does.

Adapters load on first use (``prepare``, in the submitting thread, so one that cannot load fails its
request alone) and at most ``build.max_loras`` stay loaded (default 8); the least recently used go
first, never one the current step uses (an evicted adapter is read again when a request names it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lmdock import LoRARequest, RequestError
from lmdock.backend import AdapterCache, read_lora_adapter


@dataclass
class Adapter:
    """One adapter's weights: ``modules[name] = (A [r, in], B [out, r], scale)``."""

    key: tuple[str, str]
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


class LoRALinear(torch.nn.Module):
    """A linear layer plus the low-rank updates of the adapters its rows run under this forward."""

    def __init__(self, base: torch.nn.Linear, name: str, adapters: Adapters) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self._adapters = [adapters]  # a list: not a submodule of the model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for rows, a, b, scale in self._adapters[0].plan.get(self.name, ()):
            if rows is None:  # every row of the forward
                out = out + scale * ((x @ a.T) @ b.T)
            else:
                out[rows] += scale * ((x[rows] @ a.T) @ b.T)
        return out


class Adapters(AdapterCache[Adapter]):
    """The adapters an engine has loaded (``lmdock.backend.AdapterCache``: least recently used out,
    rows grouped by adapter), and which rows of the current forward use which."""

    def __init__(self, model: torch.nn.Module, max_loras: int | None, max_rank: int | None) -> None:
        super().__init__(max_loras, max_rank)
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        #: the current forward's updates: module name -> [(row indices or None for all, A, B, scale)]
        self.plan: dict[str, list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float]]] = {}
        self._wrapped: set[str] = set()

    def load(self, lora: LoRARequest) -> Adapter:
        return read_adapter(lora, self.model, self.dtype, self.device, self.max_rank)

    def select(self, loras: Sequence[LoRARequest | None]) -> None:
        """Say which adapter each row of the next forward runs under (engine thread)."""
        self.plan = {}
        for adapter, rows in self.groups(loras):
            index = None if rows is None else torch.tensor(rows, device=self.device)
            for name, (a, b, scale) in adapter.modules.items():
                self._wrap(name)
                self.plan.setdefault(name, []).append((index, a, b, scale))

    def clear(self) -> None:
        self.plan = {}

    def _wrap(self, name: str) -> None:
        if name in self._wrapped:
            return
        parent_name, _, attr = name.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        setattr(parent, attr, LoRALinear(getattr(parent, attr), name, self))
        self._wrapped.add(name)


def read_adapter(lora: LoRARequest, model: torch.nn.Module, dtype: torch.dtype, device: torch.device, max_rank: int | None) -> Adapter:
    """An adapter's weights from its PEFT folder, checked against the model; raises RequestError
    naming what is wrong (``read_lora_adapter``'s checks, a module the model lacks, a shape, a rank
    above ``build.max_lora_rank``)."""
    from safetensors.torch import load_file

    weights_file, targets = read_lora_adapter(lora)
    for m in targets:
        layer = _linear(model, m.name, lora)
        m.check(lora, layer.out_features, layer.in_features, max_rank)
    tensors = load_file(weights_file)
    modules = {m.name: (tensors[m.lora_a].to(device, dtype), tensors[m.lora_b].to(device, dtype), m.scale) for m in targets}
    return Adapter(lora.key, modules)


def _linear(model: torch.nn.Module, name: str, lora: LoRARequest) -> torch.nn.Linear:
    try:
        layer = model.get_submodule(name)
    except AttributeError:
        raise RequestError(f"lora_request {lora.name!r}: the model has no module {name!r}: an adapter for another model?") from None
    if isinstance(layer, LoRALinear):
        layer = layer.base
    if not isinstance(layer, torch.nn.Linear):
        raise RequestError(f"lora_request {lora.name!r}: module {name!r} is a {type(layer).__name__}; lmdock-hf runs LoRA on nn.Linear only")
    return layer
