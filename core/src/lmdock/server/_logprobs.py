"""Logprobs in OpenAI's two shapes: the completions API's legacy lists and chat's per-token objects."""

from __future__ import annotations

from typing import Any


def _token_text(tok: Any, token_id: int, lp: Any) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token  # type: ignore[no-any-return]
    return tok.decode([token_id]) if tok is not None else str(token_id)


def legacy_logprobs(tok: Any, ids: list[int], positions: list[Any], offset: int) -> dict[str, Any]:
    """The completions API's ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, pos in zip(ids, positions):
        lp = pos.get(t) if pos else None
        text = _token_text(tok, t, lp)
        tokens.append(text)
        token_lps.append(lp.logprob if lp is not None else None)
        tops.append({_token_text(tok, k, v): v.logprob for k, v in pos.items()} if pos else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok: Any, ids: list[int], positions: list[Any], k: int) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: one object per token, with its ``k`` top alternatives."""
    content = []
    for t, pos in zip(ids, positions):
        lp = pos.get(t)
        text = _token_text(tok, t, lp)
        top = sorted(pos.items(), key=lambda kv: kv[1].rank or 0)[:k] if k else []
        content.append({
            "token": text, "logprob": lp.logprob if lp else None, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (s := _token_text(tok, i, v)), "logprob": v.logprob, "bytes": list(s.encode())} for i, v in top],
        })
    return content
