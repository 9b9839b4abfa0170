"""Other APIs' spellings read as lmdock's (lmdock._config.foreign, docs/migrating.md): each foreign argument
resolves to the same model config as lmdock's own spelling, or is refused naming lmdock's equivalent.
The facade plumbing (prompt dicts, editable defaults, awaitable and streaming futures) runs on the
FAKE backend; the same idioms on a real model are in plugins/hf/tests/test_foreign_apis.py."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
from lmdock import (
    LLM,
    BuildConfig,
    ConfigError,
    KvCacheConfig,
    QuantAlgo,
    QuantConfig,
    RequestError,
    SamplingParams,
    SchedulerConfig,
    StructuredOutput,
    StructuredOutputsParams,
)
from lmdock._config.foreign import CONSTRUCTOR, constructor_options
from lmdock._plugin.loader import resolve_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def resolved(model: Any = "org/m", **options: Any) -> Any:
    model, options, after = constructor_options(model, options)
    return resolve_model(model, None, options), after


#: (foreign arguments, lmdock's own spelling of the same): every alias with a value in CONSTRUCTOR.
SAME = [
    ({"dtype": "half"}, {"build": {"dtype": "float16"}}),
    ({"dtype": "float"}, {"build": {"dtype": "float32"}}),
    ({"dtype": "torch.bfloat16"}, {"build": {"dtype": "bfloat16"}}),
    ({"max_model_len": 256}, {"build": {"max_seq_len": 256}}),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}},
     {"speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}}),
    ({"gpu_memory_utilization": 0.8}, {"kv_cache": {"memory_fraction": 0.8}}),
    ({"tensor_parallel_size": 2}, {"build": {"tensor_parallel_size": 2}}),
    ({"pipeline_parallel_size": 2}, {"build": {"pipeline_parallel_size": 2}}),
    ({"distributed_executor_backend": "mp"}, {"build": {"distributed_executor": "mp"}}),
    ({"seed": 7}, {"sampling": {"seed": 7}}),
    ({"quantization": "awq"}, {"quantization": {"algo": "awq", "checkpoint_prequantized": True}}),
    ({"quantization": "gptq_marlin"}, {"quantization": {"algo": "gptq", "checkpoint_prequantized": True}}),
    ({"quantization": "fp8"}, {"quantization": {"algo": "fp8"}}),
    ({"max_num_seqs": 4}, {"scheduler": {"max_num_seqs": 4}}),
    ({"max_num_batched_tokens": 64}, {"scheduler": {"max_num_batched_tokens": 64}}),
    ({"enable_prefix_caching": False}, {"kv_cache": {"enable_prefix_caching": False}}),
    ({"kv_cache_dtype": "fp8"}, {"kv_cache": {"dtype": "fp8"}}),
    ({"enforce_eager": True}, {"build": {"compile": False}, "backends": {"vllm": {"enforce_eager": True}}}),
    ({"enforce_eager": False}, {"backends": {"vllm": {"enforce_eager": False}}}),
    ({"skip_tokenizer_init": True}, {"sampling": {"detokenize": False}}),
    ({"build_config": BuildConfig(max_num_tokens=4096, max_batch_size=128, max_beam_width=4)},
     {"build": {"max_num_tokens": 4096, "max_batch_size": 128, "max_beam_width": 4}}),
    ({"kv_cache_config": KvCacheConfig(free_gpu_memory_fraction=0.8)}, {"kv_cache": {"memory_fraction": 0.8}}),
    ({"quant_config": QuantConfig(quant_algo=QuantAlgo.W4A16_AWQ)}, {"quantization": {"algo": "awq"}}),
    ({"scheduler_config": SchedulerConfig(max_num_seqs=3)}, {"scheduler": {"max_num_seqs": 3}}),
    ({"max_batch_size": 8}, {"build": {"max_batch_size": 8}}),
    ({"max_num_tokens": 512}, {"build": {"max_num_tokens": 512}}),
    ({"max_seq_len": 128}, {"build": {"max_seq_len": 128}}),
    ({"max_beam_width": 4}, {"build": {"max_beam_width": 4}}),
    ({"max_loras": 2}, {"build": {"max_loras": 2}}),
    ({"max_lora_rank": 8}, {"build": {"max_lora_rank": 8}}),
    ({"enable_lora": True}, {}),  # adapters load when a request names one: nothing to switch on
]


@pytest.mark.parametrize(("foreign", "ours"), SAME, ids=[next(iter(f)) + "=" + repr(next(iter(f.values()))) for f, _ in SAME])
def test_a_foreign_argument_resolves_as_lmdocks_spelling(isolated: Path, foreign: dict[str, Any], ours: dict[str, Any]) -> None:
    assert resolved(**foreign)[0] == resolved(**ours)[0]
    assert resolved(**foreign)[0] != resolved()[0] or foreign in ({"enforce_eager": False}, {"enable_lora": True})


def test_every_alias_is_tested_or_refused() -> None:
    tested = {next(iter(f)) for f, _ in SAME} | {"task", "runner", "tokenizer", "model_id_or_path", "artifact_path"}
    assert {name for name, a in CONSTRUCTOR.items() if a.to is not None} <= tested


def test_furiosa_model_arguments_name_the_model(isolated: Path) -> None:
    assert resolved(None, artifact_path="org/m")[0] == resolved("org/m")[0]
    assert resolved(None, model_id_or_path="org/m")[0] == resolved("org/m")[0]
    with pytest.raises(ConfigError, match="'artifact_path' names the model 'org/x' and the model argument names 'org/m'"):
        resolved("org/m", artifact_path="org/x")


def test_a_tokenizer_object_is_loaded_from_its_files(isolated: Path) -> None:
    class Tok:
        name_or_path = "org/tok"

    assert resolved(tokenizer=Tok())[0] == resolved(tokenizer="org/tok")[0]
    with pytest.raises(ConfigError, match="pass a transformers tokenizer .* or its folder"):
        resolved(tokenizer=object())


@pytest.mark.parametrize(("name", "value", "says"), [
    ("download_dir", "/tmp/x", r"HF_HUB_CACHE"),
    ("swap_space", 4, r"engine_args"),
    ("cpu_offload_gb", 4, r"offload=\{...\}"),
    ("cache_dir", "/tmp/x", r"HF_HUB_CACHE"),
    ("devices", "npu:0", r"build.device"),
    ("data_parallel_size", 2, r"--replicas"),
    ("served_model_name", "x", r"\[models.NAME\]"),
    ("quantization", "bitsandbytes", r"lmdock names awq, .*engine_args"),
    ("dtype", "int8", r"build.dtype takes"),
])
def test_a_foreign_argument_without_meaning_is_refused_by_name(isolated: Path, name: str, value: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name}.*{says}") as err:
        resolved(**{name: value})
    assert "unknown" not in str(err.value)


def test_a_foreign_argument_and_lmdocks_key_must_agree(isolated: Path) -> None:
    assert resolved(dtype="half", build={"max_seq_len": 64})[0] == resolved(build={"dtype": "float16", "max_seq_len": 64})[0]
    assert resolved(dtype="half", build=BuildConfig(max_seq_len=64))[0].build == BuildConfig(dtype="float16", max_seq_len=64)
    with pytest.raises(ConfigError, match="'max_model_len' sets build.max_seq_len = 64, and build.max_seq_len is also given as 32"):
        resolved(max_model_len=64, build={"max_seq_len": 32})


def test_trtllm_quant_algos_map_or_are_refused_by_name() -> None:
    assert QuantConfig(quant_algo="W8A16") == QuantConfig(algo="int8_weight_only")
    assert QuantConfig(quant_algo=QuantAlgo.FP8, group_size=128) == QuantConfig(algo="fp8", group_size=128)
    with pytest.raises(ValueError, match="quant_algo 'NVFP4' .* has no portable lmdock algo"):
        QuantConfig(quant_algo=QuantAlgo.NVFP4)
    with pytest.raises(ValueError, match="kv_cache_quant_algo is lmdock's kv_cache.dtype"):
        QuantConfig(quant_algo=QuantAlgo.FP8, kv_cache_quant_algo=QuantAlgo.FP8)
    assert KvCacheConfig(enable_block_reuse=False) == KvCacheConfig(enable_prefix_caching=False)


def test_build_config_is_editable_and_validated() -> None:
    build_config = BuildConfig()
    build_config.max_beam_width = 4  # the TensorRT-LLM seed's own lines
    assert build_config == BuildConfig(max_beam_width=4)
    with pytest.raises(ValueError, match="max_beam_width: must be >= 1"):
        build_config.max_beam_width = 0
    assert build_config.max_beam_width == 4


def test_trtllm_sampling_names_mean_lmdocks_fields() -> None:
    assert SamplingParams(random_seed=3) == SamplingParams(seed=3)
    assert SamplingParams(end_id=7, stop_token_ids=[5]) == SamplingParams(stop_token_ids=(5, 7))
    assert SamplingParams(end_id=-1) == SamplingParams(ignore_eos=True)
    assert SamplingParams(return_log_probs=True) == SamplingParams(logprobs=0)
    assert SamplingParams(pad_id=0) == SamplingParams()
    assert SamplingParams(beam_width=4, n=4) == SamplingParams(num_beams=4, n=4)


def test_vllm_sampling_names_read_and_set_as_lmdocks() -> None:
    sp = SamplingParams(max_tokens=12)
    assert sp.max_tokens == sp.max_new_tokens == 12 and sp.min_tokens == 0
    assert StructuredOutputsParams is StructuredOutput
    assert SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")).structured_output == StructuredOutput(regex="a+")
    clone = sp.clone()
    clone.max_tokens = 40
    assert clone.max_new_tokens == 40 and sp.max_new_tokens == 12 and clone == sp.replace(max_new_tokens=40)
    with pytest.raises(ValueError, match="temperature: must be in"):
        clone.temperature = -1.0
    with pytest.raises(AttributeError, match="no field 'max_tokenz'"):
        clone.max_tokenz = 3
    with pytest.raises(ValueError, match="truncate_prompt_tokens: must be >= 1"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="logits_processors: must be callables"):
        SamplingParams(logits_processors=["not callable"])


# -- the facade, on the FAKE backend --------------------------------------------------------------


def test_prompt_dicts_are_prompts_and_other_dicts_are_refused(fake: Any) -> None:
    with LLM("m", backend="fake") as llm:
        text = llm.generate("abc", GREEDY)[0]
        ids = text.prompt_token_ids
        by_dict = llm.generate([{"prompt": "abc"}, {"prompt_token_ids": ids}, {"prompt": "abc", "prompt_token_ids": ids}], GREEDY)
        assert [o.outputs[0].token_ids for o in by_dict] == [text.outputs[0].token_ids] * 3
        assert by_dict[0].prompt == "abc" and by_dict[1].prompt_token_ids == ids
        assert llm.generate_async({"prompt_token_ids": ids}, GREEDY).result(timeout=30).outputs[0].token_ids == text.outputs[0].token_ids
        assert [s.outputs[0].token_ids for s in llm.stream({"prompt": "abc"}, GREEDY)][-1] == text.outputs[0].token_ids
        for bad in ({"text": "abc"}, {}):
            with pytest.raises(RequestError, match="it takes 'prompt' .* or 'prompt_token_ids'"):
                llm.generate(bad, GREEDY)
        # images (docs/vision.md): read, then refused by a backend without the vision capability
        with pytest.raises(RequestError, match=r"multi_modal_data\['image'\] is empty"):
            llm.generate({"prompt_token_ids": ids, "multi_modal_data": {}}, GREEDY)
        with pytest.raises(RequestError, match="multi_modal_data 'audio': lmdock reads images only"):
            llm.generate({"prompt": "abc", "multi_modal_data": {"audio": b"x"}}, GREEDY)
        with pytest.raises(RequestError, match="backend 'fake' cannot read images"):
            llm.generate({"prompt": "abc", "multi_modal_data": {"image": b"\x89PNG"}}, GREEDY)
        with pytest.raises(RequestError, match="prompt 1: a prompt dict has 'prompt_ids'"):
            llm.generate([{"prompt": "abc"}, {"prompt_ids": ids}], GREEDY)


def test_default_params_are_an_editable_copy(fake: Any) -> None:
    with LLM("m", backend="fake", sampling={"temperature": 0.0}) as llm:
        sp = llm.get_default_sampling_params()
        sp.max_tokens = 3
        assert len(llm.generate("abc", sp)[0].outputs[0].token_ids) == 3
        assert llm.get_default_sampling_params().max_new_tokens == 16  # the defaults did not change
        assert llm.generate("abc", sp)[0].outputs[0].token_ids == llm.generate("abc", GREEDY.replace(max_new_tokens=3))[0].outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_last_tokens(fake: Any) -> None:
    with LLM("m", backend="fake") as llm:
        full = llm.generate("abcdef", GREEDY)[0].prompt_token_ids
        cut = llm.generate("abcdef", GREEDY.replace(truncate_prompt_tokens=3))[0]
        assert cut.prompt_token_ids == full[-3:]
        assert cut.outputs[0].token_ids == llm.generate([full[-3:]], GREEDY)[0].outputs[0].token_ids


def test_request_logits_processors_run_after_the_plugins(fake: Any) -> None:
    with LLM("m", backend="fake") as llm:
        plain = llm.generate("abc", GREEDY)[0].outputs[0].token_ids
        seen: list[list[int]] = []

        def ban_first(token_ids: list[int], logits: Any) -> Any:
            seen.append(list(token_ids))
            logits[plain[0]] = -1e9
            return logits

        out = llm.generate("abc", GREEDY.replace(logits_processors=(ban_first,)))[0]
        assert plain[0] not in out.outputs[0].token_ids
        assert seen[0] == out.prompt_token_ids  # the sequence so far: prompt, then output


def test_futures_are_awaitable_and_stream_when_asked(fake: Any) -> None:
    with LLM("m", backend="fake") as llm:
        final = llm.generate("abc", GREEDY)[0].outputs[0]

        async def main() -> tuple[Any, list[Any], list[Any]]:
            awaited = await llm.generate_async("abc", GREEDY)
            streamed = [o async for o in llm.generate_async("abc", GREEDY, streaming=True)]
            once = [o async for o in llm.generate_async("abc", GREEDY)]
            return awaited, streamed, once

        awaited, streamed, once = asyncio.run(main())
        assert awaited.outputs[0].token_ids == final.token_ids
        assert len(streamed) > 1 and streamed[-1].finished and not streamed[0].finished
        assert [len(o.outputs[0].token_ids) for o in streamed] == sorted(len(o.outputs[0].token_ids) for o in streamed)
        assert streamed[-1].outputs[0].text == final.text
        assert len(once) == 1 and once[0].outputs[0].token_ids == final.token_ids


def test_leaving_a_stream_early_aborts_it(fake: Any) -> None:
    # The engine is held after a few tokens, so the request cannot finish before the abort lands
    # (with a free-running fake it could finish all 200 tokens first, and the test would race).
    from fakes import FakeStepEngine

    gate = threading.Event()

    def held(engine: FakeStepEngine) -> FakeStepEngine:
        table = engine.table
        engine.logits_fn = lambda toks: (gate.wait(10) if len(toks) > 6 else None, table[toks[-1]].copy())[1]
        return engine

    fake.factory = lambda: held(FakeStepEngine())
    with LLM("m", backend="fake") as llm:
        async def first() -> Any:
            fut = llm.generate_async("abc", SamplingParams(max_new_tokens=200, ignore_eos=True), streaming=True)
            async for _ in fut:
                break
            # leaving the loop drops the generator; its finalizer closes it on this loop
            for _ in range(100):
                if fut.done():
                    break
                await asyncio.sleep(0.01)
            return fut

        try:
            fut = asyncio.run(first())
        finally:
            gate.set()
        assert fut.cancelled()


def test_skip_tokenizer_init_takes_token_ids_and_gives_no_text(fake: Any) -> None:
    with LLM("m", backend="fake", skip_tokenizer_init=True) as llm:
        out = llm.generate([[1, 5, 6]], SamplingParams(temperature=0.0, max_new_tokens=4))[0]
        assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 4
        assert llm.get_tokenizer() is None
        with pytest.raises(RequestError, match="without a tokenizer; pass token ids"):
            llm.generate("abc")


def test_a_task_the_model_is_not_loaded_for_is_refused(fake: Any) -> None:
    with LLM("m", backend="fake", task="generate", runner="generate") as llm:
        assert llm.generate("abc", GREEDY)
    with pytest.raises(ConfigError, match="task 'embed': 'm' is a generative model"):
        LLM("m", backend="fake", task="embed")
    with pytest.raises(ConfigError, match="task 'translate'.*lmdock knows"):
        LLM("m", backend="fake", task="translate")


def test_furiosa_prompt_token_ids_and_tokenizer_kwargs(fake: Any) -> None:
    with LLM("m", backend="fake") as llm:
        with_bos = llm.generate("abc", GREEDY)[0]
        no_bos = llm.generate("abc", GREEDY, tokenizer_kwargs={"add_special_tokens": False})[0]
        assert no_bos.prompt_token_ids == with_bos.prompt_token_ids[1:]
        batch = {"input_ids": [with_bos.prompt_token_ids, no_bos.prompt_token_ids]}  # a BatchEncoding's shape
        out = llm.generate(["abc", "abc"], GREEDY, prompt_token_ids=batch)
        assert [o.outputs[0].token_ids for o in out] == [with_bos.outputs[0].token_ids, no_bos.outputs[0].token_ids]
        with pytest.raises(RequestError, match="tokenizer_kwargs \\['truncation'\\]"):
            llm.generate("abc", GREEDY, tokenizer_kwargs={"truncation": True})


def test_an_editable_params_snapshot_is_what_the_request_holds(fake: Any) -> None:
    with LLM("m", backend="fake") as llm:
        sp = GREEDY.clone()
        request = llm.make_request("abc", sp)
        sp.max_tokens = 2
        assert request.params.max_new_tokens == 6 and type(request.params) is SamplingParams
        assert dataclasses.replace(request.params) == request.params


def test_a_foreign_argument_overrides_one_key_of_the_config_files_backend_table(isolated: Path) -> None:
    (isolated / "lmdock.toml").write_text('[models.m]\nmodel = "org/m"\n[models.m.backends.vllm]\nmax_logprobs = 8\n')
    model, options, _ = constructor_options("m", {"enforce_eager": True})
    mc = resolve_model(model, None, options)
    assert mc.backends["vllm"] == {"max_logprobs": 8, "enforce_eager": True}
    assert mc.build.compile is False


def test_a_frozen_params_assignment_says_how_to_edit() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"sp.clone\(\) or llm.get_default_sampling_params\(\) give an editable copy"):
        SamplingParams().max_tokens = 5  # type: ignore[misc]
