"""LoRA adapters on lmdock-hf (issue 33), against PEFT on transformers as the reference.

The adapters are made here with PEFT on stories260K (random low-rank weights from a fixed seed:
PEFT's default init is a no-op until trained) and saved with ``save_pretrained``; the reference is
``PeftModel.from_pretrained`` on transformers in float32, unmerged and merged (code outside the code
under test: peft is a test tool only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lmdock import LLM
from lmdock_conformance import lora_reference as shared

peft = pytest.importorskip("peft", reason="peft (a test tool: scripts/test.sh installs it into the hf env)")


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


#: stories260K on hf, eight sequences at a time
lora_llm = shared.lora_llm_fixture("hf")


def _reference(stories: str, adapter: Path | None, prompt: list[int], merged: bool = False) -> shared.Run:
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
        for _ in range(shared.NEW):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return ids[len(prompt):], [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


#: the reference's runs, by (adapter name or None, prompt index)
refs = shared.refs_fixture(_reference)


class TestAgainstTheReference(shared.LoRAReferenceTests):
    backend = "hf"
    reference = staticmethod(_reference)
    merged_names = ("a",)


def test_the_base_model_is_unchanged_beside_loaded_adapters(lora_llm: LLM, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    lora_llm.generate([shared.PROMPTS[0]], shared.GREEDY, lora_request=shared.lora(adapters, "a"))  # adapter a's layers are wrapped now
    for i, prompt in enumerate(shared.PROMPTS):
        shared.assert_matches(shared.ran(lora_llm.generate([prompt], shared.GREEDY)[0]), refs[None, i])


def test_a_mixed_batch_equals_each_request_alone(lora_llm: LLM, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    """Base, adapter a and adapter b (two prompts each) in one batch: decode forwards mix all three."""
    engine = lora_llm.engine.engine
    calls = engine.forward_calls
    shared.check_a_mixed_batch(lora_llm, adapters, refs)
    # 6 prefills, then the decode steps ran the six rows together (not one forward per adapter)
    assert engine.forward_calls - calls < 6 + 2 * shared.NEW


def test_a_batch_over_max_loras_reads_each_adapter_once(stories: str, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    """Two adapters in flight past max_loras = 1: a step keeps every adapter it runs (eviction is once
    per step, not per forward, where the decode forward dropped the adapter a prefill forward of the
    same step then read again).  One read more than the two is allowed: b, read at submit, may be
    dropped by a step that runs only a before b's first step."""
    with LLM(stories, backend="hf", build={"max_loras": 1}) as llm:
        loras = [shared.lora(adapters, "a"), shared.lora(adapters, "b")]
        outs = llm.generate([shared.PROMPTS[0]] * 2, shared.GREEDY, lora_request=loras)
        for out, req in zip(outs, loras):
            shared.assert_matches(shared.ran(out), refs[req.name, 0])
        assert llm.engine.engine.adapters.loads <= 3


def test_adapters_on_the_offload_engine_match_peft(stories: str, adapters: dict[str, Path], refs: dict[Any, Any], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decoder layer streamed from disk (``[offload]``): the wrapped projections still add each
    row's adapter, in a batch that mixes the base model and both adapters."""
    monkeypatch.setenv("LMDOCK_CACHE_DIR", str(tmp_path))
    loras = [None, shared.lora(adapters, "a"), shared.lora(adapters, "b")]
    with LLM(stories, backend="hf", offload={"weights_gpu_percent": 0, "weights_cpu_percent": 0}) as llm:
        outs = llm.generate([shared.PROMPTS[0]] * 3, shared.GREEDY, lora_request=loras)
    for out, req in zip(outs, loras):
        shared.assert_matches(shared.ran(out), refs[req.name if req else None, 0])
