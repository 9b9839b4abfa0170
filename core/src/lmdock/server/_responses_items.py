"""The Responses API's request in chat terms: ``input`` items become chat messages, its flat function
tools and ``tool_choice`` chat's nested ones, ``text.format`` chat's ``response_format``.

A ``custom`` tool (free-form: its call's input is any text, such as Codex's ``apply_patch``) is a
chat function taking one string, ``{"input": "..."}``.  Its ``format``: a regex grammar becomes that
string's JSON-schema ``pattern``, which the tool grammar enforces wherever calls are constrained; a
Lark grammar cannot be held inside a JSON string, so it is only shown to the model (in the
parameter's description) and not enforced.

Input items are read loosely typed (they come in many shapes, most of which a text server cannot
honour), each kind with its known keys: anything else is a 400 naming the item and what to send.
"""

from __future__ import annotations

import json
from typing import Any

from lmdock.server._advisory import Ignored, hosted
from lmdock.server._chat_bridge import kind_field, refuse_keys, string_field
from lmdock.server._errors import APIError
from lmdock.server._responses_output import read_reasoning_token

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status", "namespace"})
_CUSTOM_CALL_KEYS = frozenset({"type", "call_id", "name", "input", "id", "status"})
_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
_CUSTOM_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status", "name"})
_REASONING_KEYS = frozenset({"type", "id", "summary", "content", "encrypted_content", "status"})
_TEXT_PARTS = {"input_text": frozenset({"type", "text"}), "output_text": frozenset({"type", "text", "annotations", "logprobs"}),
               "refusal": frozenset({"type", "refusal"}), "reasoning_text": frozenset({"type", "text"}),
               "summary_text": frozenset({"type", "text"})}
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
_IMAGE_KEYS = frozenset({"type", "image_url", "file_id", "detail"})
_CUSTOM_TOOL_KEYS = frozenset({"type", "name", "description", "format"})
_NAMESPACE_KEYS = frozenset({"type", "name", "description", "tools"})
#: a namespaced function's keys about how the hosted API calls it (deferred loading, async calls,
#: callers, its output's schema): advisory to a server whose client makes every call itself
_NAMESPACE_EXTRAS = frozenset({"allowed_callers", "async", "defer_loading", "output_schema"})


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; items are read in order, and
    ``function_call`` items join the assistant message before them (one assistant turn with its calls),
    as does an assistant message after a ``reasoning`` item (whose text is the turn's ``reasoning_content``,
    which the template shows or leaves out, as it does in chat)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} is a {type(item).__name__}; an input item is an object", param=where)
        kind = kind_field(item, "type", where) or "message"
        if kind == "message":
            message = _message(item, where)
            if message["role"] == "assistant" and out and out[-1].get("reasoning_content") is not None and not out[-1]["content"]:
                out[-1]["content"] = message["content"]
            else:
                out.append(message)
        elif kind == "reasoning":
            out.append({"role": "assistant", "content": "", "reasoning_content": _reasoning(item, where)})
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(out, item, where)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            refuse_keys(item, _OUTPUT_KEYS if kind == "function_call_output" else _CUSTOM_OUTPUT_KEYS, where)
            out.append({"role": "tool", "tool_call_id": string_field(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise APIError(400, f"{where} is a {kind!r} item; lmdock serve takes message, reasoning, function_call, "
                                "function_call_output, custom_tool_call and custom_tool_call_output items", param=f"{where}.type")
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    refuse_keys(item, _MESSAGE_KEYS, where)
    role = _ROLES.get(kind_field(item, "role", where) or "")
    if role is None:
        raise APIError(400, f"{where}.role is {item.get('role')!r}; one of {', '.join(_ROLES)}", param=f"{where}.role")
    return {"role": role, "content": _content(item.get("content"), f"{where}.content")}


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: its text (:func:`_text`), or, where it holds ``input_image`` parts, chat's
    list of text and image parts in order (lmdock._llm.multimodal reads the images; docs/vision.md)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            refuse_keys(part, _IMAGE_KEYS, f"{where}.{j}")
            parts.append(part)
        else:
            parts.append({"type": "text", "text": _text([part], where)})
    return parts


def _reasoning(item: dict[str, Any], where: str) -> str:
    refuse_keys(item, _REASONING_KEYS, where)
    token = item.get("encrypted_content")
    if token is not None:
        text = read_reasoning_token(token) if isinstance(token, str) else None
        if text is None:
            raise APIError(400, f"{where}.encrypted_content is not a reasoning token from lmdock serve: lmdock cannot "
                                "read another server's encrypted reasoning; leave the item out", param=f"{where}.encrypted_content")
        return text
    if item.get("content"):
        return _text(item["content"], f"{where}.content")
    return _text(item.get("summary") or [], f"{where}.summary")


def _add_call(out: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A function or custom tool call as chat's call (a custom one's input as ``{"input": ...}`` arguments)."""
    if item.get("type") == "custom_tool_call":
        refuse_keys(item, _CUSTOM_CALL_KEYS, where)
        arguments = json.dumps({"input": string_field(item, "input", where)})
    else:
        refuse_keys(item, _CALL_KEYS, where)
        arguments = string_field(item, "arguments", where)
    name = string_field(item, "name", where)
    if item.get("namespace") is not None:  # a namespaced tool's call, by its flat name (see chat_tools)
        name = flat_name(string_field(item, "namespace", where), name)
    call = {"id": string_field(item, "call_id", where), "type": "function",
            "function": {"name": name, "arguments": arguments}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:  # "" rather than None: templates that trim or join content do not all take None
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _text(content: Any, where: str) -> str:
    """A message's (or a call output's) content as text: a string, or text parts joined with newlines
    (as vLLM joins chat's text parts); any other part (an image, a file, audio) is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = kind_field(part, "type", f"{where}.{j}") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS:
            raise APIError(400, f"{where}.{j} is a {kind!r} part; the model would not see it: "
                                "send input_text (or input_image) parts only", param=f"{where}.{j}.type")
        refuse_keys(part, _TEXT_PARTS[kind], f"{where}.{j}")
        texts.append(string_field(part, "refusal" if kind == "refusal" else "text", f"{where}.{j}"))
    return "\n".join(texts)


def chat_tools(tools: list[dict[str, Any]], ignored: Ignored) -> list[dict[str, Any]]:
    """Responses' flat function tools (``{type, name, parameters}``) as chat's (``{type, function: {...}}``);
    a custom tool as a function taking one string, ``input``; a namespace's tools flattened, each named
    ``NAMESPACE__NAME``; a hosted tool no plugin provides dropped and named in ``ignored``."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        kind = kind_field(tool, "type", where)
        why = hosted("responses", kind)
        if why is not None:
            ignored.add(f"tools[{i}] ({kind}: {why})")
        elif kind == "namespace":
            out += _namespace(tool, where)
        else:
            out.append(_tool(tool, where))
    return out


def _tool(tool: dict[str, Any], where: str, namespace: str | None = None) -> dict[str, Any]:
    kind = kind_field(tool, "type", where)
    if kind == "custom":
        made = _custom_tool(tool, where)
    elif kind == "function":
        refuse_keys(tool, _TOOL_KEYS, where)
        made = {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                                 if tool.get(k) is not None}}
    else:
        raise APIError(400, f"{where} is a {tool.get('type')!r} tool; lmdock serve runs function, custom and namespace tools "
                            "(the client runs them and sends back function_call_output), and drops hosted ones it has no "
                            "backend for (web_search, file_search, ...)", param=f"{where}.type")
    if namespace is not None:
        made["function"]["name"] = flat_name(namespace, string_field(tool, "name", where))
    return made


def _namespace(tool: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A namespace's function and custom tools, flat; the namespace's description leads each one's."""
    refuse_keys(tool, _NAMESPACE_KEYS, where)
    name = string_field(tool, "name", where)
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise APIError(400, f"{where}.tools must be a list of function or custom tools", param=f"{where}.tools")
    out = []
    for j, t in enumerate(inner):
        if not isinstance(t, dict):
            raise APIError(400, f"{where}.tools.{j} must be an object", param=f"{where}.tools.{j}")
        t = {k: v for k, v in t.items() if k not in _NAMESPACE_EXTRAS}
        made = _tool(t, f"{where}.tools.{j}", name)
        if tool.get("description"):
            made["function"]["description"] = f"{tool['description']}\n{made['function'].get('description', '')}".strip()
        out.append(made)
    return out


def flat_name(namespace: str, name: str) -> str:
    """A namespaced tool's name as a function tool's (function names hold no dots)."""
    return f"{namespace}__{name}"


def namespaced(tools: list[dict[str, Any]] | None) -> dict[str, tuple[str, str]]:
    """The namespaced tools' flat names -> (namespace, name), to name their calls as the client knows them."""
    out = {}
    for tool in tools or ():
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for t in tool["tools"]:
                if isinstance(t, dict) and isinstance(t.get("name"), str):
                    out[flat_name(tool["name"], t["name"])] = (tool["name"], t["name"])
    return out


def custom_names(tools: list[dict[str, Any]] | None) -> frozenset[str]:
    """The names of the custom tools among ``tools`` (their calls are ``custom_tool_call`` items),
    namespaced ones by their flat names."""
    names = {t.get("name") for t in tools or () if isinstance(t, dict) and t.get("type") == "custom" and isinstance(t.get("name"), str)}
    for tool in tools or ():
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list) \
                and isinstance(tool.get("name"), str):
            names |= {flat_name(tool["name"], t["name"]) for t in tool["tools"]
                      if isinstance(t, dict) and t.get("type") == "custom" and isinstance(t.get("name"), str)}
    return frozenset(names)  # type: ignore[arg-type]


def _custom_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    refuse_keys(tool, _CUSTOM_TOOL_KEYS, where)
    fmt = tool.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise APIError(400, f"{where}.format must be an object, {{type: text}} or {{type: grammar, syntax, definition}}",
                       param=f"{where}.format")
    if fmt.get("type") == "grammar":
        refuse_keys(fmt, frozenset({"type", "syntax", "definition"}), f"{where}.format")
        if fmt.get("syntax") not in ("lark", "regex") or not isinstance(fmt.get("definition"), str):
            raise APIError(400, f"{where}.format: a grammar format has syntax lark or regex and a definition string",
                           param=f"{where}.format")
    elif fmt.get("type") == "text":
        refuse_keys(fmt, frozenset({"type"}), f"{where}.format")
    else:
        raise APIError(400, f"{where}.format.type {fmt.get('type')!r}: one of text, grammar", param=f"{where}.format.type")
    value: dict[str, Any] = {"type": "string", "description": "the tool's input, free-form text"}
    if fmt.get("syntax") == "regex":
        value["pattern"] = f"^(?:{fmt['definition']})$"  # the whole input matches (a schema's pattern is a search)
    elif fmt.get("syntax") == "lark":
        value["description"] += f" in this Lark grammar:\n{fmt['definition']}"
    function = {"name": string_field(tool, "name", where),
                "parameters": {"type": "object", "properties": {"input": value}, "required": ["input"], "additionalProperties": False}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """``tool_choice``: ``none``, ``auto``, ``required`` as they are; ``{type: function | custom, name}`` as chat's."""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice {choice!r}: one of none, auto, required, or {{type: function, name}}", param="tool_choice")
        return choice
    refuse_keys(choice, frozenset({"type", "name"}), "tool_choice")
    if choice.get("type") not in ("function", "custom") or not isinstance(choice.get("name"), str):
        raise APIError(400, "tool_choice: lmdock serve takes none, auto, required, or {type: function | custom, name}",
                       param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None for plain text)."""
    kind = fmt.get("type")
    if kind == "text":
        refuse_keys(fmt, frozenset({"type"}), "text.format")
        return None
    if kind == "json_object":
        refuse_keys(fmt, frozenset({"type"}), "text.format")
        return {"type": "json_object"}
    if kind == "json_schema":
        refuse_keys(fmt, frozenset({"type", "name", "schema", "description", "strict"}), "text.format")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}}
    raise APIError(400, f"text.format.type {kind!r}: one of text, json_object, json_schema", param="text.format.type")
