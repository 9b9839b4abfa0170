"""Reasoning parsers: a model's thinking (``<think>...</think>``) read out of its reply into
``reasoning_content``, whole or while it streams.

The prompt may already have opened the thinking (DeepSeek-R1's and Qwen3's templates end the
generation prompt with ``<think>``), in which case the reply starts inside it; with thinking turned
off (``chat_template_kwargs={"enable_thinking": False}``) nothing is read as thinking at all
(vLLM #17349: answers landed in ``reasoning_content`` when thinking was off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmdock.tools._base import held_back


@dataclass(frozen=True)
class Split:
    """A reply read: its thinking (None when it has none) and its content."""

    reasoning: str | None
    content: str


class ReasoningParser:
    """A ``start ... end`` thinking span at the start of the reply.  Subclasses set the markers."""

    name = "think"
    start = "<think>"
    end = "</think>"

    def opened_by(self, prompt: str) -> bool:
        """Whether ``prompt`` leaves a thinking span open (the reply starts inside it)."""
        tail = prompt.rstrip()
        return tail.rfind(self.start) > tail.rfind(self.end)

    def split(self, text: str, opened: bool, final: bool = True) -> Split:
        """Read ``text`` (``opened``: the prompt opened the span; ``final``: ``text`` is whole, else
        the end that may be the start of a marker is held back)."""
        body = text
        if not opened:
            lead = len(text) - len(text.lstrip())
            if text.startswith(self.start, lead):
                body, opened = text[lead + len(self.start):], True
            elif not final and text.strip() and self.start.startswith(text.strip()):
                return Split(None, "")
            elif self.end not in text:
                return Split(None, text if final else text[:len(text) - held_back(text, self.start)])
            else:
                opened = True  # a span closed that the template opened without saying so (DeepSeek-R1)
        stop = body.find(self.end)
        if stop < 0:
            keep = len(body) if final else len(body) - held_back(body, self.end)
            return Split(body[:keep], "")
        return Split(body[:stop], body[stop + len(self.end):].lstrip("\n") if final else body[stop + len(self.end):].lstrip("\n"))


class ReasoningStream:
    """The streaming read of one reply: :meth:`feed` the whole text so far, get the new thinking and
    the new content."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.parser, self.opened = parser, opened
        self.sent = (0, 0)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        split = self.parser.split(text, self.opened, final)
        reasoning = split.reasoning or ""
        r0, c0 = self.sent
        self.sent = (max(r0, len(reasoning)), max(c0, len(split.content)))
        return reasoning[r0:], split.content[c0:]


BUILTIN_REASONING: tuple[type[ReasoningParser], ...] = (ReasoningParser,)


class ThinkingBudget:
    """A logits processor holding a thinking span to ``budget`` tokens, as llama.cpp's reasoning budget
    does: past it, the end-of-thinking marker's tokens are forced one by one (unless the model has
    ended its thinking itself).  For a prompt that opened the span (the reply starts inside it);
    stateless, so the ``n`` completions of a request can share it."""

    def __init__(self, budget: int, end: str, tokenizer: Any, prompt_len: int) -> None:
        self.budget, self.end, self.tok, self.prompt_len = budget, end, tokenizer, prompt_len
        self.end_ids = list(tokenizer.encode(end, add_special_tokens=False))

    def __call__(self, token_ids: list[int], logits: Any) -> Any:
        out = token_ids[self.prompt_len:]
        if len(out) < self.budget or not self.end_ids:
            return logits
        if self.end in self.tok.decode(out):
            return logits  # the thinking has ended: the answer is free
        done = next((k for k in range(len(self.end_ids) - 1, 0, -1) if out[-k:] == self.end_ids[:k]), 0)
        forced = self.end_ids[done]
        value = logits[forced]
        logits[:] = float("-inf")
        logits[forced] = value if value > float("-inf") else 0.0
        return logits
