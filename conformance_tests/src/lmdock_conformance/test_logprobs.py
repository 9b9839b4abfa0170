"""Logprobs against the transformers float32 reference, within the backend's stated tolerance
(``BackendSpec.tolerances["logprobs"]``, default 1e-4)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from lmdock import SamplingParams


@pytest.mark.requires("logprobs")
def test_logprobs_of_generated_tokens(llm: Any, reference: dict, lmdock_setup: Any) -> None:
    n_prompt = len(reference["prompt_ids"])
    out = llm.generate(reference["prompt"], SamplingParams(temperature=0, max_new_tokens=20, logprobs=5))[0].outputs[0]
    assert len(out.logprobs) == 20
    for j, position in enumerate(out.logprobs):
        ref = reference["positions"][n_prompt - 1 + j]
        chosen = position[out.token_ids[j]]
        assert chosen.rank == 1
        assert abs(chosen.logprob - ref["logprob"]) <= lmdock_setup.tolerance
        ref_top = dict(ref["top"])
        for tok, lp in position.items():
            if tok in ref_top:
                assert abs(lp.logprob - ref_top[tok]) <= lmdock_setup.tolerance
        assert len(position) >= 5
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(out.logprobs, out.token_ids)), abs=1e-3)


@pytest.mark.requires("logprobs")
def test_logprob_token_strings_join_to_the_text(llm: Any, reference: dict) -> None:
    """Each generated token's ``decoded_token`` is the text it adds, so they join to the output's text
    (a SentencePiece token decoded alone loses its leading space), as vLLM's ``decoded_token``."""
    out = llm.generate(reference["prompt"], SamplingParams(temperature=0, max_new_tokens=24, logprobs=2))[0].outputs[0]
    strings = [position[token].decoded_token for position, token in zip(out.logprobs, out.token_ids)]
    assert " " in out.text and all(isinstance(s, str) for s in strings)
    assert "".join(strings) == out.text


@pytest.mark.requires("prompt_logprobs")
def test_prompt_logprobs(llm: Any, reference: dict, lmdock_setup: Any) -> None:
    ids = reference["prompt_ids"]
    out = llm.generate([ids], SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        assert abs(out.prompt_logprobs[i][ids[i]].logprob - reference["positions"][i - 1]["logprob"]) <= lmdock_setup.tolerance


@pytest.mark.requires("next_token_logprobs")
def test_next_token_logprobs(llm: Any, reference: dict, lmdock_setup: Any) -> None:
    prefixes = [item["prefix"] for item in reference["next_token"]]
    got = llm.batch_next_token_logprobs_sync(prefixes)
    for row, item in zip(got, reference["next_token"]):
        np.testing.assert_allclose(row, item["logprobs"], atol=lmdock_setup.tolerance)
    again = asyncio.run(llm.next_token_logprobs(prefixes[0]))
    np.testing.assert_allclose(again, got[0], atol=1e-6)
    llm.clear_cache()


@pytest.mark.requires("beam_search")
def test_beam_search_matches_transformers(llm: Any, reference: dict) -> None:
    out = llm.generate([reference["prompt_ids"]], SamplingParams(beam_width=4, max_new_tokens=30))[0]
    assert out.outputs[0].token_ids == reference["beam4_30"]
    # on this prompt 4 beams and greedy differ from the first token: ignoring beam_width cannot pass
    assert reference["beam_prompt_beam4_30"][0] != reference["beam_prompt_greedy_30"][0]
    out = llm.generate([reference["beam_prompt_ids"]], SamplingParams(beam_width=4, max_new_tokens=30))[0]
    assert out.outputs[0].token_ids == reference["beam_prompt_beam4_30"]
