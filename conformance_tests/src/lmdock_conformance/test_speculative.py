"""Speculative decoding (issue 42): with it on, a backend gives the tokens it gives with it off.

Runs with n-gram speculation on an edit-like prompt (it repeats text already in the prompt, so drafts
are accepted), whatever ``--lmdock-speculative`` says; the rest of the suite runs with speculation on
when that option is given.  A step engine that cannot cut drafts back (no ``truncate``, or a recurrent
state) must run without speculation and say why in ``stats()``; a request engine passes the config to
its engine (vLLM) or refuses it at load."""

from __future__ import annotations

from typing import Any

import pytest
from lmdock import LmdockError, SamplingParams

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball.")
EDIT = [f"{STORY} {STORY} Once upon a time, there was", "Tom had a little dog. Tom had a little"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def spec_llm(lmdock_setup: Any) -> Any:
    try:
        engine = lmdock_setup.llm(speculative=NGRAM)
    except LmdockError as exc:  # refused at load: the error must say what to do
        assert "specul" in str(exc).lower(), f"a refusal of speculative decoding must name it: {exc}"
        pytest.skip(f"backend {lmdock_setup.backend!r} refuses speculative decoding: {exc}")
    yield engine
    engine.shutdown()


def _same(on: Any, off: Any, params: SamplingParams) -> None:
    a = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in on.generate(EDIT, params)]
    b = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in off.generate(EDIT, params)]
    assert a == b


def test_greedy_tokens_equal_speculation_off(spec_llm: Any, llm: Any) -> None:
    _same(spec_llm, llm, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    stats = spec_llm.engine.stats() if hasattr(spec_llm.engine, "stats") else {}
    if "spec_decode_num_drafts" in stats:  # the core's loop: it speculated, or says why it did not
        assert stats["spec_decode_num_accepted_tokens"] > 0 or stats["spec_decode_off"], stats


def test_seeded_sampling_is_reproducible_with_speculation(spec_llm: Any) -> None:
    params = SamplingParams(temperature=0.8, seed=1234, max_new_tokens=30, ignore_eos=True)
    try:
        first = [o.outputs[0].token_ids for o in spec_llm.generate(EDIT, params)]
    except LmdockError as exc:  # an engine whose speculation cannot reproduce seeds refuses them, saying so
        assert "seed" in str(exc) and "specul" in str(exc), f"a refusal must name seed and speculation: {exc}"
        pytest.skip(f"backend refuses seeded sampling with speculation: {exc}")
    assert first == [o.outputs[0].token_ids for o in spec_llm.generate(EDIT, params)]


def test_stops_and_lengths_inside_accepted_runs(spec_llm: Any, llm: Any) -> None:
    _same(spec_llm, llm, SamplingParams(temperature=0, max_new_tokens=50, stop=["park"]))
    _same(spec_llm, llm, SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True))


def test_speculation_leaves_no_state_behind(spec_llm: Any) -> None:
    import time

    spec_llm.generate(EDIT, SamplingParams(temperature=0, max_new_tokens=20))
    stats = getattr(spec_llm.engine, "stats", dict)()
    if "num_sequences_held" not in stats:
        return  # a request engine keeps its own books
    deadline = time.time() + 10
    while spec_llm.engine.stats()["num_sequences_held"] and time.time() < deadline:
        time.sleep(0.01)
    assert spec_llm.engine.stats()["num_sequences_held"] == 0
