"""``logit_bias``, ``allowed_token_ids`` and ``bad_words`` (capability ``logit_bias``), with OpenAI's
and vLLM's meanings: a bias is added to the token's logit (-100 bans it, +100 makes it the greedy
choice), every generated token is one of ``allowed_token_ids``, a bad word's tokens never come out;
the logprobs reported are the model's own, before any bias; batched rows equal rows alone."""

from __future__ import annotations

from typing import Any

import pytest
from lmdock import LmdockError, SamplingParams

pytestmark = pytest.mark.requires("logit_bias")

PROMPT = "Once upon a time"


def _greedy(**extra: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_new_tokens": 40, **extra})


def _tokens(llm: Any, params: SamplingParams, prompt: str = PROMPT) -> list[int]:
    return list(llm.generate(prompt, params)[0].outputs[0].token_ids)


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_a_bias_of_minus_100_bans_the_token(llm: Any, reference: dict) -> None:
    first = reference["greedy_40"][0]
    out = _tokens(llm, _greedy(logit_bias={first: -100}))
    assert out != reference["greedy_40"] and first not in out


def test_a_bias_of_plus_100_makes_the_token_the_greedy_choice(llm: Any) -> None:
    plain = _tokens(llm, _greedy(max_new_tokens=8))
    forced = next(t for t in range(3, 500) if t not in plain)  # a token greedy decoding never picks here
    assert _tokens(llm, _greedy(max_new_tokens=8, logit_bias={str(forced): 100})) == [forced] * 8  # a JSON key: a string


def test_allowed_token_ids_restrict_every_token(llm: Any, reference: dict) -> None:
    allowed = sorted({*reference["greedy_40"][1:12]} - {reference["greedy_40"][0]})
    greedy, sampled = llm.generate([PROMPT, PROMPT], [_greedy(allowed_token_ids=allowed),
                                                       SamplingParams(temperature=1.0, seed=11, n=3, max_new_tokens=30, allowed_token_ids=allowed)])
    assert greedy.outputs[0].token_ids != reference["greedy_40"]
    for c in [*greedy.outputs, *sampled.outputs]:
        assert len(c.token_ids) > 0 and set(c.token_ids) <= set(allowed), c.token_ids


def test_bad_words_never_appear(llm: Any, reference: dict) -> None:
    words = ["Lily", "park", " girl"]
    assert all(w.strip() in reference["greedy_40_text"] for w in words)
    outs = llm.generate([PROMPT] * (len(words) + 1), [_greedy(bad_words=[w]) for w in words] + [_greedy(bad_words=words)])
    for word, out in zip([*words, None], outs):
        c = out.outputs[0]
        banned = words if word is None else [word]
        assert c.token_ids != reference["greedy_40"]
        for w in banned:
            assert w.strip() not in c.text, (w, c.text)
            for form in (w.strip(), " " + w.strip()):
                assert not _contains(list(c.token_ids), llm.tokenizer.encode(form, add_special_tokens=False)), (form, c.text)


def test_logprobs_are_the_models_own_before_the_bias(llm: Any, lmdock_setup: Any) -> None:
    plain = llm.generate(PROMPT, _greedy(max_new_tokens=1, logprobs=5))[0].outputs[0]
    second = next(t for t, lp in plain.logprobs[0].items() if lp.rank == 2)
    biased = llm.generate(PROMPT, _greedy(max_new_tokens=1, logprobs=5, logit_bias={second: 100}))[0].outputs[0]
    assert biased.token_ids == [second]
    got = biased.logprobs[0][second]
    assert got.rank == 2 and got.logprob == pytest.approx(plain.logprobs[0][second].logprob, abs=lmdock_setup.tolerance)


def test_biased_rows_batched_equal_rows_alone(llm: Any, reference: dict) -> None:
    first = reference["greedy_40"][0]
    params = [_greedy(max_new_tokens=16), _greedy(max_new_tokens=16, logit_bias={first: -100}),
              _greedy(max_new_tokens=16, allowed_token_ids=reference["greedy_40"][1:9]), _greedy(max_new_tokens=16, bad_words=["girl"]),
              SamplingParams(temperature=0.8, seed=5, max_new_tokens=16, logit_bias={first: -5, 261: 3})]
    batched = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * len(params), params)]
    alone = [_tokens(llm, p) for p in params]
    assert batched == alone
    assert len({tuple(t) for t in batched}) == len(params)  # each setting changed the output


@pytest.mark.parametrize(("field", "value"), [("logit_bias", {10**6: 1.0}), ("allowed_token_ids", [5, 10**6])])
def test_a_token_outside_the_vocabulary_is_refused_naming_the_field(llm: Any, field: str, value: Any) -> None:
    with pytest.raises(LmdockError, match=field):
        llm.generate(PROMPT, _greedy(max_new_tokens=2, **{field: value}))


@pytest.mark.requires("beam_search")
@pytest.mark.parametrize(("field", "value"), [("logit_bias", {5: 1.0}), ("allowed_token_ids", [5, 6]), ("bad_words", ["park"])])
def test_beam_search_refuses_them_by_name(llm: Any, field: str, value: Any) -> None:
    with pytest.raises(LmdockError, match=field):
        llm.generate(PROMPT, SamplingParams(beam_width=2, temperature=0, max_new_tokens=4, **{field: value}))
