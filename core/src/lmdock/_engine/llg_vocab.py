"""A Hugging Face tokenizer's JSON as llguidance should read it: its added tokens that are *not*
special (Qwen2.5's and Qwen3's ``<tool_call>``, ``</tool_call>``, ``<think>``, ``</think>``) are text.

llguidance (1.9) takes every entry of ``added_tokens`` for a special token, which no grammar's text
can match: under a forced tool call that is a refusal ("token ... does not fit the grammar ... forced
bytes: got '<'"), and under ``auto`` the lazy grammar never sees its trigger.  The tokenizer itself
treats them as text (they decode as text, ``skip_special_tokens`` keeps them), so here each one moves
into the model's vocabulary under its own id, spelled as the vocabulary spells text: byte-level BPE
(GPT-2's byte-to-character map) or SentencePiece-style BPE (``▁`` for a space).  Other models'
vocabularies (Unigram, WordPiece) are left as they are.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any


@cache
def _byte_chars() -> dict[int, str]:
    """GPT-2's map of bytes to the printable characters byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level(tok: dict[str, Any]) -> bool:
    parts = [tok.get("pre_tokenizer"), tok.get("decoder")]
    for part in list(parts):
        if isinstance(part, dict):
            parts += part.get("pretokenizers") or part.get("decoders") or []
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


def added_tokens_as_text(tokenizer_json: str) -> str:
    """``tokenizer_json`` with its non-special added tokens moved into a BPE vocabulary (unchanged
    when there are none, or the model is no BPE)."""
    tok = json.loads(tokenizer_json)
    model = tok.get("model") or {}
    plain = [a for a in tok.get("added_tokens") or () if not a.get("special")]
    if not plain or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return tokenizer_json
    byte_level = _byte_level(tok)
    moved = set()
    for added in plain:
        text = added["content"]
        spelled = "".join(_byte_chars()[b] for b in text.encode()) if byte_level else text.replace(" ", "\u2581")
        # a token spelled as an entry the vocabulary already has (an added "\n" beside the byte token
        # for it) cannot move in under its own id: the vocabulary would lose that id, and llguidance
        # would number the tokens after it wrongly; such a token stays where it was
        if spelled not in model["vocab"]:
            model["vocab"][spelled] = added["id"]
            moved.add(added["id"])
    tok["added_tokens"] = [a for a in tok["added_tokens"] if a["id"] not in moved]
    return json.dumps(tok)
