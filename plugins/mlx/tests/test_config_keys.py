"""lmdock-mlx tells mlx-lm the transformers 5 config keys it reads under older names (KEY_NAMES) or in
another form (KEY_VALUES, the rotary parameters); the family tests show the effect (qwen3_moe, lfm2,
gemma3_text and qwen3_next load and run exactly: docs/model-families.md)."""

from __future__ import annotations

import pytest
from lmdock import UnsupportedError
from lmdock_mlx._engine import KEY_NAMES, config_overrides


def test_renamed_keys_are_passed_under_mlx_lms_names() -> None:
    assert config_overrides({"model_type": "qwen3_moe", "num_local_experts": 4}) == {"num_experts": 4}
    assert config_overrides({"model_type": "gpt2", "n_positions": 512}) == {"n_ctx": 512}
    assert config_overrides({"model_type": "lfm2", "hidden_size": 64}) == {"block_dim": 64}


def test_a_key_already_there_or_another_family_is_left_alone() -> None:
    assert config_overrides({"model_type": "qwen3_moe", "num_experts": 8, "num_local_experts": 4}) == {}
    assert config_overrides({"model_type": "llama", "num_local_experts": 4}) == {}
    assert set(KEY_NAMES) == {"qwen3_moe", "gpt2", "lfm2"}


def test_layer_types_become_the_every_nth_layer_pattern_mlx_lm_reads() -> None:
    pair = ["sliding_attention", "full_attention"]
    assert config_overrides({"model_type": "gemma3_text", "layer_types": pair * 3})["sliding_window_pattern"] == 2
    five_one = ["sliding_attention"] * 5 + ["full_attention"]
    assert config_overrides({"model_type": "gemma3_text", "layer_types": five_one * 2})["sliding_window_pattern"] == 6
    qwen3_next = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    assert config_overrides({"model_type": "qwen3_next", "layer_types": qwen3_next})["full_attention_interval"] == 4
    # a value already there is left alone
    assert "sliding_window_pattern" not in config_overrides({"model_type": "gemma3_text", "layer_types": pair, "sliding_window_pattern": 2})


@pytest.mark.parametrize("types", [["sliding_attention", "full_attention", "full_attention"], ["sliding_attention"] * 2,
                                   ["full_attention", "sliding_attention"]])
def test_layer_types_with_no_such_pattern_are_refused(types: list[str]) -> None:
    with pytest.raises(UnsupportedError, match="cannot run this arrangement"):
        config_overrides({"model_type": "gemma3_text", "layer_types": types})


def test_rotary_parameters_per_layer_type_give_gemma_3s_two_bases() -> None:
    rope = {"full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}
    out = config_overrides({"model_type": "gemma3_text", "rope_parameters": rope})
    assert out["rope_theta"] == 1e6 and out["rope_local_base_freq"] == 1e4
    assert out["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}  # mlx-lm scales only the global layers
    scaled_local = {**rope, "sliding_attention": {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}}
    with pytest.raises(UnsupportedError, match="sliding layers"):
        config_overrides({"model_type": "gemma3_text", "rope_parameters": scaled_local})


def test_gpt_oss_yarn_and_a_partial_rotary_factor_reach_mlx_lm() -> None:
    yarn = {"rope_theta": 150000.0, "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0}
    assert config_overrides({"model_type": "gpt_oss", "rope_parameters": yarn})["rope_scaling"] == {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0}
    with pytest.raises(UnsupportedError, match="rope_type 'yarn'"):  # elsewhere still an error: mlx-lm would not read it
        config_overrides({"model_type": "llama", "rope_parameters": yarn})
    out = config_overrides({"model_type": "qwen3_next", "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}})
    assert out["partial_rotary_factor"] == 0.25
