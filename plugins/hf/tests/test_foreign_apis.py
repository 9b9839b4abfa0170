"""Other APIs' users' code with only the import changed, on lmdock-hf and stories260K (issue 31).

Each test is cut from an example: vLLM's offline examples, the TensorRT-LLM LLM-API customizations
page, furiosa-llm's ``LLM`` reference and genlm-backend's ``AsyncLM`` (../shared/seeds/).  The
original import is in a comment; everything below it is the example's own code, then assertions that
compare the result with lmdock's own spelling (greedy text equal) or with the published facts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from lmdock import LLM, SamplingParams
from stories_facts import GREEDY_40, GREEDY_40_TEXT, PROMPT, PROMPT_IDS

GREEDY_10 = GREEDY_40[:10]


@pytest.fixture(scope="module")
def ours(stories: str) -> Iterator[Any]:
    """lmdock's own spelling, for comparison."""
    with LLM(stories, backend="hf", build={"dtype": "float32", "max_seq_len": 256}, scheduler={"max_num_seqs": 8}) as llm:
        yield llm


def greedy(llm: Any, n: int = 10) -> list[int]:
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=n))[0].outputs[0].token_ids


# -- vLLM's offline examples ---------------------------------------------------------------------


def test_vllm_constructor_arguments_give_lmdocks_greedy_text(stories: str, ours: Any) -> None:
    # from vllm import LLM, SamplingParams
    from lmdock import LLM, SamplingParams

    llm = LLM(model=stories, backend="hf", dtype="float32", max_model_len=256, max_num_seqs=8, seed=0,
              enable_prefix_caching=True, enforce_eager=True, trust_remote_code=False, task="generate")
    sampling_params = SamplingParams(temperature=0, max_tokens=40)
    outputs = llm.generate(["Once upon a time"], sampling_params)
    assert outputs[0].outputs[0].text == GREEDY_40_TEXT
    assert llm.model_config.build == ours.model_config.build.replace(compile=False)
    assert llm.max_model_len == ours.max_model_len == 256
    llm.shutdown()


def test_vllm_prompt_dicts(ours: Any) -> None:
    # vLLM's TextPrompt / TokensPrompt (examples/offline_inference/basic/generate.py, prompt_embed...)
    outputs = ours.generate([{"prompt": PROMPT}, {"prompt_token_ids": PROMPT_IDS}], SamplingParams(temperature=0, max_tokens=10))
    assert [o.outputs[0].token_ids for o in outputs] == [GREEDY_10, GREEDY_10]
    assert outputs[1].prompt_token_ids == PROMPT_IDS


def test_vllm_default_params_then_one_field(ours: Any) -> None:
    sampling_params = ours.get_default_sampling_params()
    sampling_params.max_tokens = 10
    sampling_params.temperature = 0.0
    assert ours.generate(PROMPT, sampling_params)[0].outputs[0].token_ids == GREEDY_10
    assert ours.get_default_sampling_params().max_tokens == 16


def test_vllm_get_tokenizer(ours: Any) -> None:
    tokenizer = ours.get_tokenizer()
    assert tokenizer.encode(PROMPT) == PROMPT_IDS


def test_vllm_beam_search_matches_lmdocks_beams(ours: Any) -> None:
    # from vllm.sampling_params import BeamSearchParams
    from lmdock import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=12)
    outputs = ours.beam_search([{"prompt": PROMPT}], params)
    beams = ours.generate(PROMPT, SamplingParams(beam_width=3, n=3, max_new_tokens=12))[0].outputs
    sequences = outputs[0].sequences
    assert [s.tokens for s in sequences] == [PROMPT_IDS + b.token_ids for b in beams]
    assert [s.cum_logprob for s in sequences] == [b.cumulative_logprob for b in beams]
    assert sequences[0].text == PROMPT + beams[0].text
    assert sequences[0].cum_logprob >= sequences[1].cum_logprob


def test_vllm_structured_outputs(ours: Any) -> None:
    # from vllm.sampling_params import StructuredOutputsParams  (examples/offline_inference/structured_outputs.py)
    from lmdock import StructuredOutputsParams

    structured_outputs_params_choice = StructuredOutputsParams(choice=["Positive", "Negative"])
    sampling_params_choice = SamplingParams(structured_outputs=structured_outputs_params_choice)
    outputs = ours.generate("Classify this sentiment: vLLM is wonderful!", sampling_params=sampling_params_choice)
    assert outputs[0].outputs[0].text in ("Positive", "Negative")


