"""``logit_bias``, ``allowed_token_ids`` and ``bad_words`` on step engines, with vLLM's semantics.

At submit (:func:`check_token_fields`, :func:`bad_words_ids`, in the caller's thread) the token ids
are checked against the vocabulary and each bad word is tokenized as vLLM tokenizes it: as written
(leading spaces stripped), and again after one space where that gives a word-initial token of the
same length.  At each step the reference sampler applies one :class:`TokenBias` per row that has
one, first and in vLLM's order: every token outside ``allowed_token_ids`` masked to ``-inf``; the
last token of each bad word masked where the output so far ends with the tokens before it;
``logit_bias`` added.  The logprobs a request gets are the model's own, computed before (as vLLM's
``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lmdock._plugin.errors import RequestError

if TYPE_CHECKING:
    from lmdock._config.sampling import SamplingParams

#: The most token sequences a request's bad words may become (vLLM's ``VLLM_MAX_NUM_BAD_WORDS``):
#: each is checked against the output at every step.
MAX_BAD_WORDS = 128


def check_token_fields(p: SamplingParams, vocab: int) -> None:
    """Refuse a ``logit_bias`` or ``allowed_token_ids`` token outside the vocabulary, by field."""
    for name, ids in (("logit_bias", p.logit_bias), ("allowed_token_ids", p.allowed_token_ids or ())):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")


def bad_words_ids(words: Sequence[str], tokenizer: Any, vocab: int) -> tuple[tuple[int, ...], ...]:
    """The token sequences that ``words`` ban (vLLM's ``SamplingParams.update_from_tokenizer``)."""
    if words and tokenizer is None:
        raise RequestError("bad_words: this engine was loaded without a tokenizer, which bad words need; ban token ids "
                           "with logit_bias {id: -100} instead")
    if len(words) > MAX_BAD_WORDS:  # each word is one sequence at least: refused before any tokenizing
        raise RequestError(f"bad_words: {len(words)} words; at most {MAX_BAD_WORDS} token sequences are checked")
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise RequestError(f"bad_words: {word!r} is no token at all; remove it")
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):  # the word after a space is other tokens
            out.append(spaced)
    if len(out) > MAX_BAD_WORDS:
        raise RequestError(f"bad_words: {len(words)} words are {len(out)} token sequences; at most {MAX_BAD_WORDS} are checked")
    bad = next((t for seq in out for t in seq if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"bad_words: the tokenizer gave token id {bad}, outside the model's vocabulary [0, {vocab})")
    return tuple(out)


class TokenBias:
    """One sequence's allowed tokens, bad words and logit bias, applied to its logits row."""

    def __init__(self, params: SamplingParams, bad_words: Sequence[Sequence[int]]) -> None:
        self.bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
        self.bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias))
        self.allowed = None if params.allowed_token_ids is None else np.asarray(params.allowed_token_ids, dtype=np.int64)
        self.bad_words = [(list(seq[:-1]), seq[-1]) for seq in bad_words]
        self._outside: np.ndarray | None = None  # the tokens allowed_token_ids leaves out, once per vocabulary size

    def apply(self, x: np.ndarray, token_ids: list[int], num_output: int) -> None:
        """In place on one float32 row; ``token_ids`` ends with the ``num_output`` generated tokens."""
        if self.allowed is not None:
            if self._outside is None or self._outside.shape[0] != x.shape[0]:
                self._outside = np.ones(x.shape[0], dtype=bool)
                self._outside[self.allowed] = False
            x[self._outside] = -np.inf
        for prefix, last in self.bad_words:
            k = len(prefix)
            if k == 0 or (k <= num_output and token_ids[len(token_ids) - k :] == prefix):
                x[last] = -np.inf
        if self.bias_ids.size:
            x[self.bias_ids] += self.bias_values
        if not np.isfinite(x).any():
            raise RequestError("allowed_token_ids and bad_words leave no token to generate next; allow more tokens")
