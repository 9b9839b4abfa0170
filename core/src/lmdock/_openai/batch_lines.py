"""The lines of an OpenAI batch file, read and checked for ``lmdock batch`` (which runs them).

A line is ``{"custom_id", "method": "POST", "url", "body"}``; ``url`` is ``/v1/completions``,
``/v1/chat/completions`` or ``/v1/embeddings`` (left out, the body's ``prompt``, ``messages`` or
``input`` says which).  The file is checked whole first, as OpenAI checks a batch file on upload:
each line a JSON object with a ``custom_id`` no other line has, since a rerun skips the ids OUTPUT
already holds.  Then each line is read on its own: what it asks for that cannot be honoured (an unknown
field, a value of the wrong kind) is that line's :class:`LineError`, and the other lines carry on.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmdock._config.foreign import GUIDED, OPENAI_FIELDS
from lmdock._config.structured_fields import FieldRefused, structured_output
from lmdock._llm.prompts import non_text_part
from lmdock._openai.embeddings import ENCODING_FORMATS, embedding_prompts
from lmdock._plugin.errors import ConfigError

#: Each endpoint, and the body field that holds its input.
URLS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/v1/embeddings": "input"}
#: Body fields accepted and not used: the model is the command's (-m), the output is never streamed.
IGNORED = {"model", "user", "stream"}
#: The fields each endpoint's body takes besides IGNORED (and, for generation, OPENAI_FIELDS); the
#: output constraints are the server's (lmdock._config.structured_fields), chat's template fields its too.
FIELDS = {
    "/v1/completions": {"prompt", "logprobs", *GUIDED, "structured_outputs"},
    "/v1/chat/completions": {"messages", "logprobs", "top_logprobs", *GUIDED, "structured_outputs", "response_format",
                             "chat_template_kwargs", "add_generation_prompt", "continue_final_message"},
    "/v1/embeddings": {"input", "encoding_format", "dimensions", "truncate_prompt_tokens"},
}
#: Fields the server takes that a batch line does not, and what to do instead.
REFUSED = {
    "echo": "echo is not supported by lmdock batch (it writes only the generated text): prepend the prompt yourself, "
            "or score a prompt with lmdock serve's /v1/completions (echo with max_tokens 0)",
    "chat_template": "a line cannot carry its own chat template: pass --chat-template FILE to lmdock batch",
}
_RECORD_KEYS = ("custom_id", "method", "url", "body")
_SHOWN = 5  # file problems listed in the error; the rest are counted


class LineError(Exception):
    """One input line cannot run; it becomes an error line (``code``, message) and the others carry on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Line:
    """One line of the file: where it is, its id, and the JSON object it holds."""

    lineno: int
    custom_id: str
    record: dict[str, Any]


@dataclass
class Request:
    """What one line asks for: its endpoint, its body, and for generation the logprobs it wants
    (None: none; else how many top alternatives per token) and the ``structured_output`` it asks for."""

    url: str
    body: dict[str, Any]
    logprobs: int | None = None
    structured: dict[str, Any] | None = None


def read_lines(src: Path) -> list[Line]:
    """Every non-blank line of ``src``; ConfigError naming the lines that are not a JSON object with
    a custom_id of their own (nothing runs then: a line without one could not be resumed)."""
    try:
        text = src.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the batch input: {exc.strerror}", source=str(src)) from None
    lines: list[Line] = []
    problems: list[str] = []
    first: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as exc:
            problems.append(f"line {lineno} is not JSON ({exc})")
            continue
        custom_id = record.get("custom_id") if isinstance(record, dict) else None
        if not isinstance(record, dict):
            problems.append(f"line {lineno} is not a JSON object")
        elif not isinstance(custom_id, str) or not custom_id:
            problems.append(f"line {lineno} has no custom_id (a non-empty string)")
        elif custom_id in first:
            problems.append(f"line {lineno} repeats custom_id {custom_id!r} of line {first[custom_id]}")
        else:
            first[custom_id] = lineno
            lines.append(Line(lineno, custom_id, record))
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ConfigError(f"{'; '.join(problems[:_SHOWN])}{more}. Each line must be a JSON object with a custom_id "
                          "that no other line has (OpenAI's batch files require one; a rerun skips the custom_ids "
                          "already in OUTPUT); nothing was run", source=str(src))
    return lines


def done_ids(output: Path) -> set[str]:
    """The custom_id values OUTPUT already holds (a torn last line, from a killed run, is ignored)."""
    ids: set[str] = set()
    if not output.exists():
        return ids
    with output.open(encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("custom_id"), str):
                ids.add(record["custom_id"])
    return ids


