"""Anthropic's Messages request in chat terms: ``system`` and the messages' content blocks become chat
messages (``tool_use`` blocks an assistant's ``tool_calls``, ``tool_result`` blocks ``tool``
messages), its tools (``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``)
chat's.

``system`` is taken as the field Anthropic defines and, leniently, as a role inside ``messages``
(Claude Code sends it there; vLLM #44000 and Ollama #16372 refused it with a 400).  ``cache_control``
on a block or tool is advisory (``lmdock.server._advisory``): it asks to cache a prefix, which
lmdock's prefix cache does unasked.
"""

from __future__ import annotations

import json
from typing import Any

from lmdock.server._advisory import Ignored, hosted
from lmdock.server._chat_bridge import kind_field, refuse_keys, string_field
from lmdock.server._errors import APIError

_BLOCK_KEYS = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "thinking": frozenset({"type", "thinking", "signature", "cache_control"}),
    "image": frozenset({"type", "source", "cache_control"}),  # read by lmdock._llm.multimodal (docs/vision.md)
}
_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control"})


def chat_messages(system: str | list[Any] | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages, in order."""
    out = [{"role": "system", "content": text(system, "system")}] if system else []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        refuse_keys(message, frozenset({"role", "content"}), where)
        role, content = message.get("role"), message.get("content")
        if role == "system":
            out.append({"role": "system", "content": text(content, f"{where}.content")})
        elif role == "user":
            out += _user(content, f"{where}.content")
        elif role == "assistant":
            out.append(_assistant(content, f"{where}.content"))
        else:
            raise APIError(400, f"{where}.role is {role!r}; one of user, assistant (or system)", param=f"{where}.role")
    return out


def _blocks(content: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """``content`` as ``(where, block)`` pairs, each block a known kind with known keys."""
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", param=where)
    out = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = kind_field(block, "type", at) if isinstance(block, dict) else type(block).__name__
        if kind not in _BLOCK_KEYS:
            raise APIError(400, f"{at} is a {kind!r} block; lmdock reads text, image, thinking, tool_use "
                                "and tool_result blocks", param=f"{at}.type")
        refuse_keys(block, _BLOCK_KEYS[kind], at)
        out.append((at, block))
    return out


def text(content: Any, where: str) -> str:
    """Text blocks (or a string) as one text, joined with newlines."""
    parts = []
    for at, block in _blocks(content, where):
        if block["type"] != "text":
            raise APIError(400, f"{at} is a {block['type']!r} block; only text blocks belong here", param=f"{at}.type")
        parts.append(string_field(block, "text", at))
    return "\n".join(parts)


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its text as user messages, its ``tool_result`` blocks as ``tool`` messages, in order."""
    out: list[dict[str, Any]] = []
    for at, block in _blocks(content, where):
        if block["type"] == "tool_result":
            result = text(block.get("content") or "", f"{at}.content")
            # chat's tool message has no error flag: the model reads it in the text
            out.append({"role": "tool", "tool_call_id": string_field(block, "tool_use_id", at),
                        "content": f"Error: {result}" if block.get("is_error") else result})
        elif block["type"] == "text":
            _add_user(out, {"type": "text", "text": string_field(block, "text", at)})
        elif block["type"] == "image":
            _add_user(out, {"type": "image", "source": block.get("source")})
        else:
            raise APIError(400, f"{at} is a {block['type']} block in a user message; it belongs to the assistant",
                           param=f"{at}.type")
    return out


def _add_user(out: list[dict[str, Any]], part: dict[str, Any]) -> None:
    """A text or image block into the user message it continues: text alone stays a string (texts
    joined with newlines); with an image the content is a list of parts, as chat's."""
    if not out or out[-1]["role"] != "user":
        out.append({"role": "user", "content": part["text"] if part["type"] == "text" else [part]})
        return
    last = out[-1]
    if isinstance(last["content"], str) and part["type"] == "text":
        last["content"] += "\n" + part["text"]
        return
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": last["content"]}]
    last["content"].append(part)


def _assistant(content: Any, where: str) -> dict[str, Any]:
    """An assistant turn: its text, its ``tool_use`` blocks as ``tool_calls`` and its ``thinking`` as
    ``reasoning_content`` (which the template shows or leaves out, as it does in chat)."""
    texts, calls, thoughts = [], [], []
    for at, block in _blocks(content, where):
        if block["type"] == "text":
            texts.append(string_field(block, "text", at))
        elif block["type"] == "thinking":
            thoughts.append(string_field(block, "thinking", at))
        elif block["type"] == "tool_use":
            if not isinstance(block.get("input"), dict):
                raise APIError(400, f"{at}.input must be an object", param=f"{at}.input")
            calls.append({"id": string_field(block, "id", at), "type": "function",
                          "function": {"name": string_field(block, "name", at), "arguments": json.dumps(block["input"])}})
        else:
            raise APIError(400, f"{at} is a tool_result block in an assistant message; tool results come from the user",
                           param=f"{at}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def chat_tools(tools: list[dict[str, Any]], ignored: Ignored) -> list[dict[str, Any]]:
    """Anthropic's client tools (``name``, ``description``, ``input_schema``) as chat's function tools;
    its server tools (web search, fetch, code execution), which no plugin provides, dropped and named
    in ``ignored``."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        why = hosted("messages", tool.get("type"))
        if why is not None:
            ignored.add(f"tools[{i}] ({tool['type']}: {why})")
            continue
        if tool.get("type") not in (None, "custom"):
            raise APIError(400, f"{where} is a {tool['type']!r} tool; lmdock serve runs client tools only "
                                "(name, description, input_schema)", param=f"{where}.type")
        refuse_keys(tool, _TOOL_KEYS, where)
        function = {"name": string_field(tool, "name", where), "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool | None]:
    """``tool_choice`` as chat's ``tool_choice`` and ``parallel_tool_calls``: ``auto``, ``any``
    (required), ``tool`` (that one), ``none``; ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``."""
    kind = kind_field(choice, "type", "tool_choice")
    known = {"auto": {"type", "disable_parallel_tool_use"}, "any": {"type", "disable_parallel_tool_use"},
             "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
    if kind not in known:
        raise APIError(400, f"tool_choice.type {kind!r}: one of auto, any, tool, none", param="tool_choice.type")
    refuse_keys(choice, frozenset(known[kind]), "tool_choice")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if kind == "tool":
        return {"type": "function", "function": {"name": string_field(choice, "name", "tool_choice")}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def has_cache_control(system: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether a system block, a message's content block or a tool carries ``cache_control``."""
    blocks = [*(system if isinstance(system, list) else ()), *(tools or ())]
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        blocks += content if isinstance(content, list) else ()
    return any(isinstance(b, dict) and b.get("cache_control") is not None for b in blocks)
