"""``/v1/embeddings`` in OpenAI's shapes, written by ``lmdock serve`` and ``lmdock batch`` alike (so
this module imports nothing of the server): a body's ``input`` as ``LLM.embed``'s prompts, and the
response body built from its outputs."""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any

#: OpenAI's ``encoding_format`` values: a list of floats, or the little-endian float32 bytes in base64.
ENCODING_FORMATS = ("float", "base64")


def embedding_prompts(inp: Any) -> list[Any]:
    """``input`` (a string, a list of strings, token ids, or a list of token-id lists) as a list of
    prompts, one embedding each; empty when ``input`` is (the caller refuses it, naming the field)."""
    if isinstance(inp, str) or (inp and all(isinstance(x, int) and not isinstance(x, bool) for x in inp)):
        return [inp]
    return list(inp)


def embeddings_response(outs: Sequence[Any], model: str, encoding_format: str = "float") -> dict[str, Any]:
    """The response body for ``LLM.embed``'s outputs: ``{"object": "list", "data", "model", "usage"}``."""
    data = []
    for i, o in enumerate(outs):
        vec = list(o.outputs.embedding)
        emb: Any = vec
        if encoding_format == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = sum(len(getattr(o, "prompt_token_ids", None) or []) for o in outs)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