def parse_request(line: Line) -> Request:
    """The request one line makes; LineError for what cannot be honoured."""
    url, body = endpoint(line.record)
    known = FIELDS[url] | IGNORED | (set() if url == "/v1/embeddings" else set(OPENAI_FIELDS))
    for key, value in body.items():
        if value is not None and key in REFUSED:
            raise LineError("invalid_request", REFUSED[key])
        if value is not None and key not in known:
            raise LineError("invalid_request", f"body field {key!r} is not supported for {url}{_hint(key, known)}")
    if url == "/v1/embeddings":
        check_embedding_body(body)
        return Request(url, body)
    if url == "/v1/chat/completions":
        check_messages(body["messages"])
        check_template_fields(body)
    else:
        body = {**body, "prompt": one_prompt(body["prompt"])}
    try:
        structured = structured_output(body)
    except FieldRefused as exc:
        raise LineError("invalid_request", str(exc)) from None
    return Request(url, body, logprobs_wanted(url, body), structured)


def endpoint(record: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A line's ``url`` (given, or told by its body's input field) and ``body``."""
    for key in record:
        if key not in _RECORD_KEYS:
            raise LineError("invalid_request", f"unknown key {key!r}{_hint(key, _RECORD_KEYS)}; a line holds "
                                               f"{', '.join(_RECORD_KEYS)}")
    if record.get("method", "POST") != "POST":
        raise LineError("invalid_request", f"method {record['method']!r}: batch requests are POST")
    body = record.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "missing body (an object with prompt, messages or input)")
    url = record.get("url")
    if url is None:
        url = next((u for u, field in URLS.items() if field in body), None)
        if url is None:
            raise LineError("invalid_request", f"body has none of {', '.join(URLS.values())}: give one, or the url")
    elif url not in URLS:
        raise LineError("invalid_url", f"url {url!r} is not supported; use {', '.join(URLS)}")
    if body.get(URLS[url]) is None:
        raise LineError("invalid_request", f"body has no {URLS[url]!r} (what {url} runs on)")
    return url, body


def _hint(key: str, known: Any) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; supported: {', '.join(sorted(known))}"


def logprobs_wanted(url: str, body: dict[str, Any]) -> int | None:
    """How many top alternatives each token's logprobs carry (None: no logprobs), as the server reads
    them: completions' ``logprobs`` is the count; chat's is a boolean, with ``top_logprobs`` the count."""
    lp = body.get("logprobs")
    if url == "/v1/completions":
        if isinstance(lp, bool):
            raise LineError("invalid_request", "logprobs is a number for /v1/completions (top alternatives per token)")
        return lp  # type: ignore[no-any-return]  # SamplingParams checks the number
    top = body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise LineError("invalid_request", "logprobs is true or false for /v1/chat/completions; top_logprobs is "
                                           "the number of alternatives")
    if lp:
        return top or 0  # type: ignore[no-any-return]
    if top:
        raise LineError("invalid_request", "top_logprobs needs logprobs: true")
    return None


def sampling_overrides(request: Request) -> dict[str, Any]:
    """The body's sampling fields as SamplingParams overrides (OpenAI's names mapped through OPENAI_FIELDS)."""
    out = {OPENAI_FIELDS[k]: v for k, v in request.body.items() if k in OPENAI_FIELDS and v is not None}
    if request.logprobs is not None:
        out["logprobs"] = request.logprobs
    if request.structured is not None:
        out["structured_output"] = request.structured
    return out


def check_template_fields(body: dict[str, Any]) -> None:
    """Chat's template fields, as the server takes them (``lmdock.LLM.render_chat`` applies them)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise LineError("invalid_request", "chat_template_kwargs is an object (names the template reads -> values)")
    for name in ("add_generation_prompt", "continue_final_message"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise LineError("invalid_request", f"{name} is true or false")
    if body.get("continue_final_message") and body.get("add_generation_prompt", True):
        raise LineError("invalid_request", "continue_final_message needs add_generation_prompt: false")


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise LineError("invalid_request", "messages must be a non-empty list of message objects")
    found = non_text_part(messages)
    if found is not None:
        raise LineError("invalid_request", f"{found[0]} is a {found[1]!r} part; batch lines take text parts only "
                                           "(images go through lmdock serve or LLM.chat: docs/vision.md)")


def one_prompt(prompt: Any) -> Any:
    """The line's one prompt (a string or token ids; a list holding one of them is that one)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise LineError("invalid_request", f"prompt holds {len(prompt)} prompts; lmdock batch runs one prompt "
                                               "per line: give each its own line (and custom_id)")
        return prompt[0]
    return prompt


def check_embedding_body(body: dict[str, Any]) -> None:
    if not embedding_prompts(body["input"]):
        raise LineError("invalid_request", "input is empty: give a string, a list of strings, token ids or a list "
                                           "of token-id lists")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise LineError("invalid_request", f"encoding_format {fmt!r}: use {' or '.join(map(repr, ENCODING_FORMATS))}")
