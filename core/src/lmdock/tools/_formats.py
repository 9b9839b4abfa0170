"""The built-in tool-call formats: Hermes/Qwen ``<tool_call>`` JSON, Llama 3 JSON, Mistral
``[TOOL_CALLS]`` and pythonic ``[f(a=1)]`` (vLLM's ``hermes``, ``llama3_json``, ``mistral`` and
``pythonic`` parsers read the same outputs)."""

from __future__ import annotations

import json
import re
from typing import Any

from lmdock.tools._base import PartialCall, Scan, ToolParser, held_back
from lmdock.tools._jsoncall import arguments_schema, calls_schema, json_call
from lmdock.tools._pythonic import pythonic_scan


def lark_regex(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` regex."""
    return re.escape(text).replace("/", "\\/")


def up_to(marker: str, opening: str = "") -> str:
    """A Lark regex for any text (after ``opening``) that ends at the first ``marker``, included.

    One lexeme, never text then a separate marker: llguidance's lexer does not split a greedy lexeme
    back, so "text without the marker" followed by the marker's literal could never write the marker."""
    o, m = lark_regex(opening), lark_regex(marker)
    return f"/{o}(.|\\n)*{m}/ & ~/{o}(.|\\n)*{m}(.|\\n)+/"


def opened_by(marker: str, after: str, lazy: bool) -> str:
    """``start`` for ``marker`` then ``after`` (calls only), or (``lazy``) for plain text without the
    marker, or any text up to the marker and then ``after`` (llama.cpp's lazy grammars)."""
    if not lazy:
        return f"start: {json.dumps(marker)} {after}\n"
    m = lark_regex(marker)
    return (f"start: PLAIN | UPTO_MARKER {after}\n"
            f"PLAIN: /(.|\\n)*/ & ~/(.|\\n)*{m}(.|\\n)*/\n"
            f"UPTO_MARKER: {up_to(marker)}\n")


class HermesParser(ToolParser):
    """``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call, text
    before (Hermes 2 Pro and 3, Qwen 2.5, Qwen 3, QwQ)."""

    name = "hermes"
    marker = "<tool_call>"
    template_hints = ("<tool_call>",)
    close = "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.marker)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, self.marker)
            return Scan(text[:keep], [])
        calls: list[PartialCall] = []
        error = None
        content, pos = text[:first], first
        while pos >= 0:
            body = _skip_ws(text, pos + len(self.marker))
            if body >= len(text):
                calls.append(PartialCall())
                break
            if text[body] != "{":
                error = f"a {self.marker} block must hold a JSON object"
                break
            call, end, why = json_call(text, body, memo=self.memo)
            calls.append(call)
            if end is None:
                break
            error = error or why
            pos, after = self._next(text, end)
            content += self._between(text, after, pos, final)  # text outside the blocks stays content
        if final:
            calls, error = _closed_calls(calls, error)
            if error is not None:
                return Scan(text, calls, error)
        return Scan(content, calls, error)

    def _next(self, text: str, end: int) -> tuple[int, int]:
        """After a call's JSON ending at ``end``: where the next block opens (-1: none yet) and where
        the text between starts (past ``</tool_call>``; the end of the text while it is unclosed)."""
        close = text.find(self.close, end)
        after = close + len(self.close) if close >= 0 else len(text)
        return text.find(self.marker, after), after

    def _between(self, text: str, start: int, stop: int, final: bool) -> str:
        """The content between two blocks, or after the last (held back where a marker may be starting)."""
        if stop >= 0:
            return text[start:stop]
        return text[start:] if final else text[start:len(text) - held_back(text[start:], self.marker)]

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, lazy: bool) -> str | None:
        more = ' ("\\n" call)*' if parallel else ""
        return (opened_by(self.marker, f'"\\n" body "\\n</tool_call>"{more}', lazy)
                + 'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
                + f"body: %json {json.dumps(calls_schema(tools))}\n")


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3's JSON calls: the whole output is ``{"name": "f", "parameters": {...}}``
    (optionally after ``<|python_tag|>``), several separated by ``;``."""

    name = "llama3_json"
    marker = "<|python_tag|>"
    template_hints = ("<|python_tag|>", '"parameters": ')

    def scan(self, text: str, final: bool) -> Scan:
        start = _skip_ws(text, 0)
        if text.startswith(self.marker, start):
            start = _skip_ws(text, start + len(self.marker))
        elif not final and self.marker.startswith(text[start:]) and text[start:]:
            return Scan("", [])
        if start >= len(text):
            return Scan(text if final else "", [])
        if text[start] != "{":
            return Scan(text, [])
        return _json_list(text, start, ";", ("parameters", "arguments"), final, memo=self.memo)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, lazy: bool) -> str | None:
        calls = 'call ("; " call)*' if parallel else "call"
        plain = "PLAIN | " if lazy else ""  # a call is the whole reply: text is what does not open with "{"
        return (f"start: {plain}{calls}\nPLAIN: /[^{{](.|\\n)*/\n"
                f"call: %json {json.dumps(calls_schema(tools, 'parameters'))}\n")


class MistralParser(ToolParser):
    """Mistral's ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (text may come before)."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    template_hints = ("[TOOL_CALLS]",)

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.marker)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, self.marker)
            return Scan(text[:keep], [])
        start = _skip_ws(text, first + len(self.marker))
        if start >= len(text):
            return Scan(text if final else text[:first], [PartialCall()] if not final else [], "no calls" if final else None)
        if text[start] != "[":
            return Scan(text, [], "[TOOL_CALLS] must be followed by a JSON list")
        scan = _json_list(text, _skip_ws(text, start + 1), ",", ("arguments",), final, closer="]", memo=self.memo)
        return Scan(text[:first] + scan.content if scan.error is None or not final else text, scan.calls, scan.error)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, lazy: bool) -> str | None:
        calls = 'call (", " call)*' if parallel else "call"
        return opened_by(self.marker, f'"[" {calls} "]"', lazy) + f"call: %json {json.dumps(calls_schema(tools))}\n"


class PythonicParser(ToolParser):
    """Llama 3.2 / 4's pythonic calls: the whole output is ``[f(a=1, b="x"), g()]``."""

    name = "pythonic"
    template_hints = ("[func_name1(params_name1=params_value1",)

    def scan(self, text: str, final: bool) -> Scan:
        return pythonic_scan(text, final, self.memo)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, lazy: bool) -> str | None:
        alts = []
        for i, t in enumerate(tools):
            fn = t.get("function", {})
            params, defs = arguments_schema(fn.get("parameters") or {})
            props, required = params.get("properties", {}), set(params.get("required", []))
            if not re.fullmatch(r"[A-Za-z_]\w*", fn["name"]) or set(props) - required:
                return None  # optional arguments would need every subset's order: parse only
            args = ' ", " '.join(f'"{k}=" v{i}_{j}' for j, k in enumerate(props))
            alts.append(f'c{i}: "{fn["name"]}(" {args} ")"\n'
                        + "".join(f"v{i}_{j}: %json {json.dumps({**s, '$defs': defs} if defs else s)}\n" for j, s in enumerate(props.values())))
        names = " | ".join(f"c{i}" for i in range(len(tools)))
        calls = 'call (", " call)*' if parallel else "call"
        plain = "PLAIN | " if lazy else ""  # the calls are the whole reply: text is what does not open with "["
        return f'start: {plain}"[" {calls} "]"\nPLAIN: /[^\\[](.|\\n)*/\ncall: {names}\n' + "".join(alts)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _json_list(text: str, pos: int, sep: str, args_keys: tuple[str, ...], final: bool, closer: str = "",
               memo: dict[int, Any] | None = None) -> Scan:
    """Calls written as JSON objects one after another, ``sep`` between, ``closer`` after the last."""
    calls: list[PartialCall] = []
    error = None
    while pos < len(text):
        if text[pos] != "{":
            if closer and text[pos] == closer and calls:
                tail = text[pos + 1:]  # text after the list stays content
                return Scan(tail if final else tail[:len(tail) - held_back(tail, "[TOOL_CALLS]")], calls, error)
            error = f"expected a JSON object at character {pos}"
            break
        call, end, why = json_call(text, pos, args_keys, memo)
        calls.append(call)
        if end is None:
            break
        error = error or why
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == sep:
            pos = _skip_ws(text, pos + 1)
    if final:
        calls, error = _closed_calls(calls, error)
        if error is not None:
            return Scan(text, calls, error)
    return Scan("", calls, error)


def _closed_calls(calls: list[PartialCall], error: str | None) -> tuple[list[PartialCall], str | None]:
    """The calls of a finished text: a last call left open (cut by max_tokens) is dropped, as the
    finish reason ``length`` says; with no call closed the text is not calls."""
    closed = [c for c in calls if c.complete]
    if error is None and not closed:
        error = "no call is closed"
    return closed, error
