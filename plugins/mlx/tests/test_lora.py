"""LoRA adapters on lmdock-mlx (issue 33), against mlx-lm's own LoRA layers as the reference.

The adapters are PEFT folders (random low-rank weights from a fixed seed, PEFT's tensor names and
adapter_config.json) for stories260K, written by ``lmdock_conformance.lora_reference.lora_adapter``;
the prompts, the reading of a run and the checks that need no reference are shared with lmdock-hf's
LoRA tests there.  The reference is mlx-lm run directly, a full
forward per token, with each targeted layer replaced by ``mlx_lm.tuner.lora.LoRALinear`` (unmerged)
or by that layer fused into the weights (merged): code outside the code under test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from lmdock import LLM, RequestError
from lmdock_conformance import lora_reference as shared

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: per adapter: target modules, rank, alpha, extra adapter_config.json settings
SPECS: dict[str, tuple[list[str], int, int, dict[str, Any]]] = {
    "a": (["q_proj", "v_proj", "o_proj"], 4, 8, {}),
    "b": (["k_proj", "gate_proj", "down_proj"], 4, 8, {"use_rslora": True, "alpha_pattern": {"down_proj": 2}}),
}


@pytest.fixture(scope="module")
def stories() -> str:
    path = Path(os.environ.get("LMDOCK_MODELS", ""), "stories260K")
    if not (path / "config.json").is_file():
        pytest.fail("set LMDOCK_MODELS to the folder that holds stories260K")
    return str(path)


#: stories260K on mlx, eight sequences at a time
lora_llm = shared.lora_llm_fixture("mlx")


@pytest.fixture(scope="module")
def adapters(stories: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: _adapter(stories, root / name, seed, *SPECS[name]) for seed, name in enumerate(SPECS, 1)}


def _adapter(stories: str, folder: Path, seed: int, targets: list[str], rank: int, alpha: int, extra: dict[str, Any], in_scale: int = 1) -> Path:
    return shared.lora_adapter(stories, folder, seed, rank, targets=targets, alpha=alpha, extra=extra, in_scale=in_scale)


def _reference(stories: str, adapter: Path | None, prompt: list[int], merged: bool = False) -> shared.Run:
    """Greedy tokens and the logprob of every token after the first (prompt then output), from
    mlx-lm with its own LoRALinear layers, a full forward per token."""
    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear

    model, _ = load(stories)
    if adapter is not None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        weights = mx.load(str(adapter / "adapter_model.safetensors"))
        r = config["r"]
        for name, module in model.named_modules():
            short = name.rpartition(".")[2]
            if short not in config["target_modules"]:
                continue
            alpha = config.get("alpha_pattern", {}).get(short, config["lora_alpha"])
            lora = LoRALinear.from_base(module, r=r, scale=alpha / (r ** 0.5 if config.get("use_rslora") else r))
            lora.lora_a = weights[f"base_model.model.{name}.lora_A.weight"].T
            lora.lora_b = weights[f"base_model.model.{name}.lora_B.weight"].T
            setattr(_walk(model, name.rpartition(".")[0]), short, lora.fuse() if merged else lora)
    ids = list(prompt)
    for _ in range(shared.NEW):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1])))
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return ids[len(prompt):], [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _walk(model: Any, name: str) -> Any:
    for part in name.split("."):
        model = model[int(part)] if isinstance(model, list) else getattr(model, part)
    return model


#: the reference's runs, by (adapter name or None, prompt index)
refs = shared.refs_fixture(_reference)


class TestAgainstTheReference(shared.LoRAReferenceTests):
    backend = "mlx"
    reference = staticmethod(_reference)
    merged_names = ("a", "b")

    def bad_adapters(self, stories: str, folder: Path) -> dict[str, tuple[Path, str]]:
        """An adapter made for wider layers, and a DoRA adapter."""
        return {"wide": (_adapter(stories, folder / "wide", 3, ["q_proj"], 4, 8, {}, in_scale=2),
                         r"lora_request 'wide': .*q_proj.* do not fit the model's layer \(64 x 64\)"),
                "dora": (_adapter(stories, folder / "dora", 3, ["q_proj"], 4, 8, {"use_dora": True}),
                         r"lora_request 'dora': adapter_config.json sets use_dora \(other than False\)")}


def test_the_base_model_is_unchanged_beside_loaded_adapters(lora_llm: LLM, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    from lmdock_mlx._lora import LoRALinear

    lora_llm.generate([shared.PROMPTS[0]], shared.GREEDY, lora_request=shared.lora(adapters, "a"))
    # the wrappers are in place only while a forward with adapters is built
    assert not [name for name, m in lora_llm.engine.engine.model.named_modules() if isinstance(m, LoRALinear)]
    for i, prompt in enumerate(shared.PROMPTS):
        shared.assert_matches(shared.ran(lora_llm.generate([prompt], shared.GREEDY)[0]), refs[None, i])


def test_a_mixed_batch_equals_each_request_alone(lora_llm: LLM, adapters: dict[str, Path], refs: dict[Any, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Base, adapter a and adapter b (two prompts each) in one batch: the decode group's forwards (and
    the steps run ahead from them) mix all three."""
    store = lora_llm.engine.engine.adapters
    rows: list[list[Any]] = []
    select = store.select
    monkeypatch.setattr(store, "select", lambda loras: (rows.append(list(loras)), select(loras))[1])
    shared.check_a_mixed_batch(lora_llm, adapters, refs)
    mixed = [r for r in rows if len({req.name if req else None for req in r}) == 3]
    assert len(mixed) >= shared.NEW - 2  # one forward for the six rows per decode step, not one per adapter


