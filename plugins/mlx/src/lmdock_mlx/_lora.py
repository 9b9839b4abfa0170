"""LoRA adapters on the MLX engine: lmdock's own low-rank add, several adapters in one forward.

An adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``: ``lora_A`` /
``lora_B`` per target module, ``r``, ``lora_alpha``).  mlx-lm's own adapters (``adapter_path``)
change the whole model, so lmdock does as lmdock-hf does: each targeted linear layer (``nn.Linear``
or ``nn.QuantizedLinear``) is wrapped (:class:`LoRALinear`) the first time an adapter targets it, and
the wrapper adds ``scale * (x @ A.T) @ B.T`` to the rows whose adapter has weights for that module.
The engine says, before each forward it builds, which rows run under which adapter
(:meth:`Adapters.select`); MLX builds graphs lazily, so the plan only has to hold while the forward's
graph is built.  Rows under no adapter compute exactly what the unwrapped layer does, and a forward
with no adapter at all adds nothing.

``prepare`` (in the submitting thread) checks an adapter completely from its config and the
safetensors header (files, PEFT settings, module names, shapes, rank), so one that cannot load fails
its request alone; its weights are read with ``mx.load`` in the engine thread on first use, because
MLX streams belong to the thread that made them.  At most ``build.max_loras`` stay loaded; the least
recently used go first, never one the current step uses (an evicted adapter is read again when a
request names it).
"""

from __future__ import annotations

import json
import math
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from lmdock import LoRARequest, RequestError

#: Adapters kept loaded when ``build.max_loras`` is not set (lmdock-hf's default too).
DEFAULT_MAX_LORAS = 8

#: PEFT adapter_config.json settings lmdock's add does not implement, and the value that is harmless.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None}


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


class Adapters:
    """The adapters an engine has loaded, and which rows of the forward being built use which."""

    def __init__(self, model: nn.Module, max_loras: int | None, max_rank: int | None) -> None:
        self.model = model
        self.max_loras = max_loras or DEFAULT_MAX_LORAS
        self.max_rank = max_rank
        self.loaded: OrderedDict[tuple[str, str], Adapter] = OrderedDict()
        #: the current forward's updates: module name -> [(row indices or None for all, A.T, B.T, scale)]
        self.plan: dict[str, list[tuple[mx.array | None, mx.array, mx.array, float]]] = {}
        self._wrapped: set[str] = set()
        self._lock = threading.Lock()
        self.loads = 0  # adapters checked and (re)admitted (tests check the cache)

    def prepare(self, lora: LoRARequest) -> None:
        """Check the adapter unless it is loaded (any thread); raises RequestError when it cannot run."""
        self._get(lora)

    def _get(self, lora: LoRARequest) -> Adapter:
        with self._lock:
            adapter = self.loaded.get(lora.key)
            if adapter is None:
                adapter = check_adapter(lora, self.model, self.max_rank)
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
        for key, rows in groups.items():
            index = None if len(rows) == len(loras) else mx.array(rows)
            for name, (a, b, scale) in self._get(by_key[key]).weights().items():
                self._wrap(name)
                self.plan.setdefault(name, []).append((index, a, b, scale))

    def clear(self) -> None:
        self.plan = {}

    def evict(self, keep: Iterable[tuple[str, str]]) -> None:
        """Drop the least recently used adapters beyond ``max_loras``, except those in ``keep`` (the
        step's); graphs already built keep the arrays they captured."""
        keep = set(keep)
        with self._lock:
            for key in [k for k in self.loaded if k not in keep][: max(0, len(self.loaded) - self.max_loras)]:
                del self.loaded[key]

    def _wrap(self, name: str) -> None:
        if name in self._wrapped:
            return
        parent, attr = _parent(self.model, name)
        setattr(parent, attr, LoRALinear(getattr(parent, attr), name, self))
        self._wrapped.add(name)


def check_adapter(lora: LoRARequest, model: nn.Module, max_rank: int | None) -> Adapter:
    """An adapter's modules and scales from its PEFT folder, checked against the model without
    reading its weights; raises RequestError naming what is wrong (a missing file, a module the
    model lacks, a shape, a rank above ``build.max_lora_rank``, a PEFT setting lmdock does not
    implement)."""
    folder = Path(lora.path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise RequestError(f"lora_request {lora.name!r}: {f} does not exist; an adapter is a PEFT folder "
                               "(adapter_config.json + adapter_model.safetensors)")
    try:
        config = json.loads(config_file.read_text())
        header = _safetensors_header(weights_file)
    except (OSError, ValueError) as exc:
        raise RequestError(f"lora_request {lora.name!r}: cannot read the adapter: {exc}") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise RequestError(f"lora_request {lora.name!r}: peft_type {config.get('peft_type')!r} is not a LoRA adapter")
    for key, harmless in _UNSUPPORTED.items():
        if config.get(key, harmless) not in (harmless, [], {}):
            raise RequestError(f"lora_request {lora.name!r}: adapter_config.json sets {key}={config[key]!r}, which lmdock-mlx "
                               "does not implement; use a plain LoRA adapter")
    pairs: dict[str, dict[str, str]] = {}
    for key in header:
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise RequestError(f"lora_request {lora.name!r}: tensor {key!r} is not a lora_A / lora_B weight; lmdock-mlx "
                               "runs LoRA on linear layers only")
        pairs.setdefault(m.group(1), {})[m.group(2)] = key
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    tensors: dict[str, tuple[str, str, float]] = {}
    for name, ab in pairs.items():
        out_f, in_f = _linear_shape(model, name, lora)
        if set(ab) != {"A", "B"}:
            raise RequestError(f"lora_request {lora.name!r}: module {name!r} lacks lora_{'A' if 'A' not in ab else 'B'}")
        a, b = header[ab["A"]]["shape"], header[ab["B"]]["shape"]
        rank = a[0] if len(a) == 2 else -1
        if a != [rank, in_f] or b != [out_f, rank]:
            raise RequestError(f"lora_request {lora.name!r}: {name!r} has lora_A {tuple(a)} and lora_B {tuple(b)}, "
                               f"which do not fit the model's layer ({out_f} x {in_f}): an adapter for another model?")
        if max_rank is not None and rank > max_rank:
            raise RequestError(f"lora_request {lora.name!r}: rank {rank} exceeds build.max_lora_rank = {max_rank}")
        r_m = int(_pattern(config.get("rank_pattern"), name, r))
        alpha_m = float(_pattern(config.get("alpha_pattern"), name, alpha))
        scale = alpha_m / math.sqrt(r_m) if config.get("use_rslora") else alpha_m / r_m
        tensors[name] = (ab["A"], ab["B"], scale)
    if not tensors:
        raise RequestError(f"lora_request {lora.name!r}: {weights_file} holds no lora_A / lora_B weights")
    return Adapter(lora.key, weights_file, tensors)


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The tensors' names, dtypes and shapes, without reading their data (the format's own header)."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100_000_000:
            raise ValueError(f"{path} is not a safetensors file")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


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


def _pattern(patterns: dict[str, Any] | None, name: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: the first key that matches the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default
