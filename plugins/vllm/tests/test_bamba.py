"""Bamba on vLLM's Granite 4 hybrid layers (lmdock_vllm._bamba).  The tokens are checked against
transformers' Bamba by the family tests (lmdock_conformance.test_families, bamba row); these check
the pieces: the names, the refusals and the registration in a process vLLM starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lmdock import UnsupportedError
from lmdock._config.file import model_config
from lmdock_vllm._bamba import hf_overrides, prepare, renamed, unsupported

_CONFIG = {  # the keys the conformance zoo's Bamba has (transformers' BambaConfig, tiny)
    "architectures": ["BambaForCausalLM"], "model_type": "bamba", "hidden_size": 64, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128, "num_hidden_layers": 2, "attn_layer_indices": [1],
    "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_chunk_size": 16, "vocab_size": 512, "hidden_act": "silu", "rms_norm_eps": 1e-5,
}


def _bamba_and_granite():  # type: ignore[no-untyped-def]
    """transformers' Bamba with random weights, and transformers' Granite hybrid built from the same config
    plus the overrides lmdock-vllm hands vLLM."""
    from transformers import BambaConfig, BambaForCausalLM, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    bamba = BambaForCausalLM(BambaConfig(**{k: v for k, v in _CONFIG.items() if k not in ("architectures", "model_type")}))
    keys = {k: v for k, v in _CONFIG.items() if k not in ("architectures", "model_type", "attn_layer_indices")}
    granite = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **keys, **hf_overrides(_CONFIG), layer_types=list(bamba.config.layers_block_type)))
    return bamba, granite


def test_the_renamed_checkpoint_holds_exactly_the_granite_hybrids_tensors() -> None:
    bamba, granite = _bamba_and_granite()
    weights = dict(renamed(bamba.state_dict().items()))
    expected = granite.state_dict()
    assert set(weights) == set(expected)
    assert all(weights[k].shape == expected[k].shape for k in weights)
    fused = weights["model.layers.0.shared_mlp.input_linear.weight"]
    mlp = bamba.model.layers[0].feed_forward
    assert torch.equal(fused, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))  # gate first: SiluAndMul's order


def test_a_feed_forward_half_without_its_pair_is_an_error() -> None:
    stream = [("model.layers.0.feed_forward.gate_proj.weight", torch.zeros(4, 2))]
    with pytest.raises(ValueError, match="without their pair"):
        list(renamed(stream))


def test_a_checkpoint_the_granite_layers_cannot_hold_is_refused_before_vllm_starts(tmp_path: Path) -> None:
    assert unsupported(_CONFIG) is None
    bad = _CONFIG | {"head_dim": 64}  # Granite's attention sizes heads as hidden / heads (32)
    assert "head_dim 64" in (unsupported(bad) or "")
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(UnsupportedError, match="Bamba.*head_dim 64.*backend = 'hf'"):
        prepare(model_config({"model": str(tmp_path)}, source="<test>"))


def test_vllm_registers_bamba_in_a_process_it_starts() -> None:
    """vLLM loads its general plugins in every process (an engine core it spawns included); lmdock-vllm's
    entry point adds Bamba there.  A fresh interpreter that never imports lmdock sees it."""
    probe = (
        "from vllm.plugins import load_general_plugins\n"
        "from vllm import ModelRegistry\n"
        "load_general_plugins()\n"
        "m = ModelRegistry.models['BambaForCausalLM']\n"
        "print(getattr(m, 'module_name', ''), getattr(m, 'class_name', ''))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["lmdock_vllm._bamba_model", "BambaForCausalLM"]
