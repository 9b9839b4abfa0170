"""The Responses API's output: chat's assistant message as output items (``reasoning`` with
``reasoning_text``, ``message`` with ``output_text``, one ``function_call`` per call, or
``custom_tool_call`` for a custom tool's), whole, or from chat's chunks as OpenAI's streamed events.

How a response's items look beyond that is an :class:`Outputs`: which tools are custom (chat calls
them with ``{"input": ...}`` arguments), whether a reasoning item carries its text as the
``summary`` too (``reasoning.summary``) and as ``encrypted_content`` (``include:
["reasoning.encrypted_content"]``): that is no encryption, only an opaque lmdock token,
:func:`reasoning_token`, which a later request may send back (:func:`read_reasoning_token`).

Streamed, each item opens with ``response.output_item.added`` and closes with
``response.output_item.done``; between them a text item has its one content part
(``response.content_part.added`` / ``.done``) and its ``.delta`` events and ``.done``
(``response.output_text.*`` or ``response.reasoning_text.*``; a reasoning item with a summary its
``response.reasoning_summary_part.*`` and ``response.reasoning_summary_text.*`` too), a call its
``response.function_call_arguments.delta`` events and ``.done`` (a custom tool's call its input,
decoded from the arguments once they are whole, as one ``response.custom_tool_call_input.delta``
and ``.done``).  Every event has its ``sequence_number``.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

#: A text item's type -> (its id prefix, its part's type, its delta and done events' prefix).
_TEXT = {"message": ("msg", "output_text", "response.output_text"),
         "reasoning": ("rs", "reasoning_text", "response.reasoning_text")}


#: What an lmdock reasoning token starts with (what :func:`read_reasoning_token` recognizes).
_TOKEN_PREFIX = "lmdock-reasoning-v1."


def reasoning_token(text: str) -> str:
    """The ``encrypted_content`` of a reasoning item: ``text`` as base64 of a small JSON object behind
    a prefix.  Anyone can read it: it only lets a client that keeps no reasoning text (Codex, with
    ``store: false``) hand the thinking back."""
    return _TOKEN_PREFIX + base64.urlsafe_b64encode(json.dumps({"reasoning": text}).encode()).decode("ascii")


def read_reasoning_token(token: str) -> str | None:
    """The reasoning text in a token from :func:`reasoning_token`, or None for any other string
    (another server's encrypted reasoning, which lmdock cannot read)."""
    if not token.startswith(_TOKEN_PREFIX):
        return None
    try:
        value = json.loads(base64.urlsafe_b64decode(token[len(_TOKEN_PREFIX):].encode("ascii")))
    except (ValueError, binascii.Error, UnicodeError):
        return None
    text = value.get("reasoning") if isinstance(value, dict) else None
    return text if isinstance(text, str) else None


@dataclass(frozen=True)
class Outputs:
    """How this request's output items look: ``custom``: the names of its custom tools; ``summary``:
    a reasoning item's text is its summary too; ``token``: a reasoning item carries
    :func:`reasoning_token`."""

    custom: frozenset[str] = frozenset()
    summary: bool = False
    token: bool = False
    #: namespaced tools' flat names -> (namespace, name): their calls name both
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def text_item(self, kind: str, item_id: str, text: str, status: str) -> dict[str, Any]:
        """A ``message`` or ``reasoning`` item (its content empty while in progress)."""
        content = [_part(kind, text)] if status != "in_progress" else []
        if kind == "message":
            return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}
        item = {"id": item_id, "type": "reasoning", "summary": [], "status": status, "content": content}
        if status != "in_progress" and self.summary:
            item["summary"] = [{"type": "summary_text", "text": text}]
        if status != "in_progress" and self.token:
            item["encrypted_content"] = reasoning_token(text)
        return item

    def call_item(self, item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        """A ``function_call`` item, or a ``custom_tool_call`` with the call's ``input`` (while in
        progress, empty)."""
        namespace, short = self.namespaced.get(name, (None, name))
        if name in self.custom:
            value = custom_input(arguments) if status != "in_progress" else ""
            item = {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": short, "input": value, "status": status}
        else:
            item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": short, "arguments": arguments, "status": status}
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def items(self, message: dict[str, Any], status: str) -> list[dict[str, Any]]:
        """Chat's assistant message as output items; a message item when there is text or nothing else."""
        items = []
        if message.get("reasoning_content"):
            items.append(self.text_item("reasoning", new_id("rs"), message["reasoning_content"], status))
        text, calls = message.get("content") or "", message.get("tool_calls") or []
        if text or not (calls or items):
            items.append(self.text_item("message", new_id("msg"), text, status))
        return items + [self.call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
                        for c in calls]


def custom_input(arguments: str) -> str:
    """A custom tool's input from chat's call arguments, ``{"input": "..."}`` (see
    ``_responses_items.chat_tools``); arguments that are not that come back as they are."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def assistant(message: dict[str, Any]) -> dict[str, Any]:
    """Chat's assistant message as the history keeps it (content a string; calls and reasoning where made)."""
    out = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    if message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    return out


class EventSequence:
    """Chat's chunks as the streamed events: the sequence number, the item open now, the items done,
    and the assistant message they add up to (for the store)."""

    def __init__(self, outputs: Outputs = Outputs()) -> None:
        self.outputs = outputs
        self.number = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written: {"kind", "id", "index", "text", ...}
        self.message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
        self.finish: str | None = None
        self.usage: dict[str, int] | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.number += 1
        return {"type": kind, "sequence_number": self.number - 1, **fields}

    def error(self, err: dict[str, Any]) -> dict[str, Any]:
        """A failure after the start (OpenAI's error body) as the ``error`` event."""
        return self.event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
        return out

    @property
    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out = []
        if self.open is None or self.open["kind"] != kind:
            out = self.close("completed")
            out += self._start_text(kind)
        item = self.open
        assert item is not None  # opened above
        item["text"] += text
        self.message["content" if kind == "message" else "reasoning_content"] += text
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(f"{_TEXT[kind][2]}.delta", item_id=item["id"], output_index=item["index"], content_index=0,
                              delta=text, **extra))
        if self._summarized(kind):
            out.append(self.event("response.reasoning_summary_text.delta", item_id=item["id"], output_index=item["index"],
                                  summary_index=0, delta=text))
        return out

    def _summarized(self, kind: str) -> bool:
        """A reasoning item whose summary (its own text) streams beside its text."""
        return kind == "reasoning" and self.outputs.summary

    def _start_text(self, kind: str) -> list[dict[str, Any]]:
        self.open = item = {"kind": kind, "id": new_id(_TEXT[kind][0]), "index": len(self.output), "text": ""}
        where = {"item_id": item["id"], "output_index": item["index"]}
        out = [self.event("response.output_item.added", output_index=item["index"], item=self.outputs.text_item(kind, item["id"], "", "in_progress")),
               self.event("response.content_part.added", **where, content_index=0, part=_part(kind, ""))]
        if self._summarized(kind):
            out.append(self.event("response.reasoning_summary_part.added", **where, summary_index=0, part={"type": "summary_text", "text": ""}))
        return out

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        fn = call.get("function") or {}
        if self.open is None or self.open["kind"] != "function_call" or self.open["call_index"] != call.get("index"):
            out = self.close("completed")
            self.open = {"kind": "function_call", "id": new_id("fc"), "index": len(self.output), "text": "",
                         "call_index": call.get("index"), "call_id": call.get("id") or "", "name": fn.get("name") or ""}
            out.append(self.event("response.output_item.added", output_index=self.open["index"],
                                  item=self.outputs.call_item(self.open["id"], self.open["call_id"], self.open["name"], "",
                                                              "in_progress")))
        if fn.get("arguments"):
            self.open["text"] += fn["arguments"]
            if self.open["name"] in self.outputs.custom:
                return out  # its input is decoded once the arguments are whole (see close)
            out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=self.open["index"], delta=fn["arguments"]))
        return out

    def end(self) -> list[dict[str, Any]]:
        """The events that finish the last item (an empty message when nothing at all was written)."""
        out = self._start_text("message") if self.open is None and not self.output else []
        return out + self.close(self.status)

    def close(self, status: str) -> list[dict[str, Any]]:
        """The events that finish the open item, if any."""
        item = self.open
        if item is None:
            return []
        self.open = None
        where = {"item_id": item["id"], "output_index": item["index"]}
        if item["kind"] == "function_call":
            done = self.outputs.call_item(item["id"], item["call_id"], item["name"], item["text"], status)
            self.message["tool_calls"].append({"id": item["call_id"], "type": "function",
                                               "function": {"name": item["name"], "arguments": item["text"]}})
            if done["type"] == "custom_tool_call":
                out = [self.event("response.custom_tool_call_input.delta", **where, delta=done["input"]),
                       self.event("response.custom_tool_call_input.done", **where, input=done["input"])]
            else:
                out = [self.event("response.function_call_arguments.done", **where, name=done["name"], arguments=item["text"])]
        else:
            kind = item["kind"]
            done = self.outputs.text_item(kind, item["id"], item["text"], status)
            extra = {"logprobs": []} if kind == "message" else {}
            out = [self.event(f"{_TEXT[kind][2]}.done", **where, content_index=0, text=item["text"], **extra),
                   self.event("response.content_part.done", **where, content_index=0, part=done["content"][0])]
            if self._summarized(kind):
                out += [self.event("response.reasoning_summary_text.done", **where, summary_index=0, text=item["text"]),
                        self.event("response.reasoning_summary_part.done", **where, summary_index=0, part=done["summary"][0])]
        self.output.append(done)
        return [*out, self.event("response.output_item.done", output_index=item["index"], item=done)]
