"""Streaming, futures, concurrency, chat, bad input and shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from lmdock import LmdockError, SamplingParams


@pytest.mark.requires("stream")
def test_streamed_deltas_join_to_the_final_text(llm: Any) -> None:
    params = SamplingParams(temperature=0.7, seed=11, max_new_tokens=48, stop=["park"])

    async def collect() -> list[str]:
        return [d async for d in llm.stream_generate("Once upon a time", params)]

    deltas = asyncio.run(collect())
    assert len(deltas) > 1
    assert "".join(deltas) == llm.generate("Once upon a time", params)[0].outputs[0].text


@pytest.mark.requires("stream")
def test_sixteen_concurrent_async_requests(llm: Any) -> None:
    prompts = [f"Once upon a time {w}" for w in "abcdefghijklmnop"]
    params = SamplingParams(temperature=0, max_new_tokens=16)

    async def run() -> list[Any]:
        return await asyncio.gather(*(llm.generate_async(p, params).aresult() for p in prompts))

    outs = asyncio.run(run())
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == alone


@pytest.mark.requires("stream")
def test_future_result_with_timeout(llm: Any) -> None:
    fut = llm.generate_async("The cat", SamplingParams(temperature=0, max_new_tokens=8))
    assert len(fut.result(timeout=120).outputs[0].token_ids) == 8


@pytest.mark.requires("chat")
def test_chat_with_an_explicit_template(llm: Any, reference: dict) -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": reference["prompt"]}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_new_tokens=12), chat_template=template)[0]
    rendered = llm.render_chat(messages, chat_template=template)
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 12


def _still_serves(llm: Any) -> None:
    assert len(llm.generate("The cat", SamplingParams(temperature=0, max_new_tokens=3))[0].outputs[0].token_ids) == 3


def test_empty_prompt_is_a_clear_error(llm: Any) -> None:
    with pytest.raises(LmdockError, match="empty"):
        llm.generate("", SamplingParams(max_new_tokens=3))
    _still_serves(llm)


def test_prompt_longer_than_the_context_is_a_clear_error(llm: Any) -> None:
    with pytest.raises(LmdockError, match="context"):
        llm.generate([[1] * (llm.max_model_len + 5)], SamplingParams(max_new_tokens=3))
    _still_serves(llm)


def test_invalid_parameters_are_clear_errors(llm: Any) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("The cat", {"top_p": 0.0})
    with pytest.raises(LmdockError, match="vocabulary"):
        llm.generate([[1, 10**9]], SamplingParams(max_new_tokens=3))
    _still_serves(llm)


def test_a_bad_request_in_a_batch_names_it(llm: Any) -> None:
    with pytest.raises(LmdockError, match="prompt 1"):
        llm.generate(["The cat", ""], SamplingParams(max_new_tokens=3))
    _still_serves(llm)


def test_shutdown_is_idempotent(lmdock_setup: Any) -> None:
    engine = lmdock_setup.llm()
    engine.generate("The cat", SamplingParams(temperature=0, max_new_tokens=2))
    engine.shutdown()
    engine.shutdown()
    with pytest.raises(LmdockError):
        engine.generate("The cat")
