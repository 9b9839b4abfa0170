"""tools/zoo_gguf.py keeps out of the family run the GGUFs that are not the checkpoint they came from:
llama.cpp would run them faithfully, and differently from transformers, without any error."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
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


def test_a_feed_forward_length_the_file_does_not_hold_is_named() -> None:
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_inner": 128}  # stories260K's file: a feed-forward length of 172
    why = _tool().lost(gpt2, STORIES)
    assert why is not None and "feed-forward length of 172" in why and "n_inner is 128" in why, why
    assert _tool().lost({**gpt2, "n_inner": 172}, STORIES) is None


def test_the_converter_reads_gpt2s_context_under_the_name_it_knows(tmp_path: Path) -> None:
    checkpoint = tmp_path / "gpt2"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "gpt2", "n_positions": 512}')
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "copy").mkdir()
    copy = _tool()._aliased(checkpoint, tmp_path / "copy", {"n_ctx": "n_positions"})  # noqa: SLF001
    assert json.loads((copy / "config.json").read_text()) == {"model_type": "gpt2", "n_positions": 512, "n_ctx": 512}
    assert (copy / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((checkpoint / "config.json").read_text()) == {"model_type": "gpt2", "n_positions": 512}  # untouched
    assert _tool()._aliased(checkpoint, tmp_path / "unused", {}) == checkpoint  # noqa: SLF001


# A stand-in for the sdist's converter (plumbing only: the real one needs torch, which this env lacks; the
# family run converts the zoo with the real one): its BPE vocabulary step, and a script that calls it.
FAKE_BASE = '''
class TextModel:
    def __init__(self, dir_model):
        self.dir_model = dir_model
    def _set_vocab_gpt2(self):
        return "bpe"
    def _set_vocab_sentencepiece(self):
        return "sentencepiece"
'''
FAKE_CONVERTER = '''
import sys
from pathlib import Path
from conversion.base import TextModel
Path(sys.argv[2]).write_text(TextModel(Path(sys.argv[1]))._set_vocab_gpt2())
'''


@pytest.mark.parametrize(("tokenizer", "path"), [("zoo", "sentencepiece"), ("other", "bpe"), (None, "bpe")])
def test_only_the_zoos_tokenizer_leaves_the_bpe_path(tmp_path: Path, tokenizer: str | None, path: str) -> None:
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "__init__.py").write_text("")
    (tmp_path / "conversion" / "base.py").write_text(FAKE_BASE)
    (tmp_path / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    zoo_spm = Path(os.environ.get("LMDOCK_MODELS", "../shared/models")) / "stories260K" / "tokenizer.model"
    if tokenizer is not None:
        (checkpoint / "tokenizer.model").write_bytes(zoo_spm.read_bytes() + (b"" if tokenizer == "zoo" else b"\0"))
    out = tmp_path / "out.txt"
    subprocess.run([sys.executable, str(HERE.parent / "tools" / "zoo_gguf.py"), "--run-converter", str(tmp_path / "convert_hf_to_gguf.py"),
                    str(checkpoint), str(out)], check=True, cwd=tmp_path)
    assert out.read_text() == path


@pytest.mark.parametrize(("arch", "norm", "lost"), [("qwen3moe", False, True), ("qwen3moe", True, False), ("qwen3next", False, True),
                                                    ("qwen2moe", False, False)])
def test_routing_the_file_does_not_hold_is_named(arch: str, norm: bool, lost: bool) -> None:
    why = _tool().routing_lost({"model_type": "qwen3_moe", "norm_topk_prob": norm}, arch)
    assert (why is not None) == lost, why
    if lost:
        assert "norm_topk_prob false" in why
