"""lmdock-mlx tells mlx-lm the transformers 5 config keys it reads under older names (KEY_NAMES); the
family tests show the effect (qwen3_moe and lfm2 load and run exactly: docs/model-families.md)."""

from __future__ import annotations

from lmdock_mlx._engine import KEY_NAMES, config_overrides


def test_renamed_keys_are_passed_under_mlx_lms_names() -> None:
    assert config_overrides({"model_type": "qwen3_moe", "num_local_experts": 4}) == {"num_experts": 4}
    assert config_overrides({"model_type": "gpt2", "n_positions": 512}) == {"n_ctx": 512}
    assert config_overrides({"model_type": "lfm2", "hidden_size": 64}) == {"block_dim": 64}


def test_a_key_already_there_or_another_family_is_left_alone() -> None:
    assert config_overrides({"model_type": "qwen3_moe", "num_experts": 8, "num_local_experts": 4}) == {}
    assert config_overrides({"model_type": "llama", "num_local_experts": 4}) == {}
    assert set(KEY_NAMES) == {"qwen3_moe", "gpt2", "lfm2"}
