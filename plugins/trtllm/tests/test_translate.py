"""lmdock-trtllm's translation against the recorded TensorRT-LLM API (no tensorrt_llm needed)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
from contract import check_kwargs, contract, enum_members, fields
from hypothesis import given, settings
from hypothesis import strategies as st
from lmdock import LLM, BackendError, QuantConfig, SamplingParams, UnsupportedError
from lmdock._config.file import model_config
from lmdock_trtllm._refs import ConfigRef, EnumRef, TensorRef
from lmdock_trtllm._translate import (
    LEGACY_KV_QUANT,
    LEGACY_QUANT_ALGOS,
    SCHEDULER_POLICIES,
    llm_kwargs,
    quant_config,
    sampling_kwargs,
)

ALGOS = [a for a in typing.get_args(typing.get_type_hints(QuantConfig)["algo"])]
KV_DTYPES = ["auto", "float32", "float16", "bfloat16", "fp8", "int8"]


def mc(**sections: Any):  # type: ignore[no-untyped-def]
    return model_config({"model": "meta-llama/Llama-3.1-8B-Instruct", **sections})


# -- the contract checker itself can fail -------------------------------------------------------


def test_checker_rejects_what_tensorrt_llm_would_reject() -> None:
    with pytest.raises(AssertionError, match="no argument 'beam_width'"):
        check_kwargs("SamplingParams", {"beam_width": 4})
    with pytest.raises(AssertionError, match="no argument 'build_config'"):
        check_kwargs("LLM", {"build_config": ConfigRef("BuildConfig", {})})
    with pytest.raises(AssertionError, match="does not fit"):
        check_kwargs("SamplingParams", {"top_k": 0.5})
    with pytest.raises(AssertionError, match="does not fit"):
        check_kwargs("QuantConfig", {"quant_algo": EnumRef("QuantAlgo", "INT3")})
    with pytest.raises(AssertionError, match="does not fit"):
        check_kwargs("SchedulerConfig", {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"})  # a str, not the enum


def test_recorded_facts_the_translation_relies_on() -> None:
    assert "build_config" not in fields("LLM") and "quant_config" not in fields("LLM")
    assert {"build_config", "quant_config"} <= set(fields("LLM", "legacy"))
    assert "use_beam_search" in fields("SamplingParams") and "beam_width" not in fields("SamplingParams")
    assert set(LEGACY_QUANT_ALGOS.values()) | set(LEGACY_KV_QUANT.values()) <= set(enum_members("QuantAlgo"))
    assert set(LEGACY_KV_QUANT.values()) <= set(contract()["enums"]["QuantAlgo"]["kv_cache_quant_algo_list"])
    for capacity, waiting in SCHEDULER_POLICIES.values():
        assert capacity in enum_members("CapacitySchedulerPolicy") and waiting in enum_members("WaitingQueuePolicy")


# -- LLM constructor ----------------------------------------------------------------------------


def test_default_llm_kwargs_current_api() -> None:
    kwargs = llm_kwargs(mc(), "current")
    check_kwargs("LLM", kwargs)
    assert kwargs["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert kwargs["kv_cache_config"].kwargs["enable_block_reuse"] is True
    assert kwargs["scheduler_config"].kwargs["capacity_scheduler_policy"] == EnumRef("CapacitySchedulerPolicy", "GUARANTEED_NO_EVICT")


def test_limits_parallelism_and_ray() -> None:
    m = mc(build={"max_batch_size": 64, "max_num_tokens": 4096, "max_seq_len": 8192, "max_beam_width": 4, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "distributed_executor": "ray"},
           kv_cache={"memory_fraction": 0.8, "max_tokens": 100000, "cpu_space_gib": 4, "dtype": "fp8", "enable_prefix_caching": False})
    kwargs = llm_kwargs(m, "current")
    check_kwargs("LLM", kwargs)
    assert (kwargs["max_batch_size"], kwargs["max_num_tokens"], kwargs["max_seq_len"], kwargs["max_beam_width"]) == (64, 4096, 8192, 4)
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"], kwargs["orchestrator_type"]) == (2, 2, "ray")
    kv = kwargs["kv_cache_config"].kwargs
    assert kv == {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.8, "max_tokens": 100000, "host_cache_size": 4 * 2**30, "dtype": "fp8"}


def test_legacy_api_uses_build_config_and_quant_config() -> None:
    m = mc(build={"max_batch_size": 16, "max_seq_len": 4096, "max_beam_width": 2}, quantization={"algo": "awq", "group_size": 64}, kv_cache={"dtype": "int8"})
    kwargs = llm_kwargs(m, "legacy")
    check_kwargs("LLM", kwargs, "legacy")
    assert kwargs["build_config"] == ConfigRef("BuildConfig", {"max_batch_size": 16, "max_beam_width": 2, "max_num_tokens": 2048, "max_seq_len": 4096})
    assert kwargs["quant_config"] == ConfigRef("QuantConfig", {"quant_algo": EnumRef("QuantAlgo", "W4A16_AWQ"), "group_size": 64, "kv_cache_quant_algo": EnumRef("QuantAlgo", "INT8")})


@pytest.mark.parametrize("algo", [a for a in ALGOS if a != "none"])
def test_quantization_on_the_current_api_needs_a_prequantized_checkpoint(algo: str) -> None:
    with pytest.raises(UnsupportedError, match=rf"quantization '{algo}'.*checkpoint_prequantized"):
        llm_kwargs(mc(quantization={"algo": algo}), "current")
    check_kwargs("LLM", llm_kwargs(mc(quantization={"algo": algo, "checkpoint_prequantized": True}), "current"))


def test_legacy_refuses_what_has_no_quant_algo() -> None:
    with pytest.raises(UnsupportedError, match="'int8_dynamic' has no TensorRT-LLM QuantAlgo"):
        quant_config(QuantConfig(algo="int8_dynamic"), "auto", "legacy")


def test_other_refusals_name_the_setting() -> None:
    with pytest.raises(UnsupportedError, match="kv_cache.dtype 'int8'"):
        llm_kwargs(mc(kv_cache={"dtype": "int8"}), "current")
    with pytest.raises(UnsupportedError, match="build.device 'cpu'"):
        llm_kwargs(mc(build={"device": "cpu"}), "current")
    with pytest.raises(UnsupportedError, match="scheduler.policy 'lottery'"):
        llm_kwargs(mc(scheduler={"policy": "lottery"}), "current")


# -- SamplingParams -----------------------------------------------------------------------------


def test_every_sampling_field_is_translated() -> None:
    p = SamplingParams(n=2, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.25,
                       repetition_penalty=1.1, max_new_tokens=64, min_new_tokens=4, ignore_eos=True, stop=["###"],
                       stop_token_ids=[7], include_stop_str_in_output=True, detokenize=False, skip_special_tokens=False,
                       seed=3, logprobs=5, prompt_logprobs=2)
    kwargs = sampling_kwargs(p, prompt_len=10, max_seq_len=4096)
    check_kwargs("SamplingParams", kwargs)
    assert kwargs == {
        "max_tokens": 64, "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "presence_penalty": 0.25, "frequency_penalty": 0.5, "prompt_ignore_length": 10,
        "min_tokens": 4, "seed": 3, "stop": ["###"], "include_stop_str_in_output": True, "stop_token_ids": [7],
        "ignore_eos": True, "detokenize": False, "skip_special_tokens": False, "logprobs": 5, "prompt_logprobs": 2,
        "logprobs_mode": EnumRef("LogprobMode", "RAW"),
    }
    covered = {f.name for f in dataclasses.fields(SamplingParams)}
    assert covered == {"n", "temperature", "top_k", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                       "max_new_tokens", "min_new_tokens", "ignore_eos", "stop", "stop_token_ids", "include_stop_str_in_output",
                       "detokenize", "skip_special_tokens", "seed", "logprobs", "prompt_logprobs", "beam_width", "length_penalty",
                       "early_stopping", "structured_output", "logit_bias", "allowed_token_ids", "bad_words",
                       # the core applies these before an engine sees the request: it truncates the prompt, and
                       # refuses logits_processors for request engines (they sample inside their engine)
                       "truncate_prompt_tokens", "logits_processors"}, "a new SamplingParams field needs a TensorRT-LLM translation"


def test_token_biases_become_embedding_bias_bad_token_ids_and_bad() -> None:
    p = SamplingParams(logit_bias={"3": -100, 1: 2.5}, allowed_token_ids=(1, 3, 4), bad_words=(" park", "red ball"))
    kwargs = sampling_kwargs(p, prompt_len=3, max_seq_len=None, vocab_size=6)
    check_kwargs("SamplingParams", kwargs)
    assert kwargs["embedding_bias"] == TensorRef((0.0, 2.5, 0.0, -100.0, 0.0, 0.0))  # one value per token
    assert kwargs["bad_token_ids"] == [0, 2, 5]  # every token outside allowed_token_ids
    assert kwargs["bad"] == ["park", " park", "red ball", " red ball"]  # as written and after a space, as vLLM tokenizes them
    with pytest.raises(UnsupportedError, match="vocab_size"):
        sampling_kwargs(SamplingParams(logit_bias={1: 1}), prompt_len=3, max_seq_len=None)
    with pytest.raises(UnsupportedError, match="outside the vocabulary"):
        sampling_kwargs(SamplingParams(allowed_token_ids=(9,)), prompt_len=3, max_seq_len=None, vocab_size=6)
    with pytest.raises(UnsupportedError, match="bad_words with beam search"):
        sampling_kwargs(SamplingParams(bad_words=("x",), beam_width=2), prompt_len=3, max_seq_len=None, vocab_size=6)


def test_structured_output_becomes_guided_decoding() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    for so, expected in [({"json": schema}, {"json": schema}), ({"regex": "[a-z]+"}, {"regex": "[a-z]+"}),
                         ({"grammar": "root ::= \"a\""}, {"grammar": "root ::= \"a\""}),
                         ({"choice": ["yes", "a.b"]}, {"regex": "(yes|a\\.b)"})]:
        kwargs = sampling_kwargs(SamplingParams(structured_output=so), prompt_len=3, max_seq_len=None, guided_backend="xgrammar")
        check_kwargs("SamplingParams", kwargs)
        assert kwargs["guided_decoding"] == ConfigRef("GuidedDecodingParams", expected)
    with pytest.raises(UnsupportedError, match="guided_decoding_backend"):
        sampling_kwargs(SamplingParams(structured_output={"regex": "a"}), prompt_len=3, max_seq_len=None)
    mc = model_config({"model": "m"}, source="<t>")
    check_kwargs("LLM", llm_kwargs(mc, "current", guided_decoding_backend="xgrammar"))
    with pytest.raises(UnsupportedError, match="current"):
        llm_kwargs(mc, "legacy", guided_decoding_backend="xgrammar")


def test_beam_search_is_spelled_as_tensorrt_llm_spells_it_now() -> None:
    kwargs = sampling_kwargs(SamplingParams(beam_width=4, n=2, length_penalty=0.8, early_stopping=True, max_new_tokens=32), prompt_len=3, max_seq_len=None)
    check_kwargs("SamplingParams", kwargs)
    assert (kwargs["use_beam_search"], kwargs["best_of"], kwargs["n"], kwargs["length_penalty"], kwargs["early_stopping"]) == (True, 4, 2, 0.8, 1)
    assert "beam_width" not in kwargs


def test_greedy_and_unbounded_output() -> None:
    kwargs = sampling_kwargs(SamplingParams(temperature=0, max_new_tokens=None), prompt_len=100, max_seq_len=4096)
    assert kwargs["temperature"] == 0.0 and kwargs["max_tokens"] == 3996 and "top_k" not in kwargs
    with pytest.raises(UnsupportedError, match="n > 1 with greedy"):
        sampling_kwargs(SamplingParams(temperature=0, n=2), prompt_len=3, max_seq_len=None)
    with pytest.raises(UnsupportedError, match="at most 100"):
        sampling_kwargs(SamplingParams(logprobs=101), prompt_len=3, max_seq_len=None)


# -- property-based: every config lmdock accepts either translates to accepted names or is refused --

sampling = st.builds(
    SamplingParams,
    n=st.integers(1, 4),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.integers(0, 100),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
    frequency_penalty=st.floats(-2, 2),
    presence_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.5, 2.0),
    max_new_tokens=st.one_of(st.none(), st.integers(16, 512)),
    min_new_tokens=st.integers(0, 16),
    ignore_eos=st.booleans(),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 50000), max_size=3),
    include_stop_str_in_output=st.booleans(),
    detokenize=st.booleans(),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
    logprobs=st.one_of(st.none(), st.integers(0, 120)),
    prompt_logprobs=st.one_of(st.none(), st.integers(0, 120)),
)


@settings(max_examples=300, deadline=None)
@given(p=sampling, prompt_len=st.integers(1, 2000))
def test_any_sampling_params_translate_to_accepted_arguments(p: SamplingParams, prompt_len: int) -> None:
    try:
        kwargs = sampling_kwargs(p, prompt_len=prompt_len, max_seq_len=4096)
    except UnsupportedError as exc:
        assert str(exc)  # refused, with a message
        return
    check_kwargs("SamplingParams", kwargs)
    assert 0 <= kwargs.get("top_p", 0.5) <= 1 and kwargs.get("top_k", 0) >= 0 and kwargs.get("temperature", 0) >= 0


@settings(max_examples=200, deadline=None)
@given(
    beam=st.integers(2, 8), n=st.integers(1, 8), lp=st.floats(0.0, 2.0), es=st.booleans(),
)
def test_any_beam_search_translates(beam: int, n: int, lp: float, es: bool) -> None:
    if n > beam:
        with pytest.raises(ValueError):
            SamplingParams(beam_width=beam, n=n)
        return
    kwargs = sampling_kwargs(SamplingParams(beam_width=beam, n=n, length_penalty=lp, early_stopping=es), prompt_len=5, max_seq_len=None)
    check_kwargs("SamplingParams", kwargs)
    assert kwargs["best_of"] >= kwargs["n"]


model_sections = st.fixed_dictionaries({
    "build": st.fixed_dictionaries({
        "dtype": st.sampled_from(["auto", "float16", "bfloat16", "float32"]),
        "max_batch_size": st.one_of(st.none(), st.integers(1, 1024)),
        "max_num_tokens": st.one_of(st.none(), st.integers(1, 65536)),
        "max_seq_len": st.one_of(st.none(), st.integers(16, 131072)),
        "max_beam_width": st.integers(1, 8),
        "tensor_parallel_size": st.sampled_from([1, 2, 4, 8]),
        "pipeline_parallel_size": st.sampled_from([1, 2]),
        "distributed_executor": st.sampled_from(["auto", "mp", "ray"]),
    }),
    "kv_cache": st.fixed_dictionaries({
        "dtype": st.sampled_from(KV_DTYPES),
        "max_tokens": st.one_of(st.none(), st.integers(1, 10**6)),
        "memory_fraction": st.one_of(st.none(), st.floats(0.05, 1.0)),
        "cpu_space_gib": st.one_of(st.none(), st.floats(0.5, 64)),
        "enable_prefix_caching": st.booleans(),
    }),
    "scheduler": st.fixed_dictionaries({"policy": st.sampled_from([*SCHEDULER_POLICIES, "lottery"]), "max_num_seqs": st.integers(1, 512)}),
    "quantization": st.fixed_dictionaries({"algo": st.sampled_from(ALGOS), "checkpoint_prequantized": st.booleans(), "group_size": st.sampled_from([None, 64, 128])}),
    "trust_remote_code": st.booleans(),
})


@settings(max_examples=300, deadline=None)
@given(sections=model_sections, api=st.sampled_from(["current", "legacy"]))
def test_any_model_config_translates_to_accepted_arguments_or_is_refused(sections: dict, api: str) -> None:
    try:
        kwargs = llm_kwargs(mc(**sections), api)  # type: ignore[arg-type]
    except UnsupportedError as exc:
        assert str(exc)
        return
    check_kwargs("LLM", kwargs, api)


# -- the backend as lmdock shows it here --------------------------------------------------------


def test_listed_as_unavailable_with_the_reason() -> None:
    from lmdock._plugin.manager import get_registry, reset_registry

    reset_registry()
    spec = get_registry().backend("trtllm")
    assert spec.kind == "request"
    assert "tensorrt_llm is not installed" in (spec.available() or "")


def test_selecting_it_says_what_is_missing(tmp_path: Any) -> None:
    with pytest.raises(BackendError, match=r"backend 'trtllm' is not available here: tensorrt_llm is not installed.*pip install \"lmdock-trtllm\[gpu\]\""):
        LLM(str(tmp_path), backend="trtllm")
