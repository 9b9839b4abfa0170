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
