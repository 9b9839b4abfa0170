"""tools/zoo_gguf.py keeps out of the family run the GGUFs that are not the checkpoint they came from:
llama.cpp would run them faithfully, and differently from transformers, without any error."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent
BAMBA = HERE / "data" / "bamba-tiny.gguf"  # a granite-hybrid GGUF roping all 32 dimensions of each head
STORIES = Path(os.environ.get("LMDOCK_MODELS", "../shared/models")) / "stories260K-gguf" / "stories260K.gguf"  # llama, no window


def _tool():
    spec = importlib.util.spec_from_file_location("zoo_gguf", HERE.parent / "tools" / "zoo_gguf.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_a_window_the_file_does_not_hold_is_named() -> None:
    mistral = {"model_type": "mistral", "sliding_window": 16, "max_position_embeddings": 512, "num_hidden_layers": 2,
               "hidden_size": 64, "num_attention_heads": 8}
    why = _tool().lost(mistral, STORIES)
    assert why is not None and "drops the 16-token sliding window" in why
    assert _tool().lost({**mistral, "sliding_window": None}, STORIES) is None  # the same file, for a checkpoint without one


@pytest.mark.parametrize(("factor", "lost"), [(1.0, False), (0.5, True)])
def test_a_partial_rotary_dimension_the_file_does_not_hold_is_named(factor: float, lost: bool) -> None:
    bamba = {"model_type": "bamba", "head_dim": 32, "attn_layer_indices": [1],
             "rope_parameters": {"rope_type": "default", "partial_rotary_factor": factor}}
    why = _tool().lost(bamba, BAMBA)
    assert (why is not None) == lost, why
    if lost:
        assert "ropes 16 of each head's 32" in why


def test_the_converters_reason_is_its_exception_line() -> None:
    log = "INFO:hf-to-gguf:Loading model\nTraceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'n_ctx'\n"
    assert _tool()._error_line(log) == "KeyError: 'n_ctx'"  # noqa: SLF001


def test_a_file_llama_cpp_cannot_load_gives_its_error_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(BAMBA.read_bytes()[: 4096])  # the header, no tensors
    why = _tool().loads(broken)
    assert why is not None and why.startswith("llama.cpp cannot load the converted file: "), why
    assert _tool().loads(BAMBA) is None
