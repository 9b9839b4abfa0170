"""Prompts as the ``LLM`` calls take them: one or a batch, and errors that say which prompt of a
batch was wrong."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmdock._plugin.errors import RequestError

#: A prompt: text, token ids (TensorRT-LLM style), or vLLM's ``TextPrompt`` / ``TokensPrompt`` dict.
Prompt = str | Sequence[int] | dict[str, Any]

#: vLLM's prompt dicts: the key each carries its prompt under.  ``multi_modal_data`` (images) is read
#: by ``lmdock._llm.multimodal``; other keys vLLM's dicts may hold (cache_salt...) ask for what lmdock
#: cannot do, so they are refused, not dropped.
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def as_prompt(prompt: Prompt) -> str | Sequence[int]:
    """One prompt as text or token ids: a ``{"prompt_token_ids": [...]}`` dict is its ids (its optional
    ``"prompt"`` text is only a label), a ``{"prompt": "..."}`` dict its text.  Any other dict is a
    RequestError naming the keys it may hold: a dict is never read as a sequence of its keys."""
    if not isinstance(prompt, dict):
        return prompt
    if "multi_modal_data" in prompt:
        return prompt  # type: ignore[return-value]  # its images are read by LLM._request (lmdock._llm.multimodal)
    other = sorted(set(prompt) - set(PROMPT_KEYS))
    if other or not prompt:
        what = f"has {', '.join(repr(k) for k in other)}" if other else "is empty"
        raise RequestError(f"a prompt dict {what}; it takes {PROMPT_KEYS[0]!r} (text, vLLM's TextPrompt) or "
                           f"{PROMPT_KEYS[1]!r} (token ids, vLLM's TokensPrompt), nothing else")
    return prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]


def as_batch(prompts: Prompt | Sequence[Prompt]) -> list[str | Sequence[int]]:
    """One prompt or a batch of them, as a list of text and token-id prompts."""
    if isinstance(prompts, (str, dict)):
        return [as_prompt(prompts)]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one token-id prompt
    if isinstance(prompts, Sequence) and not prompts:
        raise RequestError("no prompts given")
    prompts = list(prompts)  # any iterable of prompts
    return [indexed(i, len(prompts), as_prompt, p) for i, p in enumerate(prompts)]


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


def non_text_part(messages: Sequence[Any], allowed: Sequence[str] = ("text",)) -> tuple[str, str] | None:
    """``(where, kind)`` of the first chat content part whose type is not in ``allowed`` (text; the
    server adds image parts, which lmdock._llm.multimodal reads), as ``messages[i].content[j]``, or None:
    a part the model would never see (``input_audio``...) must be refused, not passed as if read."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in allowed:
                return f"messages[{i}].content[{j}]", str(kind)
    return None


def token_id_prompts(prompt_token_ids: Any, prompts: Any, *, one: bool = False) -> list[str | Sequence[int]]:
    """furiosa-llm's ``prompt_token_ids`` (a transformers ``BatchEncoding``, a dict with ``input_ids``,
    or lists of ids) as the prompts to run, in place of ``prompts``' own tokenization (when given,
    ``prompts`` must be as many); None: ``prompts`` as they are."""
    if prompt_token_ids is None:
        return as_batch(prompts)
    ids = prompt_token_ids["input_ids"] if hasattr(prompt_token_ids, "keys") else prompt_token_ids
    ids = ids.tolist() if hasattr(ids, "tolist") else ids  # a tensor from return_tensors=...
    batch = as_batch(list(ids))
    if one and len(batch) != 1:
        raise RequestError(f"prompt_token_ids holds {len(batch)} prompts; this call takes one")
    if prompts is not None and len(as_batch(prompts)) != len(batch):
        raise RequestError(f"prompt_token_ids holds {len(batch)} prompts and prompts {len(as_batch(prompts))}: give as many")
    return batch


def truncated(ids: Sequence[int], keep: int | None, max_len: int | None) -> Sequence[int]:
    """The last ``keep`` prompt tokens (``SamplingParams.truncate_prompt_tokens``, vLLM's left
    truncation; -1: as many as the model takes)."""
    if keep is None:
        return ids
    if keep == -1:
        if max_len is None:
            return ids
        keep = max_len
    return ids[-keep:] if len(ids) > keep else ids


#: ``chat_template_content_format`` values (vLLM's): "string" flattens text parts into one string.
CONTENT_FORMATS = ("auto", "string", "openai")


def content_as(fmt: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation with each message's content in ``fmt``: ``"string"`` joins a list of
    ``{"type": "text", "text": ...}`` parts with newlines (vLLM's rule); the others leave it as is."""
    if fmt not in CONTENT_FORMATS:
        raise RequestError(f"chat_template_content_format {fmt!r}: choose one of {', '.join(CONTENT_FORMATS)}")
    if fmt != "string":
        return messages
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = [p for p in content if not (isinstance(p, dict) and p.get("type") == "text")]
            if parts:
                raise RequestError(f"chat_template_content_format 'string' takes text parts only, got {parts[0]!r:.80}")
            m = {**m, "content": "\n".join(p["text"] for p in content)}
        out.append(m)
    return out
