"""Generation against the recorded reference, and the SamplingParams semantics."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from lmdock import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=40)
PROMPTS = ["Once upon a time", "The cat", "Lily and Tom", "One day", "The sun was", "A little dog", "Tim had a", "In the park"]


def test_greedy_reference_tokens(llm: Any, reference: dict) -> None:
    out = llm.generate(reference["prompt"], GREEDY)[0]
    assert out.prompt_token_ids == reference["prompt_ids"]
    assert out.outputs[0].token_ids == reference["greedy_40"]


def test_greedy_reference_text(llm: Any, reference: dict) -> None:
    assert llm.generate(reference["prompt"], GREEDY)[0].outputs[0].text == reference["greedy_40_text"]


def test_token_id_prompt_equals_text_prompt(llm: Any, reference: dict) -> None:
    out = llm.generate([reference["prompt_ids"]], GREEDY)[0]
    assert out.prompt is None
    assert out.outputs[0].token_ids == reference["greedy_40"]


def test_batched_equals_one_by_one(llm: Any) -> None:
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=24))]
    alone = [llm.generate(p, SamplingParams(temperature=0, max_new_tokens=24))[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone


def test_outputs_keep_prompt_order(llm: Any) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=4))
    assert [o.prompt for o in outs] == PROMPTS


def test_max_new_tokens(llm: Any) -> None:
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=7))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_string_cuts_text(llm: Any, reference: dict) -> None:
    out = llm.generate(reference["prompt"], SamplingParams(temperature=0, max_new_tokens=40, stop=["Lily"]))[0].outputs[0]
    full = reference["greedy_40_text"]
    assert out.text == full[: full.index("Lily")]
    assert (out.finish_reason, out.stop_reason) == ("stop", "Lily")


def test_stop_string_spanning_tokens(llm: Any, reference: dict) -> None:
    full = reference["greedy_40_text"]
    stop = "girl nam"  # ends inside the token for "named"
    out = llm.generate(reference["prompt"], SamplingParams(temperature=0, max_new_tokens=40, stop=[stop]))[0].outputs[0]
    assert out.text == full[: full.index(stop)] and out.stop_reason == stop
    kept = llm.generate(reference["prompt"], SamplingParams(temperature=0, max_new_tokens=40, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids(llm: Any, reference: dict) -> None:
    target = reference["greedy_40"][5]
    out = llm.generate(reference["prompt"], SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=[target]))[0].outputs[0]
    assert out.token_ids == reference["greedy_40"][:6]
    assert (out.finish_reason, out.stop_reason) == ("stop", target)


def test_min_new_tokens_and_ignore_eos(llm: Any, reference: dict) -> None:
    eos = reference["eos"]
    long = llm.generate(reference["prompt"], SamplingParams(temperature=0, max_new_tokens=300, ignore_eos=True))[0].outputs[0]
    assert len(long.token_ids) == 300 and long.finish_reason == "length"
    if eos in long.token_ids:  # greedy reaches EOS: min_new_tokens must hold it off
        first = long.token_ids.index(eos)
        out = llm.generate(reference["prompt"], SamplingParams(temperature=0, max_new_tokens=300, min_new_tokens=first + 3))[0].outputs[0]
        assert eos not in out.token_ids[: first + 3]
    stopped = llm.generate(reference["prompt"], SamplingParams(temperature=0, max_new_tokens=300))[0].outputs[0]
    if eos in long.token_ids:
        assert stopped.token_ids[-1] == eos and stopped.finish_reason == "stop"


def test_temperature_zero_and_top_k_one_are_greedy(llm: Any, reference: dict) -> None:
    for params in (SamplingParams(temperature=0, max_new_tokens=40), SamplingParams(top_k=1, temperature=0.9, seed=3, max_new_tokens=40)):
        assert llm.generate(reference["prompt"], params)[0].outputs[0].token_ids == reference["greedy_40"]


def test_seed_reproducibility(llm: Any) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_new_tokens=30)
    a = llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    b = llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    assert a == b
    others = {tuple(llm.generate("Once upon a time", params.replace(seed=s))[0].outputs[0].token_ids) for s in range(5)}
    assert len(others) > 1, "different seeds should give different samples"


def test_seeded_samples_do_not_depend_on_the_batch(llm: Any) -> None:
    params = SamplingParams(temperature=0.8, seed=99, max_new_tokens=20)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_n_completions(llm: Any) -> None:
    out = llm.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, seed=5, max_new_tokens=10))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)


@pytest.mark.requires("sampling")
def test_first_token_distribution_matches_reference(llm: Any, reference: dict) -> None:
    """Chi-square of 2,000 seeded first-token draws at temperature 1 against the recorded softmax."""
    import math

    import numpy as np

    probs = np.exp(np.array(reference["next_token"][0]["logprobs"]))
    top = np.argsort(-probs)[:6]
    counts = np.zeros(len(top) + 1)
    draws = 0
    for seed in range(40):
        out = llm.generate([reference["prompt_ids"]], SamplingParams(n=50, temperature=1.0, seed=seed, max_new_tokens=1))[0]
        for c in out.outputs:
            t = c.token_ids[0]
            counts[list(top).index(t) if t in top else len(top)] += 1
            draws += 1
    expected = np.append(probs[top], 1 - probs[top].sum()) * draws
    keep = expected >= 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3  # p = 0.001
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: counts {counts}, expected {expected.round(1)}"


@pytest.mark.requires("structured_output")
def test_structured_output_constrains_the_text(llm: Any) -> None:
    choice = SamplingParams(temperature=1.0, seed=3, max_new_tokens=8, structured_output={"choice": ["cat", "dog", "park"]})
    texts = {llm.generate("Once upon a time", choice.replace(seed=s))[0].outputs[0].text for s in range(6)}
    assert texts <= {"cat", "dog", "park"}
    regex = SamplingParams(temperature=1.0, seed=4, max_new_tokens=16, structured_output={"regex": "[a-z]{3} [a-z]{3}"})
    out = llm.generate("Once upon a time", regex)[0].outputs[0]
    assert re.fullmatch("[a-z]{3} [a-z]{3}", out.text), out.text
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=24, structured_output={"json": schema}))[0].outputs[0]
    if out.finish_reason == "stop":  # a small model may not close the object within the budget
        assert isinstance(json.loads(out.text)["n"], int)
    assert out.text.lstrip().startswith("{")
