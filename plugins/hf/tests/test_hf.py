"""lmdock-hf on the real stories260K, against published outputs and transformers itself."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from lmdock import LLM, ConfigError, RequestError, SamplingParams
from stories_facts import GREEDY_40, GREEDY_40_TEXT, PROMPT, PROMPT_IDS, REPO

GREEDY = SamplingParams(temperature=0, max_new_tokens=40)
PROMPTS = [
    "Once upon a time", "The cat", "Lily and Tom", "One day", "The sun was", "A little dog",
    "Tim had a", "The big tree", "Sue wanted to", "There was a bird", "Mom said", "In the park",
    "The boy ran", "She was happy", "They played", "At night",
]


def test_greedy_reference_through_python(llm: Any) -> None:
    out = llm.generate(PROMPT, GREEDY)[0]
    assert out.prompt_token_ids == PROMPT_IDS
    assert out.outputs[0].token_ids == GREEDY_40
    assert out.outputs[0].text == GREEDY_40_TEXT
    assert out.outputs[0].finish_reason == "length"


def test_greedy_reference_through_the_cli_and_example_config(stories: str) -> None:
    env = {**os.environ, "LMDOCK_MODELS": os.path.dirname(stories), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "lmdock._cli.main", "generate", "-m", "stories", PROMPT, "--json"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)[0]["outputs"][0]
    assert result["token_ids"] == GREEDY_40 and result["text"] == GREEDY_40_TEXT


def test_token_id_prompts(llm: Any, hf_model: Any) -> None:
    by_ids = llm.generate([PROMPT_IDS], GREEDY)[0]
    assert by_ids.prompt is None and by_ids.outputs[0].token_ids == GREEDY_40
    bos_only = llm.generate([[1]], GREEDY)[0].outputs[0].token_ids
    ref = hf_model.generate(torch.tensor([[1]]), max_new_tokens=40, do_sample=False, eos_token_id=None)
    assert bos_only == ref[0, 1:].tolist()


def test_equals_transformers_greedy_generate(llm: Any, hf_model: Any) -> None:
    ids = torch.tensor([PROMPT_IDS])
    ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=120, do_sample=False, eos_token_id=None)
    ours = llm.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=120, ignore_eos=True))[0]
    assert ours.outputs[0].token_ids == ref[0, len(PROMPT_IDS):].tolist()


def test_sixteen_prompts_batched_equal_alone(llm: Any) -> None:
    for params in (GREEDY, SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_new_tokens=30)):
        batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
        assert batched == alone


def test_logprobs_match_transformers_float32(llm: Any, hf_model: Any) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=10, logprobs=3, prompt_logprobs=2))[0]
    seq = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].float(), dim=-1).numpy()
    for i in range(1, len(out.prompt_token_ids)):
        tok = seq[i]
        assert out.prompt_logprobs[i][tok].logprob == pytest.approx(ref[i - 1, tok], abs=1e-5)
    for j, position in enumerate(out.outputs[0].logprobs):
        at = len(out.prompt_token_ids) + j
        top = np.argsort(-ref[at - 1])[:3].tolist()
        assert [t for t, lp in sorted(position.items(), key=lambda kv: kv[1].rank)][:3] == top
        for tok, lp in position.items():
            assert lp.logprob == pytest.approx(ref[at - 1, tok], abs=1e-5)


def test_streamed_deltas_join_to_generated_text(llm: Any) -> None:
    params = SamplingParams(temperature=0.7, seed=5, max_new_tokens=60, stop=["park"])

    async def collect() -> list[str]:
        return [d async for d in llm.stream_generate(PROMPT, params)]

    deltas = asyncio.run(collect())
    assert len(deltas) > 3
    assert "".join(deltas) == llm.generate(PROMPT, params)[0].outputs[0].text


def test_stop_string_cuts_the_text(llm: Any) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=40, stop=["Lily"]))[0].outputs[0]
    assert out.text == ", there was a little girl named " and out.stop_reason == "Lily"


def test_chat_with_an_explicit_template(llm: Any) -> None:
    with pytest.raises(RequestError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": PROMPT}]
    rendered = llm.render_chat(messages, chat_template=template)
    assert rendered == "<s>" + PROMPT
    out = llm.chat(messages, GREEDY, chat_template=template)[0]
    # The template wrote BOS itself, so the tokenizer adds no second one (as in vLLM).
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids == ids and ids.count(1) == 1
    assert out.outputs[0].token_ids == llm.generate([ids], GREEDY)[0].outputs[0].token_ids


def test_defaults_come_from_generation_config_then_options(stories: str) -> None:
    with LLM(stories, backend="hf", sampling={"temperature": 0.0, "max_new_tokens": 7}) as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.max_new_tokens, d.top_p) == (0.0, 7, 1.0)
        assert llm.generate(PROMPT)[0].outputs[0].token_ids == GREEDY_40[:7]


def test_kv_capacity_preemption_keeps_outputs(stories: str, llm: Any) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:8], params)]
    with LLM(stories, backend="hf", kv_cache={"max_tokens": 200}, scheduler={"max_num_batched_tokens": 16}) as small:
        got = [o.outputs[0].token_ids for o in small.generate(PROMPTS[:8], params)]
    assert got == want


def test_bad_backend_options_name_the_key(stories: str) -> None:
    with pytest.raises(ConfigError, match=r"backends\.hf\.num_thread: unknown key 'num_thread'"):
        LLM(stories, backend="hf", backends={"hf": {"num_thread": 2}})


def test_missing_local_model_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        LLM("./no/such/model", backend="hf")


def test_entry_module_imports_no_torch() -> None:
    code = "import sys, lmdock_hf; print([m for m in ('torch', 'transformers', 'numpy') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_next_token_logprobs_match_transformers_and_cache(llm: Any, hf_model: Any) -> None:
    prefixes = [PROMPT_IDS, PROMPT_IDS[:3], [*PROMPT_IDS, *GREEDY_40[:6]], [1, 403]]
    llm.clear_cache()
    got = llm.batch_next_token_logprobs_sync(prefixes)
    with torch.no_grad():
        for row, ids in zip(got, prefixes):
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), dim=-1).numpy()
            np.testing.assert_allclose(row, ref, atol=1e-5)
    engine = llm.engine.engine
    calls = engine.forward_calls
    again = asyncio.run(llm.next_token_logprobs(prefixes[2]))
    assert engine.forward_calls == calls  # a cache hit runs no forward pass
    np.testing.assert_array_equal(again, got[2])
    llm.clear_cache()
    llm.next_token_logprobs_sync(prefixes[2])
    assert engine.forward_calls > calls


@pytest.mark.parametrize("prompt", [PROMPT, "The cat", "Lily and Tom went"])
def test_beam_search_equals_transformers(llm: Any, hf_model: Any, prompt: str) -> None:
    ids = llm.tokenizer.encode(prompt)
    t = torch.tensor([ids])
    ref = hf_model.generate(t, attention_mask=torch.ones_like(t), num_beams=4, max_new_tokens=30, do_sample=False, early_stopping=False, length_penalty=1.0)
    out = llm.generate([ids], SamplingParams(beam_width=4, max_new_tokens=30))[0]
    llm.clear_cache()  # an earlier test left next-token-logprob KV state in the prefix cache
    assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    assert _idle(llm.engine.stats())


def test_two_hundred_cancelled_streams_leave_no_state(llm: Any) -> None:
    params = SamplingParams(temperature=0.8, seed=1, max_new_tokens=300, ignore_eos=True)

    async def cancel_many() -> None:
        for i in range(200):
            agen = llm.stream_generate(PROMPTS[i % len(PROMPTS)], params)
            await agen.__anext__()
            await agen.aclose()

    asyncio.run(cancel_many())
    assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == GREEDY_40  # the next request runs
    llm.clear_cache()  # the prefix caches hold KV state on purpose
    assert _idle(llm.engine.stats())
    assert llm.engine.engine.cache.slot_of == {}  # every KV slot was released


def test_detokenizer_fast_path_decodes_as_the_tokenizer(llm: Any) -> None:
    """The core calls the Rust tokenizer under a transformers fast tokenizer directly; it must give
    the tokenizer's own text, special tokens and byte-fallback pieces included."""
    from lmdock._engine.detok import fast_decode

    tok = llm.tokenizer
    decode = fast_decode(tok)
    assert "backend" in decode.__code__.co_freevars  # the fast path was taken for this tokenizer
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, 512, size=int(rng.integers(1, 12))).tolist()
        for skip in (False, True):
            assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def _idle(stats: dict) -> bool:
    """Nothing running or waiting, and the backend holds no sequence."""
    return (stats["num_sequences_running"], stats["num_sequences_waiting"], stats["num_sequences_held"]) == (0, 0, 0)
