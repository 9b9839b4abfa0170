"""What every tool-call parser is: :class:`ToolCall`, the prefix scan a parser implements, and the
one streaming differ that turns successive scans into OpenAI's deltas.

A parser answers one question, :meth:`ToolParser.scan`: given the text a model has written so far,
which part is plain content that can be shown, and which calls has it opened (with the name, once
written, and the arguments' text so far)?  The full-text parse is the scan of the finished text;
the streaming parse is :class:`ToolStream`, which scans the growing text and sends only what is new.
One scan serves both, so a streamed reply and a whole one cannot disagree.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field
from typing import Any


def call_id() -> str:
    """A fresh OpenAI-style call id (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One finished call: its id, the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str = "{}"
    id: str = field(default_factory=call_id)

    def openai(self) -> dict[str, Any]:
        """The call as OpenAI's ``tool_calls`` item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class PartialCall:
    """A call as far as it is written: ``name`` once complete, ``arguments`` the text so far (only
    text that will stay: a parser holds back what may still turn out to close the call)."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class Scan:
    """A parser's reading of a text: the content to show and the calls opened.  ``error``: a call
    could not be read (malformed JSON from an unconstrained model); the text then stays content."""

    content: str
    calls: list[PartialCall]
    error: str | None = None


@dataclass(frozen=True)
class Parsed:
    """The finished text read whole: content (None when there is only calls) and the calls."""

    content: str | None
    calls: list[ToolCall]


class ToolParser:
    """A model family's tool-call format.  Subclasses set :attr:`name` and implement :meth:`scan`
    and, to be valid by construction on step engines, :meth:`grammar`.

    :attr:`marker`: the text that opens the calls (``<tool_call>``), or "" where a call is the whole
    output (Llama 3 JSON, pythonic); :attr:`template_hints`: strings whose presence in a chat
    template says the model writes this format (see :func:`lmdock.tools.parser_for_template`).
    """

    name = ""
    marker = ""
    template_hints: tuple[str, ...] = ()
    #: what a stream's parser keeps between scans of its growing text (None: a whole-text parse); a
    #: parser may use it to read only what is new (the JSON formats do)
    memo: dict[Any, Any] | None = None

    def scan(self, text: str, final: bool) -> Scan:
        """Read ``text`` (``final``: the whole output; else a prefix that may still grow)."""
        raise NotImplementedError

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, lazy: bool) -> str | None:
        """A Lark grammar (llguidance's dialect) whose every match this parser reads as calls to
        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``) with arguments that
        validate against their schemas: one call, or several when ``parallel``.  ``lazy``: also
        allow plain text instead (``tool_choice: "auto"``), constrained only once a call opens.
        None when the format cannot be written as a grammar (the request is then refused or, under
        ``auto``, parsed only)."""
        return None

    def parse(self, text: str) -> Parsed:
        """The finished output read whole; malformed calls leave the text as content."""
        scan = self.scan(text, final=True)
        if scan.error is not None or not scan.calls:
            return Parsed(text, [])
        calls = [ToolCall(c.name or "", c.arguments or "{}") for c in scan.calls]
        return Parsed(scan.content.strip() or None, calls)  # the newlines around the blocks are not content

    def stream(self) -> ToolStream:
        """A new incremental parse of one completion (with its own copy of this parser and memo)."""
        own = copy.copy(self)
        own.memo = {}
        return ToolStream(own)


@dataclass
class CallDelta:
    """What a stream sends about call ``index``: its id and name (the first delta of a call), then
    pieces of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict[str, Any]:
        """The delta as an item of OpenAI's ``delta.tool_calls``."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        else:
            out["function"] = {"arguments": self.arguments}
        return out


class ToolStream:
    """The streaming parse of one completion: :meth:`feed` the whole text so far, get back the new
    content and the call deltas to send; :meth:`calls` the finished calls at the end.

    A call is announced (id and name) once its name is complete, then its arguments go out as they
    are written.  Content that may be the start of a marker (``<tool_c``) waits until it is not."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_args: list[int] = []
        self.names: list[str] = []
        self.error: str | None = None

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """``(new content, call deltas)`` for ``text``, the completion's whole text so far."""
        scan = self.parser.scan(text, final)
        if final and scan.error is not None and not self.ids:
            scan = Scan(text, [])  # nothing was announced: the malformed call stays content
        self.error = scan.error if final else None
        content = scan.content[self.sent_content:] if len(scan.content) > self.sent_content else ""
        self.sent_content = max(self.sent_content, len(scan.content))
        deltas: list[CallDelta] = []
        for i, call in enumerate(scan.calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(call_id())
                self.names.append(call.name)
                self.sent_args.append(0)
                deltas.append(CallDelta(i, self.ids[i], call.name, ""))
            new = call.arguments[self.sent_args[i]:]
            if new:
                self.sent_args[i] = len(call.arguments)
                if deltas and deltas[-1].index == i and deltas[-1].id is not None and not deltas[-1].arguments:
                    deltas[-1].arguments = new
                else:
                    deltas.append(CallDelta(i, arguments=new))
        return content, deltas

    def calls(self, text: str) -> list[ToolCall]:
        """The finished calls of the finished ``text``, under the ids the stream announced."""
        scan = self.parser.scan(text, final=True)
        return [ToolCall(c.name or "", c.arguments or "{}", self.ids[i]) for i, c in enumerate(scan.calls) if i < len(self.ids)]


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker`` (so not shown yet)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