def test_vllm_truncate_prompt_tokens(ours: Any) -> None:
    cut = ours.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=3))[0]
    assert cut.prompt_token_ids == PROMPT_IDS[-3:]
    assert cut.outputs[0].token_ids == ours.generate([PROMPT_IDS[-3:]], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids


def test_vllm_per_request_logits_processors(ours: Any) -> None:
    banned = GREEDY_10[0]

    def no_comma(token_ids: list[int], logits: Any) -> Any:
        logits[banned] = float("-inf")
        return logits

    sp = SamplingParams(temperature=0, max_tokens=5, logits_processors=[no_comma])
    out = ours.generate(PROMPT, sp)[0].outputs[0].token_ids
    assert banned not in out and out != GREEDY_10[:5]
    plain = SamplingParams(temperature=0, max_tokens=5).clone()
    assert ours.generate(PROMPT, plain)[0].outputs[0].token_ids == GREEDY_10[:5]  # the next request has none


# -- TensorRT-LLM: the LLM API customizations page ------------------------------------------------


def test_trtllm_build_config_and_beam_width(stories: str) -> None:
    # from tensorrt_llm.llmapi import LLM, SamplingParams, BuildConfig
    from lmdock import LLM, BuildConfig, SamplingParams

    build_config = BuildConfig()
    build_config.max_beam_width = 4

    llm = LLM(stories, backend="hf", build_config=build_config)
    sampling_params = SamplingParams(beam_width=4, max_tokens=12)

    outputs = [output for output in llm.generate(PROMPT, sampling_params=sampling_params)]
    ours = llm.generate(PROMPT, SamplingParams(beam_width=4, max_new_tokens=12))
    assert outputs[0].outputs[0].token_ids == ours[0].outputs[0].token_ids
    assert llm.model_config.build.max_beam_width == 4
    llm.shutdown()


def test_trtllm_kv_cache_quant_and_build_limits(stories: str) -> None:
    # from tensorrt_llm.llmapi import LLM, KvCacheConfig, QuantConfig, QuantAlgo
    from lmdock import LLM, BuildConfig, KvCacheConfig, QuantAlgo, QuantConfig

    llm = LLM(stories, backend="hf", kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.8),
              build_config=BuildConfig(max_num_tokens=4096, max_batch_size=128, max_beam_width=4))
    assert llm.model_config.kv_cache.memory_fraction == 0.8 and llm.model_config.build.max_batch_size == 128
    assert greedy(llm) == GREEDY_10
    llm.shutdown()
    llm = LLM(stories, backend="hf", quant_config=QuantConfig(quant_algo=QuantAlgo.W8A16))
    ref = LLM(stories, backend="hf", quantization={"algo": "int8_weight_only"})
    assert llm.model_config.quantization == ref.model_config.quantization
    assert greedy(llm, 5) == greedy(ref, 5)
    llm.shutdown()
    ref.shutdown()


def test_trtllm_token_ids_and_skip_tokenizer_init(stories: str) -> None:
    llm = LLM(stories, backend="hf", skip_tokenizer_init=True)
    for output in llm.generate([PROMPT_IDS], SamplingParams(temperature=0, max_tokens=10)):
        assert output.outputs[0].text == "" and output.outputs[0].token_ids == GREEDY_10
    llm.shutdown()


def test_trtllm_tokenizer_object(stories: str) -> None:
    from transformers import AutoTokenizer

    my_faster_one = AutoTokenizer.from_pretrained(stories)
    llm = LLM(stories, backend="hf", tokenizer=my_faster_one)
    assert llm.model_config.tokenizer == stories
    assert greedy(llm) == GREEDY_10
    llm.shutdown()


