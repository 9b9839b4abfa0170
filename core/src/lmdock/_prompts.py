"""Prompts as the ``LLM`` calls take them: one or a batch, and errors that say which prompt of a
batch was wrong."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmdock._errors import RequestError

#: A prompt: text, or token ids (TensorRT-LLM style).
Prompt = str | Sequence[int]


def as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one token-id prompt
    if isinstance(prompts, Sequence) and not prompts:
        raise RequestError("no prompts given")
    return list(prompts)  # type: ignore[arg-type]


def indexed(i: int, total: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; in a batch, a bad request's error says which prompt it was."""
    try:
        return fn(*args, **kwargs)
    except RequestError as exc:
        if total == 1:
            raise
        raise RequestError(f"prompt {i}: {exc}") from None


def indexed_error(i: int, total: int, error: BaseException) -> BaseException:
    """A batch's failed request, saying which prompt it was."""
    if total == 1 or not isinstance(error, RequestError):
        return error
    return RequestError(f"prompt {i}: {error}")


def non_text_part(messages: Sequence[Any]) -> tuple[str, str] | None:
    """``(where, kind)`` of the first chat content part that is not text (``image_url``,
    ``input_audio``...), as ``messages[i].content[j]``, or None.  lmdock serves text models: a part
    the model would never see must be refused, not passed as if it had been read."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                return f"messages[{i}].content[{j}]", str(kind)
    return None
