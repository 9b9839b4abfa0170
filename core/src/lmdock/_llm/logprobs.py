"""Logprobs in OpenAI's two shapes: the completions API's legacy lists and chat's per-token objects,
written by ``lmdock serve`` and ``lmdock batch`` alike (so this module imports nothing of the server).

A token's string is the text it adds after the tokens before it, so the strings join to the text
(SentencePiece writes a word's leading space as part of the token, and decoding a token alone drops
it: ``' You can'`` came out as ``['', 'Y', 'ou', 'c', 'an']``).  Each is the difference between
decoding a short window of preceding tokens with and without it, as the core's detokenizer does; an
engine's own ``decoded_token`` (vLLM's) is used as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

WINDOW = 4  # preceding tokens decoded with each one (enough for a SentencePiece space or a split character)


class _InContext:
    """Token strings as the text each adds, walking a sequence's tokens in order."""

    def __init__(self, tok: Any, context: Sequence[int]) -> None:
        self.tok = tok
        self.window = list(context[-WINDOW:])

    def text(self, token_id: int, lp: Any = None) -> str:
        """``token_id``'s text after the current window (the window does not move)."""
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token  # type: ignore[no-any-return]
        if self.tok is None:
            return str(token_id)
        before = self.tok.decode(self.window, skip_special_tokens=True) if self.window else ""
        after = self.tok.decode([*self.window, token_id], skip_special_tokens=True)
        return after[len(before):] if after.startswith(before) else self.tok.decode([token_id], skip_special_tokens=True)

    def advance(self, token_id: int) -> None:
        self.window = [*self.window, token_id][-WINDOW:]


def legacy_logprobs(tok: Any, ids: list[int], positions: list[Any], offset: int, context: Sequence[int] = ()) -> dict[str, Any]:
    """The completions API's ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset.
    ``context``: the token ids before ``ids`` (the prompt, and output already sent)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    walk = _InContext(tok, context)
    for t, pos in zip(ids, positions):
        lp = pos.get(t) if pos else None
        text = walk.text(t, lp)
        tokens.append(text)
        token_lps.append(lp.logprob if lp is not None else None)
        tops.append({walk.text(k, v): v.logprob for k, v in pos.items()} if pos else None)
        offsets.append(offset)
        offset += len(text)
        walk.advance(t)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok: Any, ids: list[int], positions: list[Any], k: int, context: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: one object per token, with its ``k`` top alternatives (``bytes``:
    the UTF-8 of the token's text, as OpenAI sends it)."""
    content = []
    walk = _InContext(tok, context)
    for t, pos in zip(ids, positions):
        lp = pos.get(t)
        text = walk.text(t, lp)
        top = sorted(pos.items(), key=lambda kv: kv[1].rank or 0)[:k] if k else []
        content.append({
            "token": text, "logprob": lp.logprob if lp else None, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (s := walk.text(i, v)), "logprob": v.logprob, "bytes": list(s.encode())} for i, v in top],
        })
        walk.advance(t)
    return content
