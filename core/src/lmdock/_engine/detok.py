"""Incremental detokenization (stop strings: ``stops.py``).

Decoding token by token breaks words that span tokens (SentencePiece's leading-space marker) and
multi-byte characters split across byte tokens.  Like vLLM, each step decodes a short window twice,
with and without the newest tokens, and emits the difference only when it does not end in U+FFFD
(an incomplete UTF-8 sequence): a stream never shows a broken character.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from lmdock._llm.tokenizer import Tokenizer

_CONTEXT = 6  # prompt tokens kept as left context, so the first output word keeps its spacing
#: transformers' fast-tokenizer decode methods that only call the Rust tokenizer (then clean up
#: spaces, when asked): the detokenizer calls the Rust tokenizer itself, twice per token, and skips
#: about 10 us of Python argument handling per call.
_PLAIN_DECODERS = ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")


def fast_decode(tokenizer: Tokenizer) -> Callable[[Sequence[int], bool], str]:
    """``tokenizer.decode``, or the Rust ``tokenizers`` decode under it where that is the same thing."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    method = getattr(type(tokenizer), "_decode", None)
    if (
        backend is not None
        and hasattr(backend, "decode")
        and getattr(method, "__qualname__", "") in _PLAIN_DECODERS
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    ):
        return lambda ids, skip: backend.decode(list(ids), skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


#: ``decode([token])`` per tokenizer and skip flag.  Once a token's text is out, the next step's
#: "before" window is that one token: one of the two decodes per token becomes a lookup.
_SINGLES: weakref.WeakKeyDictionary[Any, dict[bool, dict[int, str]]] = weakref.WeakKeyDictionary()


def _singles(tokenizer: Tokenizer, skip: bool) -> dict[int, str]:
    try:
        per_skip = _SINGLES.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: this detokenizer keeps its own
        return {}
    return per_skip.setdefault(skip, {})


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._decode = fast_decode(tokenizer)
        self._skip = skip_special_tokens
        self._single = _singles(tokenizer, skip_special_tokens)
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be empty)."""
        ids = self._ids
        ids.append(token_id)
        if self._read - self._prefix == 1:
            before = self._single.get(ids[self._prefix])
            if before is None:
                before = self._single[ids[self._prefix]] = self._decode(ids[self._prefix : self._read], self._skip)
        else:
            before = self._decode(ids[self._prefix : self._read], self._skip)
        after = self._decode(ids[self._prefix :], self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
