"""LoRA adapters as a request names them: ``LoRARequest`` (vLLM's shape, PEFT adapter folders).

An adapter is a folder in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``).
A request runs under at most one adapter; requests under different adapters (and the base model) may
share one engine step.  What the adapter changes is the model itself, so whatever was computed under
one adapter (a cached prompt prefix, a forked KV state) is never reused under another: ``key`` is
what caches are keyed by.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmdock._errors import RequestError

#: A name an adapter may be served under (``MODEL:ADAPTER``): letters, digits, '.', '_' and '-'.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]+")


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
            known = ", ".join(sorted(declared)) or "none"
            raise RequestError(f"lora_request {item!r}: the model declares no such adapter (declared: {known}); add it under "
                               "[models.NAME.adapters] or pass LoRARequest(name, path)")
        return LoRARequest(item, declared[item])
    if hasattr(item, "lora_name") and hasattr(item, "lora_path"):
        return LoRARequest(lora_name=item.lora_name, lora_int_id=getattr(item, "lora_int_id", None), lora_path=item.lora_path)
    raise RequestError(f"lora_request must be a lmdock.LoRARequest (or vLLM's), not {type(item).__name__}")
