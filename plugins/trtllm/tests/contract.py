"""Checks produced keyword arguments against the recorded TensorRT-LLM API facts
(``../shared/api-contracts/tensorrt_llm_api.json``, reached through ``LMDOCK_API_CONTRACTS``)."""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

from lmdock_trtllm._refs import ConfigRef, EnumRef, TensorRef


@cache
def contract() -> dict[str, Any]:
    folder = os.environ.get("LMDOCK_API_CONTRACTS")
    if not folder or not (Path(folder) / "tensorrt_llm_api.json").is_file():
        raise RuntimeError("set LMDOCK_API_CONTRACTS to the folder holding tensorrt_llm_api.json (../shared/api-contracts)")
    return json.loads((Path(folder) / "tensorrt_llm_api.json").read_text())


def fields(cls: str, api: str = "current") -> dict[str, dict[str, Any]]:
    """The keyword arguments a class accepts, by name, with their recorded types."""
    classes = contract()["classes"]
    if cls == "LLM":
        out = {f["name"]: f for f in classes["TorchLlmArgs"]["fields"]}
        out.update({f["name"]: f for f in classes["LLM"]["init"]})
        if api == "legacy":
            out.update({f["name"]: f for f in classes["TrtLlmArgs_legacy"]["fields_only_in_trt"]})
        return out
    return {f["name"]: f for f in classes[cls]["fields"]}


def enum_members(enum: str) -> list[str]:
    value = contract()["enums"][enum]
    if isinstance(value, dict):
        return list(value.get("members") or value.keys())
    return list(value)


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        depth += ch in "[("
        depth -= ch in "])"
        cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


_SIMPLE = {
    "int": int, "float": float, "bool": bool, "str": str, "Path": str, "dict": dict,
    "NonNegativeInt": int, "PositiveInt": int, "NonNegativeFloat": float, "PositiveFloat": float,
}


def type_ok(value: Any, type_str: str) -> bool:
    """Does ``value`` fit the recorded type string (Optional, Union, List, Literal, enums, classes)?"""
    t = type_str.strip()
    m = re.fullmatch(r"(\w+)\[(.*)\]", t)
    if m:
        head, inner = m.group(1), m.group(2)
        args = _split_top(inner)
        if head == "Optional":
            return value is None or type_ok(value, inner)
        if head == "Union":
            return any(type_ok(value, a) for a in args)
        if head == "List":
            return isinstance(value, list) and all(type_ok(v, args[0]) for v in value)
        if head == "Literal":
            return any(value == eval(a) for a in args)  # noqa: S307 - literals recorded in the contract
        if head in ("Dict", "dict"):
            return isinstance(value, dict)
        return False
    if t in _SIMPLE:
        kind = _SIMPLE[t]
        if kind is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is int:
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, kind)
    if isinstance(value, EnumRef):
        return value.enum == t and value.member in enum_members(t)
    if isinstance(value, ConfigRef):
        return value.cls == t
    if t == "torch.Tensor":
        return isinstance(value, TensorRef)
    return False


def check_kwargs(cls: str, kwargs: dict[str, Any], api: str = "current") -> None:
    """Raise AssertionError for any name or value TensorRT-LLM would reject."""
    known = fields(cls, api)
    for name, value in kwargs.items():
        assert name in known, f"{cls} has no argument {name!r} (TensorRT-LLM rejects unknown keyword arguments)"
        field = known[name]
        assert field.get("status") != "removed", f"{cls}.{name} was removed"
        assert type_ok(value, field["type"]), f"{cls}.{name}={value!r} does not fit {field['type']}"
        if isinstance(value, ConfigRef):
            check_kwargs(value.cls, value.kwargs, api)
        if api == "current" and cls == "LLM":
            assert "tensorrt" not in (field.get("backends") or ["pytorch"]) or "pytorch" in (field.get("backends") or []), f"LLM.{name} exists only on the TensorRT backend"
