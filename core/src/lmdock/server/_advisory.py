"""The field policy of the agent routes (``/v1/messages``, ``/v1/responses``) for what real agent
clients (Claude Code, Codex) send: each field is honoured, refused, or *advisory*.

An advisory field asks for an optimisation or a hosted feature and does not change what a correct
answer is (a cache hint, a routing key, a beta flag, a hosted web search no plugin provides): it is
accepted, and the response names it in its ``x-lmdock-ignored`` header, with a log line, so nothing
is silently ignored.  :data:`POLICY` is the one table; ``docs/server.md`` holds it as rendered by
:func:`markdown` (a test compares them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from lmdock._config.json_schemas import loosened

log = logging.getLogger("lmdock.server")

#: the response header naming the advisory fields a request carried (and the schema keywords loosened)
HEADER = "x-lmdock-ignored"
#: the response header naming the calls whose arguments fail a loosened keyword (a whole response only)
INVALID_HEADER = "x-lmdock-invalid-arguments"


@dataclass(frozen=True)
class Field:
    api: Literal["messages", "responses"]
    name: str
    outcome: Literal["honoured", "advisory", "refused"]
    what: str


POLICY: tuple[Field, ...] = (
    Field("messages", "context_management", "advisory",
          "context editing (clearing old thinking or tool results) is the hosted API's; the conversation is rendered as sent, "
          "and the chat template decides which earlier thinking it shows"),
    Field("messages", "output_config.effort", "honoured",
          "passed to the chat template as `reasoning_effort` where the template reads it (`max` as `high`); advisory "
          "where the template has no such knob"),
    Field("messages", "output_config.format", "honoured", "a `json_schema` format constrains the answer, as chat's `response_format`"),
    Field("messages", "thinking", "honoured",
          "`adaptive`: the model's default; `enabled`: `enable_thinking: true` to the template (advisory on a model without "
          "a reasoning parser, which does not think); `disabled`: `enable_thinking: false`"),
    Field("messages", "thinking.budget_tokens", "honoured",
          "held by the step loop where the prompt opens the thinking span: past the budget the end-of-thinking marker "
          "is forced (as llama.cpp's reasoning budget); advisory on engines that sample outside lmdock (vLLM, ...)"),
    Field("messages", "anthropic-beta (header)", "advisory", "beta features are the hosted API's; lmdock serves one version"),
    Field("messages", "beta (query)", "advisory", "`?beta=true` asks for the hosted API's beta surface; lmdock serves one version"),
    Field("messages", "cache_control", "advisory", "the prefix cache reuses every prompt's prefix unasked"),
    Field("messages", "metadata.user_id", "advisory", "an end user's id for a provider's abuse reports: nothing to do on a local server"),
    Field("messages", "service_tier", "advisory", "one tier: every request is served alike"),
    Field("messages", "server tools (web_search_*, web_fetch_*, code_execution_*)", "advisory",
          "dropped from the tools: no plugin provides a search, fetch or sandbox backend (named as `tools[i] (kind: why)`)"),
    Field("messages", "other tool types", "refused", "a 400 naming the tool: client tools have name, description, input_schema"),
    Field("responses", "reasoning.effort", "honoured",
          "passed to the chat template as `reasoning_effort` where the template reads it; else `none`/`minimal` turn "
          "`enable_thinking` off and other efforts on, the grade itself advisory; advisory on a template with neither knob"),
    Field("responses", "include: reasoning.encrypted_content", "honoured",
          "reasoning items carry a token lmdock reads back on the next turn (with `store: false` too)"),
    Field("responses", "prompt_cache_key", "advisory", "a routing key for a provider's cache; the prefix cache needs none"),
    Field("responses", "client_metadata", "advisory", "about the client, for a provider's logs: nothing to do"),
    Field("responses", "service_tier", "advisory", "one tier: every request is served alike"),
    Field("responses", "hosted tools (web_search, file_search, code_interpreter, image_generation, mcp, ...)", "advisory",
          "dropped from the tools: no plugin provides the backend (named as `tools[i] (kind: why)`)"),
    Field("responses", "namespace tools", "honoured",
          "flattened into function tools named `NAMESPACE__NAME`; their calls come back as `function_call` items with "
          "`namespace` and the inner `name`"),
    Field("responses", "other tool types", "refused", "a 400 naming the tool: function, custom and namespace tools are run by the client"),
)

#: hosted tools of each API that no plugin provides: the tool type (or its prefix) -> why it is dropped
HOSTED = {
    "messages": {"web_search": "no search backend", "web_fetch": "no fetch backend", "code_execution": "no sandbox"},
    "responses": {"web_search": "no search backend", "web_search_preview": "no search backend", "file_search": "no vector store",
                  "code_interpreter": "no sandbox", "image_generation": "no image model", "mcp": "no MCP client in the server",
                  "computer_use_preview": "no computer to use", "tool_search": "no tool index"},
}


def hosted(api: str, kind: Any) -> str | None:
    """Why a hosted tool of this ``kind`` is dropped, or None when it is no hosted tool (Anthropic's are
    versioned: ``web_search_20250305``)."""
    if not isinstance(kind, str):
        return None
    table = HOSTED[api]
    if kind in table:
        return table[kind]
    base = kind.rstrip("0123456789").rstrip("_")
    return table.get(base) if api == "messages" else None


class Ignored:
    """The advisory fields one request carried, in order, each once."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.invalid: list[str] = []  # calls that fail a loosened keyword

    def add(self, name: str) -> None:
        if name not in self.names:
            self.names.append(name)

    def loosened(self, plan: Any, response_format: Any, field: str) -> None:
        """The schema keywords the grammar engine could not hold: each tool's (checked on the calls
        after generation, see :meth:`check`) and the response format's (``field``: its name here)."""
        if plan.reads_calls:
            for name, keywords in plan.loosened.items():
                for keyword in keywords:
                    self.add(f"tools.{name}: {keyword} (loosened; checked after generation)")
        schema = ((response_format or {}).get("json_schema") or {}).get("schema")
        for keyword in loosened(schema)[1] if isinstance(schema, dict) else ():
            self.add(f"{field}: {keyword} (loosened)")

    def check(self, plan: Any, completion: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion, its calls checked against the keywords their schemas lost."""
        for choice in completion.get("choices", ()):
            self.invalid += plan.invalid(choice.get("message", {}).get("tool_calls") or [])
        return completion

    def apply(self, response: Any, route: str) -> Any:
        """``response`` with the headers naming them (and a log line), when there are any."""
        if self.names:
            value = ", ".join(self.names)
            response.headers[HEADER] = value.encode("ascii", "backslashreplace").decode()  # a header is latin-1
            log.info("%s: advisory fields accepted and not acted on: %s", route, value)
        if self.invalid:
            response.headers[INVALID_HEADER] = "; ".join(self.invalid).encode("ascii", "backslashreplace").decode()
            log.warning("%s: tool calls failing a keyword their schema's grammar could not hold: %s", route, "; ".join(self.invalid))
        return response


def markdown() -> str:
    """:data:`POLICY` as the Markdown table ``docs/server.md`` holds."""
    rows = ["| API | field | outcome | what lmdock does |", "| --- | --- | --- | --- |"]
    rows += [f"| {f.api} | {f.name} | {f.outcome} | {f.what} |" for f in POLICY]
    return "\n".join(rows) + "\n"


def reasoning_knobs(template: str | None) -> frozenset[str]:
    """The chat template's reasoning knobs: ``reasoning_effort`` (a grade), ``enable_thinking`` (on or off)."""
    return frozenset(k for k in ("reasoning_effort", "enable_thinking") if template and k in template)
