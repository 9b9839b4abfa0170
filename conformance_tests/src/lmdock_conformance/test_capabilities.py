"""Capabilities that only some backends have: quantization (embeddings and scoring: test_pooling.py)."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from lmdock import LmdockError, QuantConfig, SamplingParams

ALGOS = [a for a in typing.get_args(typing.get_type_hints(QuantConfig)["algo"]) if a != "none"]


@pytest.mark.parametrize("algo", ALGOS)
def test_quantization_is_honoured_within_tolerance_or_refused(lmdock_setup: Any, reference: dict, algo: str) -> None:
    """Either a clear refusal that names the algorithm, or logprobs within the declared tolerance."""
    try:
        engine = lmdock_setup.llm(quantization={"algo": algo})
    except LmdockError as exc:
        assert algo in str(exc), f"the refusal should name {algo!r}: {exc}"
        return
    tolerance = lmdock_setup.spec.tolerances.get(algo)
    assert tolerance is not None, f"backend honours {algo!r} but declares no tolerances[{algo!r}]"
    with engine:
        out = engine.generate([reference["prompt_ids"]], SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0))[0]
    for i, ids in enumerate(reference["prompt_ids"][1:], start=1):
        assert abs(out.prompt_logprobs[i][ids].logprob - reference["positions"][i - 1]["logprob"]) <= tolerance
