"""lmdock-mlx runs Granite 4 hybrids and Bamba on mlx-lm's granitemoehybrid port
(lmdock_mlx._granite_hybrid): the config translations, the refusals where the port computes something
else than transformers, and Bamba's load (renamed weights, half the head rotated).  The family tests
compare the tokens with transformers' (docs/model-families.md)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from lmdock import UnsupportedError
from lmdock_mlx._engine import config_overrides
from lmdock_mlx._granite_hybrid import bamba_weights

GRANITE = {"model_type": "granitemoehybrid", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
           "layer_types": ["linear_attention", "full_attention"], "position_embedding_type": None, "mamba_n_groups": 1}
BAMBA = {"model_type": "bamba", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "max_position_embeddings": 512, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "attention_bias": False,
         "rms_norm_eps": 1e-5, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_proj_bias": False,
         "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True, "mlp_bias": False,
         "tie_word_embeddings": False, "time_step_limit": [0.0, float("inf")], "eos_token_id": 2, "bos_token_id": 1,
         "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}}


def test_granite_layer_types_and_positions_are_told_as_mlx_lm_reads_them() -> None:
    out = config_overrides(GRANITE)
    assert out["layer_types"] == ["mamba", "attention"]
    # transformers adds rotary positions only for "rope"; mlx-lm unless "nope": null must become "nope"
    assert out["position_embedding_type"] == "nope"
    assert config_overrides({**GRANITE, "position_embedding_type": "rope"}).get("position_embedding_type") is None  # already "rope"
    no_types = {k: v for k, v in GRANITE.items() if k != "layer_types"}
    assert config_overrides(no_types)["layer_types"] == ["mamba", "mamba"]  # transformers' default: all Mamba
    assert "layer_types" not in config_overrides({**GRANITE, "layer_types": ["mamba", "attention"]})


def test_an_infinite_time_step_limit_reaches_mlx_lm_as_a_number() -> None:
    # transformers 5 writes infinity tagged; mlx-lm 0.30 passed the dict on and its SSM step failed
    tagged = {"time_step_limit": [0.0, {"__float__": "Infinity"}]}
    assert config_overrides({**GRANITE, **tagged})["time_step_limit"] == [0.0, float("inf")]
    assert config_overrides({**BAMBA, **tagged})["time_step_limit"] == [0.0, float("inf")]
    assert "time_step_limit" not in config_overrides({**GRANITE, "time_step_limit": [0.001, 100.0]})


@pytest.mark.parametrize(("change", "match"), [({"mamba_n_groups": 2}, "one group"), ({"head_dim": 16}, "head size"),
                                               ({"layer_types": ["linear_attention", "sliding_attention"]}, "sliding_attention"),
                                               ({"position_embedding_type": "rope", "rope_parameters": {"partial_rotary_factor": 0.5}},
                                                "whole head")])
def test_what_mlx_lms_port_computes_otherwise_is_refused(change: dict, match: str) -> None:
    with pytest.raises(UnsupportedError, match=match):
        config_overrides({**GRANITE, **change})


def test_bamba_becomes_a_dense_granite_hybrid_without_multipliers() -> None:
    out = config_overrides(BAMBA)
    assert out["layer_types"] == ["mamba", "attention"]
    assert out["attention_multiplier"] == pytest.approx(32 ** -0.5)
    assert (out["embedding_multiplier"], out["residual_multiplier"], out["logits_scaling"]) == (1.0, 1.0, 1.0)
    assert out["position_embedding_type"] == "rope" and out["partial_rotary_factor"] == 0.5
    assert "num_local_experts" not in out
    with pytest.raises(UnsupportedError, match="one group"):
        config_overrides({**BAMBA, "mamba_n_groups": 2})


def test_bamba_weights_are_renamed_in_memory() -> None:
    names = ["model.layers.0.feed_forward.gate_proj.weight", "model.layers.0.pre_ff_layernorm.weight",
             "model.final_layernorm.weight", "model.layers.0.mamba.in_proj.weight"]
    assert sorted(bamba_weights({n: n for n in names})) == sorted(
        ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.post_attention_layernorm.weight", "model.norm.weight",
         "model.layers.0.mamba.in_proj.weight"])


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A tiny random-weight Bamba checkpoint under Bamba's weight names, and its weights by mlx-lm's names."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import granitemoehybrid as gmh

    stories = Path(os.environ.get("LMDOCK_MODELS", "../shared/models")) / "stories260K"
    if not (stories / "tokenizer.json").is_file():
        pytest.fail("set LMDOCK_MODELS to the folder that holds stories260K")
    mx.random.seed(38)
    args = {**BAMBA, **config_overrides(BAMBA), "model_type": "granitemoehybrid"}
    weights = {k: mx.random.normal(v.shape) * 0.2 for k, v in tree_flatten(gmh.Model(gmh.ModelArgs.from_dict(args)).parameters())}
    back = {v: k for k, v in {"feed_forward": "mlp", "pre_ff_layernorm": "post_attention_layernorm"}.items()}
    saved = {".".join(back.get(p, p) for p in k.split(".")).replace("model.norm.", "model.final_layernorm."): v for k, v in weights.items()}
    folder = tmp_path_factory.mktemp("bamba")
    mx.save_safetensors(str(folder / "model.safetensors"), saved)
    (folder / "config.json").write_text(json.dumps(BAMBA))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        if (stories / name).is_file():
            shutil.copy(stories / name, folder / name)
    return folder, weights


def test_bamba_loads_on_mlx_lms_port_with_half_the_head_rotated(bamba: tuple[Path, dict]) -> None:
    import mlx.core as mx
    from lmdock_mlx._granite_hybrid import load_bamba
    from mlx.utils import tree_flatten

    folder, weights = bamba
    before = sorted(p.name for p in folder.iterdir())
    model, tokenizer = load_bamba(str(folder), model_config=config_overrides(BAMBA))
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written to the user's folder
    assert model.layers[1].self_attn.rope.dims == 16  # of 32: Bamba's partial_rotary_factor 0.5
    loaded = dict(tree_flatten(model.parameters()))
    assert sorted(loaded) == sorted(weights) and all(mx.array_equal(loaded[k], weights[k]).item() for k in weights)
    logits = np.array(model(mx.array([[1, 403, 407, 261]]))[0])
    assert np.isfinite(logits).all() and tokenizer.eos_token_id is not None


def test_a_bamba_hub_id_is_refused_with_what_to_do() -> None:
    from lmdock_mlx._granite_hybrid import load_bamba

    with pytest.raises(UnsupportedError, match="local folder"):
        load_bamba("ibm-ai-platform/Bamba-9B", model_config={})