def test_max_lora_rank_refuses_a_higher_rank(stories: str, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    with LLM(stories, backend="mlx", build={"max_lora_rank": 2}) as llm:
        with pytest.raises(RequestError, match=r"lora_request 'a': rank 4 exceeds build.max_lora_rank = 2"):
            llm.generate([shared.PROMPTS[0]], shared.GREEDY, lora_request=shared.lora(adapters, "a"))
        shared.assert_matches(shared.ran(llm.generate([shared.PROMPTS[0]], shared.GREEDY)[0]), refs[None, 0])


def test_an_adapter_on_a_quantized_model(stories: str, adapters: dict[str, Path]) -> None:
    """On int8 weights (nn.QuantizedLinear) the add runs on the quantized layer's output: the reference
    is mlx-lm's LoRALinear over the same quantized layers."""
    import mlx.nn as nn
    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear

    model, _ = load(stories)
    nn.quantize(model, group_size=64, bits=8, class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0)
    weights = mx.load(str(adapters["a"] / "adapter_model.safetensors"))
    for name, module in list(model.named_modules()):
        if name.rpartition(".")[2] in SPECS["a"][0]:
            layer = LoRALinear.from_base(module, r=4, scale=2.0)
            layer.lora_a = weights[f"base_model.model.{name}.lora_A.weight"].T
            layer.lora_b = weights[f"base_model.model.{name}.lora_B.weight"].T
            setattr(_walk(model, name.rpartition(".")[0]), name.rpartition(".")[2], layer)
    ids = list(shared.PROMPTS[0])
    for _ in range(shared.NEW):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1])))
    with LLM(stories, backend="mlx", quantization={"algo": "int8_weight_only"}) as llm:
        out = llm.generate([shared.PROMPTS[0]], shared.GREEDY.replace(prompt_logprobs=None), lora_request=shared.lora(adapters, "a"))[0]
    assert list(out.outputs[0].token_ids) == ids[len(shared.PROMPTS[0]):]


def test_a_process_that_ran_an_adapter_exits_cleanly(stories: str, adapters: dict[str, Path]) -> None:
    """The adapter is checked in the submitting thread without MLX work and read in the engine thread,
    whose streams go with it (``thread_exit``): the process exits cleanly after running one.  (On Linux
    CPU reading it in the submitting thread exits cleanly as well: this guards the exit, not the
    choice of thread.)"""
    import subprocess
    import sys

    code = (
        "from lmdock import LLM, LoRARequest, SamplingParams\n"
        f"llm = LLM({stories!r}, backend='mlx')\n"
        f"out = llm.generate('Once', SamplingParams(temperature=0, max_new_tokens=3), lora_request=LoRARequest('a', {str(adapters['a'])!r}))\n"
        "print(out[0].outputs[0].text)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "terminate called" not in out.stderr
