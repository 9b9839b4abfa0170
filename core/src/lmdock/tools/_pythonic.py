"""Pythonic calls, ``[f(a=1, b="x"), g()]``: read with :mod:`ast`, literals only (nothing is
evaluated).  A call goes out once it closes: a Python literal is not JSON, so its arguments cannot
stream as they are written."""

from __future__ import annotations

import ast
import json
from typing import Any

from lmdock.tools._base import PartialCall, Scan

#: JSON's literals, which a constrained model writes (the grammar takes argument values as JSON)
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def pythonic_scan(text: str, final: bool, memo: dict[str, Any] | None = None) -> Scan:
    """``text`` as a list of calls; ``memo`` (a stream's) keeps what earlier, shorter texts showed."""
    body = text.strip()
    if not body.startswith("["):
        return Scan(text if final or body else "", [])
    try:
        calls = _calls(ast.parse(body, mode="eval").body)
    except (SyntaxError, ValueError) as exc:
        if final:
            return Scan(text, [], f"not a list of calls: {exc}")
        return Scan("", _closed_prefix(body, memo if memo is not None else {}))
    return Scan("", calls)


def _closed_prefix(body: str, memo: dict[str, Any]) -> list[PartialCall]:
    """The calls of an unfinished list that are already closed (``[f(a=1), g(`` has one).  Each
    ``)`` is tried once: what a prefix holds does not change as the text grows."""
    if not body.startswith(memo.get("body", "")):
        memo.clear()
    found, i = memo.get("found", []), memo.get("pos", 0)
    while (i := body.find(")", i)) >= 0:
        try:
            found = _calls(ast.parse(body[:i + 1] + "]", mode="eval").body)
        except (SyntaxError, ValueError):
            pass
        i += 1
    memo.update(body=body, found=found, pos=len(body))
    return found


def _calls(node: ast.expr) -> list[PartialCall]:
    if not isinstance(node, ast.List) or not node.elts:
        raise ValueError("expected a list of calls")
    out = []
    for call in node.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            raise ValueError("each item must be name(keyword=value, ...)")
        args = {kw.arg: _value(kw.value) for kw in call.keywords if kw.arg is not None}
        out.append(PartialCall(call.func.id, json.dumps(args, ensure_ascii=False), complete=True))
    return out


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.List):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)
