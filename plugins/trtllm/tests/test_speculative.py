"""``[models.NAME.speculative]`` on lmdock-trtllm (issue 42): refused with the reason, because the
recorded TensorRT-LLM API says too little to translate it; TensorRT-LLM's own config passes through
``backends.trtllm.llm_args`` untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from contract import contract, fields
from lmdock import UnsupportedError
from lmdock._config.file import model_config
from lmdock_trtllm._translate import llm_kwargs


def _mc(method: str | None) -> object:
    mc = model_config({"model": "meta-llama/Llama-3.1-8B-Instruct"})
    if method is not None:  # the core's SpeculativeConfig, as ModelConfig.speculative holds it
        object.__setattr__(mc, "speculative", SimpleNamespace(method=method, num_speculative_tokens=4, model=None))
    return mc


def test_the_contract_records_speculative_config_without_its_members() -> None:
    """The fact the refusal rests on: when the contract records the members (NGramDecodingConfig,
    DraftTargetDecodingConfig...), this fails and the translation can be written and checked."""
    field = fields("LLM")["speculative_config"]
    assert "decoding_type" in field["doc"]
    recorded = {*contract()["classes"], *contract()["enums"]}
    assert not [c for c in recorded if c.endswith("DecodingConfig") or "Speculative" in c or "Draft" in c]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_is_refused_with_the_reason(method: str) -> None:
    for api in ("current", "legacy"):
        with pytest.raises(UnsupportedError, match=rf"speculative.method '{method}'.*llm_args = \{{speculative_config"):
            llm_kwargs(_mc(method), api)


def test_off_or_passed_through_as_tensorrt_llms_own() -> None:
    assert "speculative_config" not in llm_kwargs(_mc(None), "current")
    assert "speculative_config" not in llm_kwargs(_mc("none"), "current")
    own = {"decoding_type": "NGram", "max_draft_len": 4}
    assert llm_kwargs(_mc(None), "current", extra={"speculative_config": own})["speculative_config"] == own