def test_trtllm_generate_async_streaming_future_and_await(ours: Any) -> None:
    sampling_params = SamplingParams(temperature=0, max_tokens=10, end_id=-1, pad_id=0, random_seed=1, return_log_probs=True)

    async def main() -> tuple[list[Any], Any, Any]:
        streamed = [output async for output in ours.generate_async(PROMPT, sampling_params, streaming=True)]
        generation = ours.generate_async(PROMPT, sampling_params)
        awaited = await generation.aresult()
        return streamed, awaited, await ours.generate_async(PROMPT, sampling_params)

    streamed, awaited, direct = asyncio.run(main())
    assert streamed[-1].outputs[0].token_ids == awaited.outputs[0].token_ids == direct.outputs[0].token_ids == GREEDY_10
    assert [len(o.outputs[0].token_ids) for o in streamed] == list(range(1, 11))
    assert len(awaited.outputs[0].logprobs) == 10  # return_log_probs: the chosen tokens' logprobs
    generation = ours.generate_async(PROMPT, sampling_params)
    assert generation.result(timeout=60).outputs[0].token_ids == GREEDY_10


# -- furiosa-llm's LLM -----------------------------------------------------------------------------


def test_furiosa_constructor_and_call_arguments(stories: str) -> None:
    # from furiosa_llm import LLM
    from lmdock import LLM

    with LLM(artifact_path=stories, backend="hf") as llm:
        sampling_params = llm.get_default_sampling_params()
        sampling_params.max_tokens = 10
        sampling_params.temperature = 0.0
        tokenizer = llm.get_tokenizer()
        batch = tokenizer([PROMPT])  # a BatchEncoding
        outputs = llm.generate([PROMPT], sampling_params, prompt_token_ids=batch)
        assert outputs[0].outputs[0].token_ids == GREEDY_10
        no_bos = llm.generate(PROMPT, sampling_params, tokenizer_kwargs={"add_special_tokens": False})[0]
        assert no_bos.prompt_token_ids == PROMPT_IDS[1:]

        async def deltas() -> str:
            return "".join([d async for d in llm.stream_generate(PROMPT, sampling_params, prompt_token_ids=batch)])

        assert asyncio.run(deltas()) == outputs[0].outputs[0].text
    with LLM(model_id_or_path=stories, backend="hf") as llm:
        assert greedy(llm) == GREEDY_10


def test_furiosa_chat_content_format(stories: str) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with LLM(artifact_path=stories, backend="hf") as llm:
        sp = SamplingParams(temperature=0, max_tokens=10)
        parts = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
        out = llm.chat(parts, sp, chat_template=template, chat_template_content_format="string")
        plain = llm.chat([{"role": "user", "content": PROMPT}], sp, chat_template=template)
        assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


# -- genlm-backend's AsyncLM -----------------------------------------------------------------------


def test_genlm_async_lm(stories: str, hf_model: Any) -> None:
    import torch

    # from genlm.backend import load_model_by_name
    from lmdock import load_model_by_name

    llm = load_model_by_name(stories, backend="hf")
    logprobs = asyncio.run(llm.next_token_logprobs(PROMPT_IDS))
    assert isinstance(logprobs, torch.Tensor) and logprobs.shape == (512,)
    assert torch.isclose(logprobs.exp().sum(), torch.tensor(1.0), atol=1e-4)
    assert torch.topk(logprobs, 1).indices.item() == GREEDY_40[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([PROMPT_IDS])).logits[0, -1], -1)
    assert torch.allclose(logprobs, ref, atol=1e-4)
    batch = llm.batch_next_token_logprobs_sync([PROMPT_IDS, PROMPT_IDS[:3]])
    assert batch.shape == (2, 512) and torch.allclose(batch[0], logprobs)
    assert torch.allclose(asyncio.run(llm.batch_next_token_logprobs([PROMPT_IDS]))[0], logprobs)
    assert llm.byte_vocab[GREEDY_40[1]] == b" there" and llm.str_vocab[GREEDY_40[1]] == " there"
    assert llm.byte_vocab[13] == b"\n"  # <0x0A>
    sampled = asyncio.run(llm.sample(PROMPT_IDS, max_tokens=10, eos_token_ids=[2], temperature=1e-6, seed=0))
    assert sampled == GREEDY_10
    until_period = asyncio.run(llm.batch_sample([PROMPT_IDS], max_tokens=40, eos_token_ids=[GREEDY_40[8]], temperature=1e-6))
    assert until_period == [GREEDY_40[:8]]
    llm.cache_kv(PROMPT_IDS)
    llm.clear_kv_cache()
    llm.clear_cache()
    llm.llm.shutdown()
