"""lmdock._engine.biases: ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` with vLLM's semantics, on
one logits row at a time (the reference sampler calls the same ``TokenBias.apply``)."""

from __future__ import annotations

import numpy as np
import pytest
from lmdock import RequestError, SamplingParams
from lmdock._engine.biases import MAX_BAD_WORDS, TokenBias, bad_words_ids, check_token_fields


class CharTokenizer:
    """A FAKE tokenizer: one token per character (its code point), and a leading space is a token of its
    own unless the word starts with "x", where " x" is token 200 (a word-initial token, as BPE makes)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if text.startswith(" x"):
            return [200, *(ord(c) for c in text[2:])]
        return [ord(c) for c in text]


def row(vocab: int = 256) -> np.ndarray:
    return np.zeros(vocab, dtype=np.float32)


def test_logit_bias_is_added_to_the_named_tokens() -> None:
    x = row()
    TokenBias(SamplingParams(logit_bias={5: 2.5, 7: -100}), ()).apply(x, [], 0)
    assert x[5] == 2.5 and x[7] == -100 and x[6] == 0


def test_allowed_token_ids_mask_every_other_token() -> None:
    x = row()
    TokenBias(SamplingParams(allowed_token_ids=[3, 4]), ()).apply(x, [], 0)
    assert np.isfinite(x).nonzero()[0].tolist() == [3, 4]


def test_a_bad_word_is_banned_only_where_the_output_ends_with_its_prefix() -> None:
    bias = TokenBias(SamplingParams(), [(10, 11, 12)])
    x = row()
    bias.apply(x, [1, 2, 10, 11], num_output=2)  # the output so far ends with 10, 11: 12 would finish the word
    assert x[12] == -np.inf
    x = row()
    bias.apply(x, [10, 11, 1], num_output=1)  # 10, 11 are prompt tokens here, not output
    assert np.isfinite(x).all()


def test_a_single_token_bad_word_is_always_banned() -> None:
    x = row()
    TokenBias(SamplingParams(), [(9,)]).apply(x, [], 0)
    assert x[9] == -np.inf


def test_nothing_left_to_generate_is_a_request_error() -> None:
    with pytest.raises(RequestError, match="no token to generate"):
        TokenBias(SamplingParams(allowed_token_ids=[3]), [(3,)]).apply(row(), [], 0)


def test_bad_words_are_tokenized_as_written_and_after_a_space_where_that_differs() -> None:
    tok = CharTokenizer()
    assert bad_words_ids(["ab"], tok, 256) == ((97, 98),)  # " ab" is 3 tokens: not the same word
    assert bad_words_ids(["xy"], tok, 256) == ((120, 121), (200, 121))  # " xy" is word-initial token 200


@pytest.mark.parametrize(("words", "vocab", "says"), [
    (["ok"] * (MAX_BAD_WORDS + 1), 256, f"at most {MAX_BAD_WORDS}"),
    ([" "], 256, "no token at all"),
    (["ab"], 98, "outside the model's vocabulary"),
])
def test_bad_words_refusals_name_the_field(words: list[str], vocab: int, says: str) -> None:
    with pytest.raises(RequestError, match=says) as exc:
        bad_words_ids(words, CharTokenizer(), vocab)
    assert str(exc.value).startswith("bad_words")


def test_bad_words_need_a_tokenizer() -> None:
    with pytest.raises(RequestError, match="without a tokenizer"):
        bad_words_ids(["a"], None, 256)


def test_token_ids_outside_the_vocabulary_are_refused_by_field() -> None:
    with pytest.raises(RequestError, match="logit_bias: token id 300"):
        check_token_fields(SamplingParams(logit_bias={300: 1}), 256)
    with pytest.raises(RequestError, match="allowed_token_ids: token id 256"):
        check_token_fields(SamplingParams(allowed_token_ids=[1, 256]), 256)
    check_token_fields(SamplingParams(logit_bias={255: 1}, allowed_token_ids=[0]), 256)
