"""LoRA adapters on lmdock-mlx (issue 33), against mlx-lm's own LoRA layers as the reference.

The adapters are PEFT folders written here (random low-rank weights from a fixed seed, PEFT's
tensor names and adapter_config.json) for stories260K.  The reference is mlx-lm run directly, a full
forward per token, with each targeted layer replaced by ``mlx_lm.tuner.lora.LoRALinear`` (unmerged)
or by that layer fused into the weights (merged): code outside the code under test.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from lmdock import LLM, LoRARequest, RequestError, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NEW = 16
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, logprobs=0, prompt_logprobs=0)
#: |lmdock - reference| logprob bound: both run float32, the add is the same sum in another order
TOL = 1e-4
PROMPTS = [[1, 403, 407, 261, 378], [1, 403, 407, 261, 378, 432, 383, 286, 261, 376]]
#: stories260K's greedy continuation of PROMPTS[0] (../shared/models/README.md)
GREEDY_16 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]
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


def _linear_shapes(stories: str) -> dict[str, tuple[int, int]]:
    from mlx_lm import load

    model, _ = load(stories)
    return {name: tuple(m.weight.shape) for name, m in model.named_modules() if name.endswith("_proj")}


def _write_adapter(folder: Path, shapes: dict[str, tuple[int, int]], seed: int, targets: list[str], r: int, alpha: int,
                   extra: dict[str, Any], in_scale: int = 1) -> Path:
    """A PEFT adapter folder as ``save_pretrained`` writes it (names, config), with random weights."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (out_f, in_f) in sorted(shapes.items()):
        if name.rpartition(".")[2] in targets:
            in_f *= in_scale
            tensors[f"base_model.model.{name}.lora_A.weight"] = mx.array(rng.normal(0, 1 / np.sqrt(in_f), (r, in_f)).astype(np.float32))
            tensors[f"base_model.model.{name}.lora_B.weight"] = mx.array(rng.normal(0, 0.5, (out_f, r)).astype(np.float32))
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "adapter_model.safetensors"), tensors)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "bias": "none", **extra}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def adapters(stories: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    shapes = _linear_shapes(stories)
    return {name: _write_adapter(root / name, shapes, seed, *SPECS[name]) for seed, name in enumerate(SPECS, 1)}


def _reference(stories: str, adapter: Path | None, prompt: list[int], merged: bool = False) -> tuple[list[int], list[float]]:
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
    for _ in range(NEW):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1])))
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return ids[len(prompt):], [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _walk(model: Any, name: str) -> Any:
    for part in name.split("."):
        model = model[int(part)] if isinstance(model, list) else getattr(model, part)
    return model


@pytest.fixture(scope="module")
def refs(stories: str, adapters: dict[str, Path]) -> dict[tuple[str | None, int], tuple[list[int], list[float]]]:
    return {(name, i): _reference(stories, adapters.get(name) if name else None, p)
            for name in (None, "a", "b") for i, p in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def lora_llm(stories: str) -> Iterator[LLM]:
    with LLM(stories, backend="mlx", scheduler={"max_num_seqs": 8}) as llm:
        yield llm


def _lmdock(out: Any) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    prompt = [] if out.prompt_logprobs is None else [out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i > 0]
    return list(c.token_ids), prompt + [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


def _output_part(ref: tuple[list[int], list[float]]) -> tuple[list[int], list[float]]:
    return ref[0], ref[1][-NEW:]


def _assert_matches(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=TOL)


def _lora(adapters: dict[str, Path], name: str) -> LoRARequest:
    return LoRARequest(name, adapters[name])


def test_the_adapters_change_the_output(refs: dict[Any, Any]) -> None:
    """The test is meaningful: each adapter moves the greedy output and the logprobs away from the base."""
    for i in range(len(PROMPTS)):
        for name in ("a", "b"):
            assert refs[name, i][0] != refs[None, i][0]
            assert max(abs(x - y) for x, y in zip(refs[name, i][1], refs[None, i][1])) > 0.5
    assert refs[None, 0][0] == GREEDY_16  # the reference agrees with the known greedy output


def test_an_adapter_matches_mlx_lm_lora_unmerged_and_merged(lora_llm: LLM, adapters: dict[str, Path], refs: dict[Any, Any], stories: str) -> None:
    for name in ("a", "b"):
        for i, prompt in enumerate(PROMPTS):
            _assert_matches(_lmdock(lora_llm.generate([prompt], GREEDY, lora_request=_lora(adapters, name))[0]), refs[name, i])
        _assert_matches(_lmdock(lora_llm.generate([PROMPTS[0]], GREEDY, lora_request=_lora(adapters, name))[0]),
                        _reference(stories, adapters[name], PROMPTS[0], merged=True))


def test_the_base_model_is_unchanged_beside_loaded_adapters(lora_llm: LLM, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    from lmdock_mlx._lora import LoRALinear

    lora_llm.generate([PROMPTS[0]], GREEDY, lora_request=_lora(adapters, "a"))
    # the wrappers are in place only while a forward with adapters is built
    assert not [name for name, m in lora_llm.engine.engine.model.named_modules() if isinstance(m, LoRALinear)]
    for i, prompt in enumerate(PROMPTS):
        _assert_matches(_lmdock(lora_llm.generate([prompt], GREEDY)[0]), refs[None, i])


def test_a_mixed_batch_equals_each_request_alone(lora_llm: LLM, adapters: dict[str, Path], refs: dict[Any, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Base, adapter a and adapter b (two prompts each) in one batch: the decode group's forwards (and
    the steps run ahead from them) mix all three."""
    loras = [None, _lora(adapters, "a"), _lora(adapters, "b")] * 2
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    store = lora_llm.engine.engine.adapters
    rows: list[list[Any]] = []
    select = store.select
    monkeypatch.setattr(store, "select", lambda loras: (rows.append(list(loras)), select(loras))[1])
    outs = lora_llm.generate(prompts, GREEDY, lora_request=loras)
    for out, lora, prompt in zip(outs, loras, prompts):
        _assert_matches(_lmdock(out), refs[lora.name if lora else None, PROMPTS.index(prompt)])
    mixed = [r for r in rows if len({lora.name if lora else None for lora in r}) == 3]
    assert len(mixed) >= NEW - 2  # one forward for the six rows per decode step, not one per adapter


def test_the_prefix_cache_is_not_shared_across_adapters(stories: str, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    """A prompt computed under adapter a is cached; the same prompt under b or the base model must not
    reuse it, and under a it is reused."""
    plain = GREEDY.replace(prompt_logprobs=None)  # prompt logprobs turn the reuse off
    with LLM(stories, backend="mlx") as llm:
        hits = lambda: llm.stats()["prefix_cache_hit_tokens"]  # noqa: E731
        _assert_matches(_lmdock(llm.generate([PROMPTS[1]], GREEDY, lora_request=_lora(adapters, "a"))[0]), refs["a", 1])
        before = hits()
        _assert_matches(_lmdock(llm.generate([PROMPTS[1]], plain, lora_request=_lora(adapters, "b"))[0]), _output_part(refs["b", 1]))
        _assert_matches(_lmdock(llm.generate([PROMPTS[1]], plain)[0]), _output_part(refs[None, 1]))
        assert hits() == before
        out = llm.generate([PROMPTS[1]], plain, lora_request=_lora(adapters, "a"))[0]
        assert hits() > before
        _assert_matches(_lmdock(out), _output_part(refs["a", 1]))


def test_max_loras_evicts_and_reloads(stories: str, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    with LLM(stories, backend="mlx", build={"max_loras": 1}) as llm:
        for name in ("a", "b", "a"):
            _assert_matches(_lmdock(llm.generate([PROMPTS[0]], GREEDY, lora_request=_lora(adapters, name))[0]), refs[name, 0])
        store = llm.engine.engine.adapters
        assert len(store.loaded) == 1 and store.loads == 3
        assert llm.engine.engine.max_loras == 1


def test_max_lora_rank_refuses_a_higher_rank(stories: str, adapters: dict[str, Path], refs: dict[Any, Any]) -> None:
    with LLM(stories, backend="mlx", build={"max_lora_rank": 2}) as llm:
        with pytest.raises(RequestError, match=r"lora_request 'a': rank 4 exceeds build.max_lora_rank = 2"):
            llm.generate([PROMPTS[0]], GREEDY, lora_request=_lora(adapters, "a"))
        _assert_matches(_lmdock(llm.generate([PROMPTS[0]], GREEDY)[0]), refs[None, 0])


def test_a_bad_adapter_fails_its_request_alone(lora_llm: LLM, adapters: dict[str, Path], tmp_path: Path, refs: dict[Any, Any], stories: str) -> None:
    with pytest.raises(RequestError, match=r"lora_request 'nope': .*adapter_config.json does not exist"):
        lora_llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("nope", tmp_path))
    shapes = _linear_shapes(stories)
    wide = _write_adapter(tmp_path / "wide", shapes, 3, ["q_proj"], 4, 8, {}, in_scale=2)
    dora = _write_adapter(tmp_path / "dora", shapes, 3, ["q_proj"], 4, 8, {"use_dora": True})
    good = lora_llm.generate_async(PROMPTS[0], GREEDY, lora_request=_lora(adapters, "a"))
    with pytest.raises(RequestError, match=r"lora_request 'wide': .*q_proj.* do not fit the model's layer \(64 x 64\)"):
        lora_llm.generate_async(PROMPTS[0], GREEDY, lora_request=LoRARequest("wide", wide))
    with pytest.raises(RequestError, match=r"lora_request 'dora': adapter_config.json sets use_dora \(other than False\)"):
        lora_llm.generate_async(PROMPTS[0], GREEDY, lora_request=LoRARequest("dora", dora))
    _assert_matches(_lmdock(good.result(timeout=120)), refs["a", 0])


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
            lora = LoRALinear.from_base(module, r=4, scale=2.0)
            lora.lora_a = weights[f"base_model.model.{name}.lora_A.weight"].T
            lora.lora_b = weights[f"base_model.model.{name}.lora_B.weight"].T
            setattr(_walk(model, name.rpartition(".")[0]), name.rpartition(".")[2], lora)
    ids = list(PROMPTS[0])
    for _ in range(NEW):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1])))
    with LLM(stories, backend="mlx", quantization={"algo": "int8_weight_only"}) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY.replace(prompt_logprobs=None), lora_request=_lora(adapters, "a"))[0]
    assert list(out.outputs[0].token_ids) == ids[len(PROMPTS[0]):]


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
