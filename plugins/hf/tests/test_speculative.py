"""Speculative decoding on lmdock-hf (issue 42): the real engine on stories260K, against speculation off
and against transformers' own ``generate`` (greedy, and its prompt lookup), with the n-gram proposer
and with a draft model that is the target itself (every draft accepted: every verify path runs)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lmdock import LLM, SamplingParams, StructuredOutput, UnsupportedError

NGRAM = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "disable_by_batch_size": None}
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball.")
EDIT = f"{STORY} {STORY} Once upon a time, there was"


@pytest.fixture(scope="module")
def spec_llm(stories: str) -> Any:
    with LLM(stories, backend="hf", speculative_config=NGRAM, scheduler={"max_num_seqs": 16}) as llm:
        yield llm


def tokens(llm: Any, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_with_ngram_speculation_is_transformers_greedy(spec_llm: Any, hf_model: Any) -> None:
    before = spec_llm.engine.stats()["spec_decode_num_accepted_tokens"]
    ids = spec_llm.get_tokenizer()(EDIT).input_ids
    ours = spec_llm.generate([ids], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False)[0].tolist()[len(ids):]
        lookup = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                   prompt_lookup_num_tokens=10)[0].tolist()[len(ids):]
    assert ours == ref == lookup
    assert spec_llm.engine.stats()["spec_decode_num_accepted_tokens"] - before >= 10  # the story is copied


def test_seeded_sampling_is_reproducible_and_equal_to_speculation_off(spec_llm: Any, llm: Any) -> None:
    params = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=40, ignore_eos=True, n=2)
    prompts = [EDIT, "Tom had a dog"]
    on = [[c.token_ids for c in o.outputs] for o in spec_llm.generate(prompts, params)]
    again = [[c.token_ids for c in o.outputs] for o in spec_llm.generate(prompts, params)]
    off = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    assert on == again == off


def test_logprobs_stops_and_penalties_match_speculation_off(spec_llm: Any, llm: Any) -> None:
    cases = [
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0, max_tokens=60, stop=["park"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=60, repetition_penalty=1.2, presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=7),
    ]
    for params in cases:
        on = spec_llm.generate([EDIT], params)[0].outputs[0]
        off = llm.generate([EDIT], params)[0].outputs[0]
        assert (on.token_ids, on.text, on.finish_reason, on.stop_reason) == (off.token_ids, off.text, off.finish_reason, off.stop_reason)
        if params.logprobs is not None:
            for a, b in zip(on.logprobs, off.logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_structured_output_matches_speculation_off(spec_llm: Any, llm: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_output=StructuredOutput(regex=r"(Lily|Tom) (saw|had) a (big|red|little) [a-z]+\."))
    on = spec_llm.generate([EDIT], params)[0].outputs[0]
    off = llm.generate([EDIT], params)[0].outputs[0]
    assert on.token_ids == off.token_ids and on.finish_reason == "stop"


def test_a_draft_model_that_is_the_target_accepts_every_draft(stories: str, llm: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(stories, backend="hf", speculative_config={"method": "draft", "model": stories, "num_speculative_tokens": 4,
                                                                       "disable_by_batch_size": None}) as draft:
        on = tokens(draft, ["Once upon a time", "Tom had a dog"], params)
        stats = draft.engine.stats()
        assert stats["spec_decode_num_draft_tokens"] > 0
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
        assert draft.engine.engine.num_sequences() == stats["num_sequences_cached"]
        # the draft releases its own state too, in the loop iteration after the one that reported
        deadline = time.time() + 10
        while draft.engine.spec.proposer.engine.num_sequences() and time.time() < deadline:
            time.sleep(0.01)
        assert draft.engine.spec.proposer.engine.num_sequences() == 0
    assert on == tokens(llm, ["Once upon a time", "Tom had a dog"], params)


def test_a_recurrent_model_runs_without_speculation_and_says_why(stories: str, tmp_path: Path) -> None:
    from families import build

    built = (build(f, tmp_path, Path(stories)) for f in ("lfm2", "bamba", "falcon_h1"))
    path = next((p for p in built if p is not None), None)
    if path is None:
        pytest.fail("this transformers knows none of lfm2, bamba, falcon_h1")
    from lmdock_hf._family import states_api

    if not states_api():  # transformers < 5.21: lmdock-hf refuses hybrids at load, saying so
        with pytest.raises(UnsupportedError, match=r"lacks 'recurrent_state'.*transformers>=5\.21"):
            LLM(str(path), backend="hf", speculative_config=NGRAM)
        return
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(str(path), backend="hf") as off:
        ref = tokens(off, [EDIT], params)
    with LLM(str(path), backend="hf", speculative_config=NGRAM) as on:
        assert tokens(on, [EDIT], params) == ref
        stats = on.engine.stats()
        assert stats["spec_decode_num_drafts"] == 0 and "recurrent" in stats["spec_decode_off"]


def test_a_windowed_model_keeps_its_tokens_with_speculation(stories: str, tmp_path: Path) -> None:
    """Sliding-window layers (window 16) keep only their window (a ring, lmdock_hf._window): drafts would
    overwrite positions the window still needs, so such a model runs without speculation, says why, and
    gives the same tokens."""
    from families import build

    path = build("mistral", tmp_path, Path(stories))
    assert path is not None
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(str(path), backend="hf") as off:
        ref = tokens(off, [EDIT, "Lily"], params)
    with LLM(str(path), backend="hf", speculative_config=NGRAM) as on:
        assert tokens(on, [EDIT, "Lily"], params) == ref
        stats = on.engine.stats()
        assert stats["spec_decode_num_drafts"] == 0 and "sliding-window ring" in stats["spec_decode_off"]
