"""LoRA adapters as a request names them: ``LoRARequest`` (vLLM's shape, PEFT adapter folders).

An adapter is a folder in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``).
A request runs under at most one adapter; requests under different adapters (and the base model) may
share one engine step.  What the adapter changes is the model itself, so whatever was computed under
one adapter (a cached prompt prefix, a forked KV state) is never reused under another: ``key`` is
what caches are keyed by.

``read_lora_adapter`` reads such a folder's config and safetensors header for the backends that run
lmdock's own low-rank add (lmdock-hf, lmdock-mlx): the PEFT rules live here once, the tensors are
loaded by each backend's framework.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmdock._plugin.errors import RequestError, listed

#: A name an adapter may be served under (``MODEL:ADAPTER``): letters, digits, '.', '_' and '-', at
#: most 64 of them (every 404 and ``/v1/models`` lists the names: their size is the server's to bound).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

#: The largest rank an adapter may have when ``build.max_lora_rank`` is not set.  vLLM's default is 16;
#: lmdock takes 64, which covers the ranks published adapters use (8 to 64), and refuses the
#: rank-200,000 adapter that would cost a module's memory many times over.
DEFAULT_MAX_LORA_RANK = 64


@dataclass(frozen=True, init=False)
class LoRARequest:
    """A LoRA adapter for a request: ``LoRARequest("sql", "/adapters/sql")``.

    vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)`` is accepted as it is: ``lora_name`` and
    ``lora_path`` are aliases of ``name`` and ``path``, and ``lora_int_id`` (vLLM's adapter slot id)
    is kept as ``int_id``.  ``base_model_name`` (vLLM's) is kept and not checked.
    """

    name: str
    path: str
    int_id: int | None = None
    base_model_name: str | None = None

    def __init__(self, name: str | None = None, *args: Any, path: str | os.PathLike[str] | None = None, int_id: int | None = None,
                 lora_name: str | None = None, lora_int_id: int | None = None, lora_path: str | os.PathLike[str] | None = None,
                 lora_local_path: str | os.PathLike[str] | None = None, base_model_name: str | None = None) -> None:
        # vLLM's positional order is (lora_name, lora_int_id, lora_path); lmdock's is (name, path)
        if len(args) == 2 and isinstance(args[0], int) and not isinstance(args[0], bool):
            lora_int_id, lora_path = args
        elif len(args) == 1:
            path = args[0] if path is None else path
        elif args:
            raise TypeError("LoRARequest takes (name, path) or vLLM's (lora_name, lora_int_id, lora_path)")
        name = _one("name", name, "lora_name", lora_name)
        path = _one("path", path, "lora_path", lora_path if lora_path is not None else lora_local_path)
        int_id = _one("int_id", int_id, "lora_int_id", lora_int_id)
        if not isinstance(name, str) or not name:
            raise RequestError(f"LoRARequest needs a non-empty name, not {name!r}")
        if path is None:
            raise RequestError(f"LoRARequest {name!r} needs the adapter's path (a PEFT adapter folder)")
        if int_id is not None and (not isinstance(int_id, int) or isinstance(int_id, bool) or int_id < 1):
            raise RequestError(f"LoRARequest {name!r}: lora_int_id must be an integer >= 1 (vLLM's rule), not {int_id!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "path", os.fspath(path))
        object.__setattr__(self, "int_id", int_id)
        object.__setattr__(self, "base_model_name", base_model_name)

    # vLLM's attribute names, read-only
    @property
    def lora_name(self) -> str:
        return self.name

    @property
    def lora_path(self) -> str:
        return self.path

    @property
    def lora_int_id(self) -> int | None:
        return self.int_id

    @property
    def key(self) -> tuple[str, str]:
        """What caches of computed state are keyed by: the adapter's name and folder."""
        return (self.name, self.path)


def _one(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None and value != alias_value:
        raise RequestError(f"LoRARequest: {name}={value!r} and {alias}={alias_value!r} disagree; give one")
    return value if value is not None else alias_value


#: What a call's ``lora_request`` may be: a LoRARequest, the name of an adapter the model's config
#: declares (``[models.NAME.adapters]``), or None; one for all prompts or one per prompt.
LoRAArg = LoRARequest | str | None


def lora_per_prompt(lora_request: LoRAArg | Sequence[LoRAArg], count: int, declared: Mapping[str, str]) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt from a call's ``lora_request``: one for all, or a list with one
    per prompt (vLLM's rule); a name is looked up in ``declared`` (the model's ``adapters``)."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != count:
            raise RequestError(f"got {len(lora_request)} lora_request entries for {count} prompts; give one, or one per prompt")
        items = list(lora_request)
    else:
        items = [lora_request] * count
    return [_as_lora(item, declared) for item in items]


def _as_lora(item: Any, declared: Mapping[str, str]) -> LoRARequest | None:
    """A LoRARequest; vLLM's own ``vllm.lora.request.LoRARequest`` is read by its attributes."""
    if item is None or isinstance(item, LoRARequest):
        return item
    if isinstance(item, str):
        if item not in declared:
            known = listed(sorted(declared))
            raise RequestError(f"lora_request {listed([item], width=200)!r}: the model declares no such adapter (declared: {known}); add it under "
                               "[models.NAME.adapters] or pass LoRARequest(name, path)")
        return LoRARequest(item, declared[item])
    if hasattr(item, "lora_name") and hasattr(item, "lora_path"):
        return LoRARequest(lora_name=item.lora_name, lora_int_id=getattr(item, "lora_int_id", None), lora_path=item.lora_path)
    raise RequestError(f"lora_request must be a lmdock.LoRARequest (or vLLM's), not {type(item).__name__}")


# -- PEFT adapter folders, for backends that run lmdock's own low-rank add ------------------------

#: PEFT adapter_config.json settings lmdock's low-rank add does not implement, and the value that is harmless.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None}


@dataclass(frozen=True)
class LoRAModule:
    """One linear layer a PEFT adapter targets: the model's module path (PEFT's names are the
    transformers modules' names), its ``lora_A`` / ``lora_B`` tensors' keys and shapes in the
    safetensors file, and the update's scale (``lora_alpha / r``, or ``/ sqrt(r)`` with
    ``use_rslora``; ``rank_pattern`` / ``alpha_pattern`` per module)."""

    name: str
    lora_a: str
    lora_b: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    scale: float

    def check(self, lora: LoRARequest, out_features: int, in_features: int, max_rank: int | None) -> None:
        """Raise RequestError unless A is [r, in] and B is [out, r] for the model's layer and r is at
        most ``build.max_lora_rank``."""
        rank = self.a_shape[0] if len(self.a_shape) == 2 else -1
        if self.a_shape != (rank, in_features) or self.b_shape != (out_features, rank):
            raise RequestError(f"lora_request {lora.name!r}: {self.name!r} has lora_A {self.a_shape} and lora_B {self.b_shape}, "
                               f"which do not fit the model's layer ({out_features} x {in_features}): an adapter for another model?")
        limit = DEFAULT_MAX_LORA_RANK if max_rank is None else max_rank
        if rank > limit:
            raise RequestError(f"lora_request {lora.name!r}: rank {rank} exceeds build.max_lora_rank = {limit}"
                               f"{' (the default)' if max_rank is None else ''}; raise it in the model's build table to run this adapter")


def read_lora_adapter(lora: LoRARequest) -> tuple[str, list[LoRAModule]]:
    """The safetensors file of a PEFT adapter folder and the modules it targets, read from
    ``adapter_config.json`` and the file's header (no weights are read); raises RequestError naming
    what is wrong (a missing file, a PEFT setting lmdock does not implement, a tensor that is not a
    linear layer's lora_A / lora_B).  The backend then checks each module against its model
    (``LoRAModule.check``) and loads the tensors with its own framework."""
    folder = Path(lora.path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise RequestError(f"lora_request {lora.name!r}: {f} does not exist; an adapter is a PEFT folder "
                               "(adapter_config.json + adapter_model.safetensors)")
    config, header = _read_files(lora, config_file, weights_file)
    # What the files hold is never echoed to a client: a folder may be a symlink to any file the
    # server can read, so errors name the setting, not its value.
    if config.get("peft_type", "LORA") != "LORA":
        raise RequestError(f"lora_request {lora.name!r}: adapter_config.json's peft_type is not LORA: not a LoRA adapter")
    for key, harmless in _UNSUPPORTED.items():
        if config.get(key, harmless) not in (harmless, [], {}):
            raise RequestError(f"lora_request {lora.name!r}: adapter_config.json sets {key} (other than {harmless!r}), which "
                               "lmdock does not implement; use a plain LoRA adapter")
    r, alpha = _number(config, "r", lora, integer=True), _number(config, "lora_alpha", lora, default=config.get("r"))
    pairs: dict[str, dict[str, str]] = {}
    for key in header:
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise RequestError(f"lora_request {lora.name!r}: tensor {_clip(key)!r} is not a lora_A / lora_B weight; lmdock "
                               "runs LoRA on linear layers only")
        pairs.setdefault(m.group(1), {})[m.group(2)] = key
    if not pairs:
        raise RequestError(f"lora_request {lora.name!r}: {weights_file} holds no lora_A / lora_B weights")
    modules = []
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise RequestError(f"lora_request {lora.name!r}: module {name!r} lacks lora_{'A' if 'A' not in ab else 'B'}")
        r_m = int(_pattern(config, "rank_pattern", name, r, lora))
        alpha_m = float(_pattern(config, "alpha_pattern", name, alpha, lora))
        scale = alpha_m / math.sqrt(r_m) if config.get("use_rslora") else alpha_m / r_m
        modules.append(LoRAModule(name, ab["A"], ab["B"], tuple(header[ab["A"]]["shape"]), tuple(header[ab["B"]]["shape"]), scale))
    return str(weights_file), modules


def _safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's tensor names, dtypes and shapes, without their data (the format's header:
    a little-endian u64 length, then that much JSON)."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > 100_000_000:
            raise ValueError(f"{path} is not a safetensors file")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _read_files(lora: LoRARequest, config_file: Path, weights_file: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """adapter_config.json (an object) and the safetensors header; a RequestError naming the file, not its content."""
    try:
        if config_file.stat().st_size > _MAX_CONFIG_BYTES:
            raise ValueError(f"{config_file.name} is over {_MAX_CONFIG_BYTES} bytes")
        config = json.loads(config_file.read_bytes())
        header = _safetensors_header(weights_file)
    except (OSError, ValueError) as exc:  # a decoding error quotes positions, not the text; OSError its path
        what = exc if isinstance(exc, OSError) else type(exc).__name__
        raise RequestError(f"lora_request {lora.name!r}: cannot read the adapter ({what}): adapter_config.json must be "
                           "a JSON object and adapter_model.safetensors a safetensors file") from None
    if not isinstance(config, dict) or not isinstance(header, dict):
        raise RequestError(f"lora_request {lora.name!r}: adapter_config.json must be a JSON object (PEFT's LoraConfig)")
    return config, header


#: adapter_config.json is a few hundred bytes; a larger file is not one.
_MAX_CONFIG_BYTES = 1_048_576


def _number(config: dict[str, Any], key: str, lora: LoRARequest, *, integer: bool = False, default: Any = None) -> float:
    """A positive number from adapter_config.json (``r`` an integer), or a RequestError naming the key."""
    value = config.get(key, default)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not 0 < value < float("inf"):
        raise RequestError(f"lora_request {lora.name!r}: adapter_config.json's {key} must be a positive "
                           f"{'integer' if integer else 'number'}")
    return value  # type: ignore[no-any-return]


def _clip(text: str, most: int = 100) -> str:
    return text if len(text) <= most else text[:most] + "..."


#: What a ``rank_pattern`` / ``alpha_pattern`` key may hold: a module name or the dotted end of one,
#: optionally anchored with ``^`` at the name's start; ``\.`` is taken as a dot.
_PATTERN_KEY = re.compile(r"\^?(?:[A-Za-z0-9_]|\\?\.)+")


def _pattern(config: dict[str, Any], field: str, name: str, default: Any, lora: LoRARequest) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: the first key that matches the module name's end
    (PEFT matches the regex ``(.*[.])?(KEY)$``, so ``^KEY`` is the whole name).  Keys are matched as names, never run
    as regular expressions: an adapter's key such as ``(a+)+X`` would backtrack for minutes.  A key
    that is not a name (a regex) is refused naming the field; its value must be a positive number."""
    patterns = config.get(field) or {}
    if not isinstance(patterns, dict):
        raise RequestError(f"lora_request {lora.name!r}: adapter_config.json's {field} must be an object")
    for key, value in patterns.items():
        if not _PATTERN_KEY.fullmatch(key):
            raise RequestError(f"lora_request {lora.name!r}: adapter_config.json's {field} has a key that is not a module "
                               "name (lmdock matches module names and their dotted ends, not regular expressions): "
                               "write the module names")
        literal = key.replace("\\.", ".")
        if literal.startswith("^") and name == literal[1:] or name == literal or name.endswith("." + literal):
            return _number({field: value}, field, lora, integer=field == "rank_pattern")
    return default
