"""Tool calls and reasoning in a model's reply: parsers by model family, the streaming reads, and
the grammars that make a call valid by construction.  Imports no engine (see ``docs/tools.md``).

- :func:`get_parser` / :func:`get_reasoning_parser`: a parser by its config name (``tool_parser =
  "hermes"``, ``reasoning_parser = "think"``); :func:`parser_for_template` recognizes one from a chat
  template.  Plugins add parsers with the ``lmdock_register_parsers`` hook.
- :class:`ToolParser`: ``parse(text) -> Parsed(content, calls)`` for a finished reply,
  ``stream() -> ToolStream`` (``feed(text_so_far) -> (new content, [CallDelta])``) while it streams,
  ``grammar(tools, parallel, lazy)`` for the constraint.
- :class:`ChatPlan`: one chat request's tools and thinking (``ChatPlan.make(tools, tool_choice, ...)``):
  ``template_tools``, ``constraint(...)`` (the structured output that keeps calls valid), ``read(text)
  -> Reading(content, reasoning, tool_calls)`` and ``stream().feed(text_so_far, final) -> Piece``.
- :class:`ToolCall`: ``id`` (``call_...``), ``name``, ``arguments`` (JSON text); ``openai()``.
"""

from __future__ import annotations

from lmdock.tools._base import CallDelta, Parsed, PartialCall, Scan, ToolCall, ToolParser, ToolStream, call_id
from lmdock.tools._formats import opened_by, up_to
from lmdock.tools._plan import ChatPlan, Piece, PlanStream, Reading, check_tools, template_messages
from lmdock.tools._reasoning import ReasoningParser, ReasoningStream, Split
from lmdock.tools._registry import (
    get_parser,
    get_reasoning_parser,
    parser_for_template,
    parser_names,
    reasoning_parser_names,
)

__all__ = [
    "CallDelta",
    "ChatPlan",
    "Parsed",
    "PartialCall",
    "Piece",
    "PlanStream",
    "Reading",
    "ReasoningParser",
    "ReasoningStream",
    "Scan",
    "Split",
    "ToolCall",
    "ToolParser",
    "ToolStream",
    "call_id",
    "check_tools",
    "get_parser",
    "get_reasoning_parser",
    "opened_by",
    "parser_for_template",
    "parser_names",
    "reasoning_parser_names",
    "template_messages",
    "up_to",
]
