"""LoRA adapters on the transformers engine: lmdock's own low-rank add, several adapters in one forward.

An adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``: ``lora_A`` /
``lora_B`` per target module, ``r``, ``lora_alpha``).  The base weights are never changed: each
targeted ``nn.Linear`` is wrapped (:class:`LoRALinear`) the first time an adapter targets it, and the
wrapper adds ``scale * (x @ A.T) @ B.T`` to the rows whose adapter has weights for that module.  The
engine says, before each forward, which rows run under which adapter (:meth:`Adapters.select`), so a
batch mixing the base model and several adapters runs in one forward; rows under no adapter compute
exactly what the unwrapped layer does.

Adapters load on first use (``prepare``, in the submitting thread, so one that cannot load fails its
request alone) and at most ``build.max_loras`` stay loaded; the least recently used go first, never
one the current forward uses (an evicted adapter is read again when a request names it).
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lmdock import LoRARequest, RequestError

#: Adapters kept loaded when ``build.max_loras`` is not set.
DEFAULT_MAX_LORAS = 8

#: PEFT adapter_config.json settings lmdock's add does not implement, and the value that is harmless.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None}


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


class Adapters:
    """The adapters an engine has loaded, and which rows of the current forward use which."""

    def __init__(self, model: torch.nn.Module, max_loras: int | None, max_rank: int | None) -> None:
        self.model = model
        self.max_loras = max_loras or DEFAULT_MAX_LORAS
        self.max_rank = max_rank
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.loaded: OrderedDict[tuple[str, str], Adapter] = OrderedDict()
        #: the current forward's updates: module name -> [(row indices or None for all, A, B, scale)]
        self.plan: dict[str, list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float]]] = {}
        self._wrapped: set[str] = set()
        self._lock = threading.Lock()
        self.loads = 0  # adapters read from disk (tests check the cache)

    def prepare(self, lora: LoRARequest) -> None:
        """Load the adapter unless it is loaded (any thread); raises when it cannot be."""
        self._get(lora)

    def _get(self, lora: LoRARequest) -> Adapter:
        with self._lock:
            adapter = self.loaded.get(lora.key)
            if adapter is None:
                adapter = read_adapter(lora, self.model, self.dtype, self.device, self.max_rank)
                self.loads += 1
                self.loaded[lora.key] = adapter
            self.loaded.move_to_end(lora.key)
            return adapter

    def select(self, loras: Sequence[LoRARequest | None]) -> None:
        """Say which adapter each row of the next forward runs under (engine thread)."""
        self.plan = {}
        groups: dict[tuple[str, str], list[int]] = {}
        by_key: dict[tuple[str, str], LoRARequest] = {}
        for row, lora in enumerate(loras):
            if lora is not None:
                groups.setdefault(lora.key, []).append(row)
                by_key[lora.key] = lora
        if not groups:
            return
        for key, rows in groups.items():
            adapter = self._get(by_key[key])
            index = None if len(rows) == len(loras) else torch.tensor(rows, device=self.device)
            for name, (a, b, scale) in adapter.modules.items():
                self._wrap(name)
                self.plan.setdefault(name, []).append((index, a, b, scale))
        self._evict(keep=set(groups))

    def clear(self) -> None:
        self.plan = {}

    def _wrap(self, name: str) -> None:
        if name in self._wrapped:
            return
        parent_name, _, attr = name.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        setattr(parent, attr, LoRALinear(getattr(parent, attr), name, self))
        self._wrapped.add(name)

    def _evict(self, keep: set[tuple[str, str]]) -> None:
        with self._lock:
            for key in [k for k in self.loaded if k not in keep][: max(0, len(self.loaded) - self.max_loras)]:
                del self.loaded[key]


def read_adapter(lora: LoRARequest, model: torch.nn.Module, dtype: torch.dtype, device: torch.device, max_rank: int | None) -> Adapter:
    """An adapter's weights from its PEFT folder, checked against the model; raises RequestError
    naming what is wrong (a missing file, a module the model lacks, a shape, a PEFT setting lmdock
    does not implement)."""
    from safetensors.torch import load_file

    folder = Path(lora.path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise RequestError(f"lora_request {lora.name!r}: {f} does not exist; an adapter is a PEFT folder "
                               "(adapter_config.json + adapter_model.safetensors)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise RequestError(f"lora_request {lora.name!r}: peft_type {config.get('peft_type')!r} is not a LoRA adapter")
    for key, harmless in _UNSUPPORTED.items():
        if config.get(key, harmless) not in (harmless, [], {}):
            raise RequestError(f"lora_request {lora.name!r}: adapter_config.json sets {key}={config[key]!r}, which lmdock-hf "
                               "does not implement; use a plain LoRA adapter")
    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise RequestError(f"lora_request {lora.name!r}: tensor {key!r} is not a lora_A / lora_B weight; lmdock-hf "
                               "runs LoRA on linear layers only")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for name, ab in pairs.items():
        layer = _linear(model, name, lora)
        if set(ab) != {"A", "B"}:
            raise RequestError(f"lora_request {lora.name!r}: module {name!r} lacks lora_{'A' if 'A' not in ab else 'B'}")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise RequestError(f"lora_request {lora.name!r}: {name!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                               f"which do not fit the model's layer ({layer.out_features} x {layer.in_features}): an adapter for another model?")
        if max_rank is not None and rank > max_rank:
            raise RequestError(f"lora_request {lora.name!r}: rank {rank} exceeds build.max_lora_rank = {max_rank}")
        r_m = int(_pattern(config.get("rank_pattern"), name, r))
        alpha_m = float(_pattern(config.get("alpha_pattern"), name, alpha))
        scale = alpha_m / math.sqrt(r_m) if config.get("use_rslora") else alpha_m / r_m
        modules[name] = (a.to(device, dtype), b.to(device, dtype), scale)
    if not modules:
        raise RequestError(f"lora_request {lora.name!r}: {weights_file} holds no lora_A / lora_B weights")
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


def _pattern(patterns: dict[str, Any] | None, name: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: the first key that matches the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default
