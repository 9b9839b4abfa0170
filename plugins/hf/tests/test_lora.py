"""LoRA adapters on lmdock-hf (issue 33), against PEFT on transformers as the reference.

The adapters are made here with PEFT on stories260K (random low-rank weights from a fixed seed:
PEFT's default init is a no-op until trained) and saved with ``save_pretrained``; the reference is
``PeftModel.from_pretrained`` on transformers in float32, unmerged and merged (code outside the code
under test: peft is a test tool only).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmdock import LLM, LoRARequest, RequestError, SamplingParams
from stories_facts import GREEDY_40, PROMPT_IDS

peft = pytest.importorskip("peft", reason="peft (a test tool: scripts/test.sh installs it into the hf env)")

NEW = 16
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, logprobs=0, prompt_logprobs=0)
#: |lmdock - reference| logprob bound: both run float32, the add is the same sum in another order
TOL = 1e-4
PROMPTS = [PROMPT_IDS, [1, 403, 407, 261, 378, 432, 383, 286, 261, 376]]


def _make_adapter(stories: str, folder: Path, seed: int, targets: list[str]) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(stories, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(stories: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": _make_adapter(stories, root / "a", 1, ["q_proj", "v_proj", "o_proj"]),
        "b": _make_adapter(stories, root / "b", 2, ["k_proj", "gate_proj", "down_proj"]),
    }


def _reference(stories: str, adapter: Path | None, prompt: list[int], merged: bool = False) -> tuple[list[int], list[float]]:
    """Greedy tokens and the logprob of every token after the first (prompt then output), from
    transformers (+ PEFT) in float32, a full forward per token."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
        if merged:
            model = model.merge_and_unload()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return ids[len(prompt):], [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


@pytest.fixture(scope="module")
def refs(stories: str, adapters: dict[str, Path]) -> dict[tuple[str | None, int], tuple[list[int], list[float]]]:
    return {(name, i): _reference(stories, adapters.get(name) if name else None, p)
            for name in (None, "a", "b") for i, p in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def lora_llm(stories: str) -> Iterator[LLM]:
    with LLM(stories, backend="hf", scheduler={"max_num_seqs": 8}) as llm:
        yield llm


def _lmdock(out: Any) -> tuple[list[int], list[float]]:
    """Greedy tokens and the logprob of every token after the first (the prompt's where they were
    asked for), as lmdock reported them."""
    c = out.outputs[0]
    prompt = [] if out.prompt_logprobs is None else [out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i > 0]
    return list(c.token_ids), prompt + [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


def _output_part(ref: tuple[list[int], list[float]]) -> tuple[list[int], list[float]]:
    """A reference without its prompt's logprobs."""
    return ref[0], ref[1][-NEW:]


def _assert_matches(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=TOL)


def _lora(adapters: dict[str, Path], name: str) -> LoRARequest:
    return LoRARequest(name, adapters[name])


def test_the_adapters_change_the_output(refs: dict[Any, Any]) -> None:
    """The test is meaningful: each adapter moves the greedy output and the logprobs away from the base."""
    for i in range(len(PROMPTS)):
        base = refs[None, i]
        for name in ("a", "b"):
            assert refs[name, i][0] != base[0]
            assert max(abs(x - y) for x, y in zip(refs[name, i][1], base[1])) > 0.5
    assert refs[None, 0][0] == GREEDY_40[:NEW]  # the reference agrees with the known greedy output


def test_an_adapter_matches_peft_unmerged_and_merged(lora_llm: LLM, adapters: dict[str, Path], refs: dict[Any, Any], stories: str) -> None:
    for name in ("a", "b"):
        for i, prompt in enumerate(PROMPTS):
            got = _lmdock(lora_llm.generate([prompt], GREEDY, lora_request=_lora(adapters, name))[0])
            _assert_matches(got, refs[name, i])
    _assert_matches(_lmdock(lora_llm.generate([PROMPTS[0]], GREEDY, lora_request=_lora(adapters, "a"))[0]),
                    _reference(stories, adapters["a"], PROMPTS[0], merged=True))


def test_the_base_model_is_unchanged_beside_loaded_adapters(lora_llm: LLM, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    lora_llm.generate([PROMPTS[0]], GREEDY, lora_request=_lora(adapters, "a"))  # adapter a's layers are wrapped now
    for i, prompt in enumerate(PROMPTS):
        _assert_matches(_lmdock(lora_llm.generate([prompt], GREEDY)[0]), refs[None, i])


def test_a_mixed_batch_equals_each_request_alone(lora_llm: LLM, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    """Base, adapter a and adapter b (two prompts each) in one batch: decode forwards mix all three."""
    loras = [None, _lora(adapters, "a"), _lora(adapters, "b")] * 2
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    engine = lora_llm.engine.engine
    calls = engine.forward_calls
    outs = lora_llm.generate(prompts, GREEDY, lora_request=loras)
    for out, lora, prompt in zip(outs, loras, prompts):
        _assert_matches(_lmdock(out), refs[lora.name if lora else None, PROMPTS.index(prompt)])
    # 6 prefills, then the decode steps ran the six rows together (not one forward per adapter)
    assert engine.forward_calls - calls < 6 + 2 * NEW


def test_the_prefix_cache_is_not_shared_across_adapters(stories: str, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    """A prompt computed under adapter a is cached; the same prompt under b or the base model must not
    reuse it (their KV state differs), and under a it is reused."""
    plain = GREEDY.replace(prompt_logprobs=None)  # prompt logprobs turn the reuse off
    with LLM(stories, backend="hf") as llm:
        hits = lambda: llm.stats()["prefix_cache_hit_tokens"]  # noqa: E731
        _assert_matches(_lmdock(llm.generate([PROMPTS[1]], GREEDY, lora_request=_lora(adapters, "a"))[0]), refs["a", 1])
        before = hits()
        _assert_matches(_lmdock(llm.generate([PROMPTS[1]], plain, lora_request=_lora(adapters, "b"))[0]), _output_part(refs["b", 1]))
        _assert_matches(_lmdock(llm.generate([PROMPTS[1]], plain)[0]), _output_part(refs[None, 1]))
        assert hits() == before  # neither b nor the base reused a's cached prompt
        out = llm.generate([PROMPTS[1]], plain, lora_request=_lora(adapters, "a"))[0]
        assert hits() > before  # a's own prompt is reused under a
        _assert_matches(_lmdock(out), _output_part(refs["a", 1]))


def test_max_loras_evicts_and_reloads(stories: str, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    with LLM(stories, backend="hf", build={"max_loras": 1}) as llm:
        for name in ("a", "b", "a"):
            _assert_matches(_lmdock(llm.generate([PROMPTS[0]], GREEDY, lora_request=_lora(adapters, name))[0]), refs[name, 0])
        store = llm.engine.engine.adapters
        assert len(store.loaded) == 1 and store.loads == 3


def test_a_batch_over_max_loras_reads_each_adapter_once(stories: str, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    """Two adapters in flight past max_loras = 1: a step keeps every adapter it runs (eviction is once
    per step, not per forward, where the decode forward dropped the adapter a prefill forward of the
    same step then read again).  One read more than the two is allowed: b, read at submit, may be
    dropped by a step that runs only a before b's first step."""
    with LLM(stories, backend="hf", build={"max_loras": 1}) as llm:
        loras = [_lora(adapters, "a"), _lora(adapters, "b")]
        outs = llm.generate([PROMPTS[0]] * 2, GREEDY, lora_request=loras)
        for out, lora in zip(outs, loras):
            _assert_matches(_lmdock(out), refs[lora.name, 0])
        assert llm.engine.engine.adapters.loads <= 3


def test_a_bad_adapter_fails_its_request_alone(lora_llm: LLM, adapters: dict[str, Path], tmp_path: Path, refs: dict[Any, Any]) -> None:
    with pytest.raises(RequestError, match=r"lora_request 'nope': .*adapter_config.json does not exist"):
        lora_llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("nope", tmp_path))
    good = lora_llm.generate_async(PROMPTS[0], GREEDY, lora_request=_lora(adapters, "a"))
    with pytest.raises(RequestError, match="nope"):
        lora_llm.generate_async(PROMPTS[0], GREEDY, lora_request=LoRARequest("nope", tmp_path))
    _assert_matches(_lmdock(good.result(timeout=120)), refs["a", 0])


def test_adapters_on_the_offload_engine_match_peft(stories: str, adapters: dict[str, Path], refs: dict[Any, Any], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decoder layer streamed from disk (``[offload]``): the wrapped projections still add each
    row's adapter, in a batch that mixes the base model and both adapters."""
    monkeypatch.setenv("LMDOCK_CACHE_DIR", str(tmp_path))
    loras = [None, _lora(adapters, "a"), _lora(adapters, "b")]
    with LLM(stories, backend="hf", offload={"weights_gpu_percent": 0, "weights_cpu_percent": 0}) as llm:
        outs = llm.generate([PROMPTS[0]] * 3, GREEDY, lora_request=loras)
    for out, lora in zip(outs, loras):
        _assert_matches(_lmdock(out), refs[lora.name if lora else None, 0])
