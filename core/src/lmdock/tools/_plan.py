"""One chat request's tools and thinking, decided once: what the template sees, what constrains the
output, and how the reply is read back (whole or streamed).

``tool_choice`` (OpenAI's): ``"none"`` renders the tools but reads no calls; ``"auto"`` lets the
model write text or calls (constrained lazily, once a call opens, where the format has a grammar and
the backend can constrain; else read only); ``"required"`` or ``{"type": "function", "function":
{"name": ...}}`` constrain the output to calls (to that function) whose arguments validate against
the tool's schema: valid by construction, or refused where the backend cannot constrain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lmdock._config.json_schemas import loosened
from lmdock._plugin.errors import RequestError
from lmdock.tools._base import CallDelta, ToolCall, ToolParser, ToolStream
from lmdock.tools._formats import up_to
from lmdock.tools._reasoning import ReasoningParser, ReasoningStream, ThinkingBudget

ToolChoice = str | dict[str, Any] | None


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's ``tools`` list, checked: each ``{"type": "function", "function": {"name", "parameters"?}}``."""
    if not isinstance(tools, list):
        raise RequestError("tools: a list of {\"type\": \"function\", \"function\": {...}} objects")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools[{i}]: lmdock takes function tools, {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].function.name: a function needs a name")
        if name in names:
            raise RequestError(f"tools[{i}].function.name: {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters: a JSON schema object")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise RequestError(f"tools[{i}].function: unknown key {sorted(unknown)[0]!r}; known: description, name, parameters, strict")
    return tools


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as chat templates read them: an assistant's ``tool_calls`` arguments as objects
    (OpenAI sends JSON text; transformers' templates, Qwen's and Llama's, write them with ``tojson``)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and any(isinstance((c.get("function") or {}).get("arguments"), str) for c in calls if isinstance(c, dict)):
            m = {**m, "tool_calls": [_args_as_object(c) for c in calls]}
        out.append(m)
    return out


def _args_as_object(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"] or "{}")
    except ValueError:
        return call  # left as the client sent it: the template shows it as text
    return {**call, "function": {**fn, "arguments": args}}


def _schema_error(arguments: str, schema: dict[str, Any]) -> str | None:
    import jsonschema  # a core dependency, imported only when a loosened schema's output is checked

    try:
        jsonschema.validate(json.loads(arguments or "{}"), schema)
    except ValueError as exc:
        return f"arguments are no JSON: {exc}"
    except (jsonschema.ValidationError, jsonschema.SchemaError) as exc:
        return exc.message
    return None


def choice_of(tool_choice: ToolChoice, tools: list[dict[str, Any]]) -> str:
    """``"none"``, ``"auto"``, ``"required"`` or the name of the function ``tool_choice`` forces."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(f"tool_choice: {tool_choice!r} is not one of none, auto, required (or a named function)")
        if tool_choice != "none" and not tools:
            raise RequestError(f"tool_choice: {tool_choice!r} needs tools")
        return tool_choice
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError('tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools}:
        raise RequestError(f"tool_choice names function {name!r}, which is not in tools")
    return name


@dataclass
class ChatPlan:
    """How one chat request treats tools and thinking.

    Build it with :meth:`make`; pass :attr:`template_tools` to the chat template; merge
    :meth:`constraint` into the sampling parameters; then read each completion with :meth:`read` (whole)
    or :meth:`stream` (incrementally)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: str = "none"
    parallel: bool = True
    parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    opened: bool = False  # the prompt opened a thinking span
    #: each tool's schema keywords the grammar could not hold (``lmdock._config.json_schemas.loosened``), by tool name
    loosened: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def make(cls, tools: Any, tool_choice: ToolChoice, parallel: bool | None, template_kwargs: dict[str, Any] | None, *,
             model: str, tool_parser: str | None, reasoning_parser: str | None, template: str | None) -> ChatPlan:
        """Check a request's tool fields against the model's parsers: ``tool_parser`` / ``reasoning_parser``
        as its config names them (the tool parser, when None, recognized from the chat ``template``'s
        text); ``model``: its name, for errors."""
        from lmdock.tools._registry import get_parser, get_reasoning_parser, parser_for_template

        parser = get_parser(tool_parser) if tool_parser else parser_for_template(template) if tools else None
        reasoning = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        checked = check_tools(tools) if tools is not None else []
        choice = choice_of(tool_choice, checked)
        if choice != "none" and parser is None:
            raise RequestError(f"tools: model {model!r} has no tool_parser and its chat template names no known format; "
                               "set [models.NAME] tool_parser (see `docs/tools.md`) or send tool_choice: \"none\"")
        if (template_kwargs or {}).get("enable_thinking") is False:
            reasoning = None  # thinking off: the reply is all answer
        loose = {t["function"]["name"]: names for t in checked if (names := loosened(t["function"].get("parameters") or {})[1])}
        return cls(checked, choice, True if parallel is None else bool(parallel), parser, reasoning, loosened=loose)

    def invalid(self, calls: list[dict[str, Any]]) -> list[str]:
        """What is wrong with ``calls`` (OpenAI's ``tool_calls`` items) whose tool's schema was loosened,
        checked against the schema the client sent (``jsonschema``), one line a call; the others are
        valid by construction or unconstrained."""
        out = []
        for call in calls:
            fn = call.get("function") or {}
            if fn.get("name") in self.loosened:
                problem = _schema_error(fn.get("arguments") or "", self._params(fn["name"]))
                if problem is not None:
                    out.append(f"{fn['name']}: {problem}")
        return out

    def thinking_budget(self, budget: int, tokenizer: Any, prompt: str) -> ThinkingBudget | None:
        """A logits processor holding the thinking to ``budget`` tokens (:class:`ThinkingBudget`), or None
        where there is no span to hold: no reasoning parser, or a prompt that does not open the thinking."""
        if self.reasoning is None or not self.opened:
            return None
        return ThinkingBudget(budget, self.reasoning.end, tokenizer, len(tokenizer.encode(prompt, add_special_tokens=False)))

    def _params(self, name: str) -> dict[str, Any]:
        return next(t["function"].get("parameters") or {} for t in self.tools if t["function"]["name"] == name)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template's ``tools`` variable holds (None without tools)."""
        return self.tools or None

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none" and self.parser is not None

    def after_render(self, prompt: str) -> None:
        """Note whether the rendered ``prompt`` leaves a thinking span open."""
        self.opened = self.reasoning is not None and self.reasoning.opened_by(prompt)

    def constraint(self, can_constrain: tuple[bool, str], other: Any, backend: str) -> dict[str, Any] | None:
        """The ``structured_output`` that keeps calls valid (None: none needed or possible under auto).

        ``can_constrain``: the backend's ``tools`` capability; ``other``: a structured output the
        request already asks for (response_format), which cannot be combined with a forced call."""
        parser = self.parser
        if parser is None or not self.reads_calls:
            return None
        forced = self.choice != "auto"
        if not forced and (other is not None or not can_constrain[0]):
            return None  # auto: read only
        if forced and other is not None:
            raise RequestError(f"tool_choice {self.choice!r} and response_format both constrain the output: send one")
        if forced and not can_constrain[0]:
            raise RequestError(f"tool_choice {self.choice!r}: backend {backend!r} cannot constrain its output "
                               f"({can_constrain[1]}), so a call could not be guaranteed; send tool_choice: \"auto\"")
        tools = self.tools if self.choice in ("auto", "required") else [t for t in self.tools if t["function"]["name"] == self.choice]
        grammar = parser.grammar(tools, self.parallel and self.choice in ("auto", "required"), lazy=not forced)
        if grammar is None:
            if forced:
                raise RequestError(f"tool_choice {self.choice!r}: the {parser.name!r} call format has no grammar "
                                   "for these tools, so a call could not be guaranteed; send tool_choice: \"auto\"")
            return None
        # under auto the text before a call is free, thinking included; a forced call comes after it
        return {"grammar": self._with_thinking(grammar) if forced else grammar}

    def _with_thinking(self, grammar: str) -> str:
        """``grammar`` after the thinking span the reasoning parser reads (the model thinks first)."""
        r = self.reasoning
        if r is None:
            return grammar
        thought = up_to(r.end, "" if self.opened else r.start)  # one lexeme: see up_to
        span = "THOUGHT WS?" if self.opened else "(THOUGHT WS?)?"
        return f"start: {span} tool_start\nTHOUGHT: {thought}\nWS: /\\s+/\n" + grammar.replace("start:", "tool_start:", 1)

    def read(self, text: str) -> Reading:
        """A finished completion's text read into thinking, content and calls."""
        reasoning, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text, self.opened)
            reasoning, content = split.reasoning, split.content
        calls: list[ToolCall] = []
        if self.reads_calls and self.parser is not None:
            parsed = self.parser.parse(content)
            content, calls = parsed.content, parsed.calls  # type: ignore[assignment]
        return Reading(content, reasoning, calls)

    def stream(self) -> PlanStream:
        """An incremental read of one completion."""
        return PlanStream(self)


@dataclass(frozen=True)
class Reading:
    """A completion read: its content (None when it is calls only), thinking (None without) and calls."""

    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]


@dataclass
class Piece:
    """What a streamed completion adds now: thinking, content and call deltas (each maybe empty)."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class PlanStream:
    """The incremental read of one completion: :meth:`feed` its whole text so far (``final`` at the
    end), get the :class:`Piece` to send; :attr:`tool_calls` are the calls announced (ids as sent)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.thinking = ReasoningStream(plan.reasoning, plan.opened) if plan.reasoning is not None else None
        self.calls: ToolStream | None = plan.parser.stream() if plan.reads_calls and plan.parser is not None else None
        self.content = ""  # the content part of the text so far (what the call parser reads)

    def feed(self, text: str, final: bool = False) -> Piece:
        piece = Piece()
        if self.thinking is not None:
            piece.reasoning, new = self.thinking.feed(text, final)
            self.content += new
        else:
            new, self.content = text[len(self.content):], text
        if self.calls is None:
            piece.content = new
        else:
            piece.content, piece.calls = self.calls.feed(self.content, final)
        return piece

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The finished calls (after the final :meth:`feed`)."""
        return self.calls.calls(self.content) if self.calls is not None and self.calls.ids else []
