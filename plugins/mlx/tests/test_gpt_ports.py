"""lmdock-mlx runs transformers 5's GPT-2 and gpt-oss checkpoints on mlx-lm's ports, translating the
tensors in memory (lmdock_mlx._gpt2, lmdock_mlx._gpt_oss): the loads, the expert layout, YaRN's
untruncated frequencies and the refusals where the ports compute something else.  The family tests
compare the tokens with transformers' generate (docs/model-families.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _checkpoints import write_checkpoint
from lmdock import UnsupportedError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GPT2 = {"model_type": "gpt2", "activation_function": "gelu_new", "n_embd": 64, "n_head": 2, "n_inner": 128, "n_layer": 2,
        "n_positions": 512, "layer_norm_epsilon": 1e-5, "vocab_size": 512, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2}
GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 32, "head_dim": 32, "num_attention_heads": 2,
           "num_key_value_heads": 1, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16, "max_position_embeddings": 512,
           "vocab_size": 512, "rms_norm_eps": 1e-5, "attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "original_max_position_embeddings": 4096, "truncate": False},
           "bos_token_id": 1, "eos_token_id": 2}

#: transformers 5.24's inv_freq for GPT_OSS's rotary parameters (head_dim 32), from
#: ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(head_dim=32, hidden_size=64, num_attention_heads=2,
#: max_position_embeddings=512, rope_parameters=GPT_OSS["rope_parameters"]), "cpu")[0]
TRANSFORMERS_YARN_INV_FREQ = [1.0, 0.47478205, 0.225418, 0.10702442, 0.050813273, 0.019335002, 0.0067949593, 0.0020937927,
                              0.00045648392, 3.8308812e-05, 1.8188337e-05, 8.6354958e-06, 4.0999785e-06, 1.9465963e-06,
                              9.2420896e-07, 4.3879785e-07]


def _checkpoint(folder: Path, config: dict, weights: dict) -> Path:
    return write_checkpoint(folder, config, weights)


def _load_untouched(tmp_path: Path, config: dict, saved: dict, load: Any) -> dict:
    """Load ``saved`` through ``load`` (lmdock-mlx's loader for the family); the user's folder is only read.
    The model and its parameters by name."""
    from lmdock_mlx._engine import config_overrides
    from mlx.utils import tree_flatten

    folder = _checkpoint(tmp_path, config, saved)
    before = sorted(p.name for p in folder.iterdir())
    model, _ = load(str(folder), config_overrides(config))
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written to the user's folder
    return {"model": model, "loaded": dict(tree_flatten(model.parameters()))}


def _random(shapes: dict[str, tuple[int, ...]], seed: int) -> dict:
    import mlx.core as mx

    mx.random.seed(seed)
    return {k: mx.random.normal(s) * 0.2 for k, s in shapes.items()}


# -- GPT-2 ----------------------------------------------------------------------------------------

def _gpt2_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """transformers 5's names and (Conv1D: in, out) shapes."""
    d, inner = c["n_embd"], c["n_inner"]
    out = {"transformer.wte.weight": (c["vocab_size"], d), "transformer.wpe.weight": (c["n_positions"], d),
           "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,), "lm_head.weight": (c["vocab_size"], d)}
    for i in range(c["n_layer"]):
        h = f"transformer.h.{i}."
        out.update({h + "ln_1.weight": (d,), h + "ln_1.bias": (d,), h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
                    h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
                    h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
                    h + "mlp.c_fc.weight": (d, inner), h + "mlp.c_fc.bias": (inner,),
                    h + "mlp.c_proj.weight": (inner, d), h + "mlp.c_proj.bias": (d,)})
    return out


def test_gpt2_loads_under_transformers_5s_names_with_its_width_and_untied_head(tmp_path: Path) -> None:
    import mlx.core as mx
    from lmdock_mlx._gpt2 import load_gpt2

    saved = _random(_gpt2_shapes(GPT2), 38)
    out = _load_untouched(tmp_path, GPT2, saved, load_gpt2)
    model, loaded = out["model"], out["loaded"]
    assert len(loaded) == len(saved)
    # Conv1D weights (in, out) become Linear weights (out, in); the 128-wide feed-forward is n_inner's
    assert mx.array_equal(loaded["model.h.1.mlp.c_fc.weight"], saved["transformer.h.1.mlp.c_fc.weight"].T).item()
    assert mx.array_equal(loaded["lm_head.weight"], saved["lm_head.weight"]).item()
    ids = mx.array([[1, 403, 407, 261]])
    hidden = model.model(ids)
    assert mx.allclose(model(ids), hidden @ saved["lm_head.weight"].T, atol=1e-5).item()  # the untied head, not wte


def test_a_tied_gpt2_reads_its_embeddings_as_the_head(tmp_path: Path) -> None:
    import mlx.core as mx
    from lmdock_mlx._engine import config_overrides
    from lmdock_mlx._gpt2 import load_gpt2

    config = {**GPT2, "tie_word_embeddings": True}
    saved = _random(_gpt2_shapes(config), 39)  # lm_head.weight saved as well: transformers ties it to wte
    model, _ = load_gpt2(str(_checkpoint(tmp_path, config, saved)), config_overrides(config))
    ids = mx.array([[1, 403, 407, 261]])
    assert "lm_head" not in model
    assert mx.allclose(model(ids), model.model(ids) @ saved["transformer.wte.weight"].T, atol=1e-5).item()


def test_the_gpt2_context_is_its_n_positions(tmp_path: Path) -> None:
    from lmdock import ModelConfig
    from lmdock_mlx._engine import MlxStepEngine

    folder = _checkpoint(tmp_path, {**GPT2, "n_positions": 96}, _random(_gpt2_shapes({**GPT2, "n_positions": 96}), 40))
    engine = MlxStepEngine.load(ModelConfig(model=str(folder)), None, None, {})
    assert engine.max_seq_len == 96  # not 4096: positions past wpe's rows do not exist


@pytest.mark.parametrize(("change", "match"), [({"activation_function": "relu"}, "tanh approximation"),
                                               ({"scale_attn_weights": False}, "head_dim"),
                                               ({"scale_attn_by_inverse_layer_idx": True}, "head_dim")])
def test_what_mlx_lms_gpt2_computes_otherwise_is_refused(tmp_path: Path, change: dict, match: str) -> None:
    from lmdock_mlx._engine import config_overrides
    from lmdock_mlx._gpt2 import load_gpt2

    config = {**GPT2, **change}
    folder = _checkpoint(tmp_path, config, _random(_gpt2_shapes(GPT2), 41))
    with pytest.raises(UnsupportedError, match=match):
        load_gpt2(str(folder), config_overrides(config))


# -- gpt-oss --------------------------------------------------------------------------------------

def test_gpt_oss_experts_compute_what_transformers_computes() -> None:
    """transformers' GptOssExperts for one token and expert: gate_up = x @ W + b, gate = even columns,
    up = odd ones, out = ((up + 1) * gate * sigmoid(1.702 gate)) @ down + b; the translated weights
    run through mlx-lm's SwitchGLU must give the same."""
    import mlx.core as mx
    from lmdock_mlx._gpt_oss import expert_weights
    from mlx_lm.models.gpt_oss import MLPBlock, ModelArgs

    hidden, inner, experts = 8, 6, 3  # unequal sizes: a transposition cannot pass unnoticed
    rng = np.random.default_rng(38)
    t5 = {"experts.gate_up_proj": rng.normal(size=(experts, hidden, 2 * inner)), "experts.gate_up_proj_bias": rng.normal(size=(experts, 2 * inner)),
          "experts.down_proj": rng.normal(size=(experts, inner, hidden)), "experts.down_proj_bias": rng.normal(size=(experts, hidden)),
          "router.weight": rng.normal(size=(experts, hidden)), "router.bias": rng.normal(size=(experts,))}
    block = MLPBlock(ModelArgs(hidden_size=hidden, intermediate_size=inner, num_local_experts=experts, num_experts_per_tok=1))
    block.load_weights(list(expert_weights({k: mx.array(v.astype(np.float32)) for k, v in t5.items()}).items()))
    x = rng.normal(size=hidden).astype(np.float32)
    e = int(np.argmax(t5["router.weight"] @ x + t5["router.bias"]))  # top-1: its routing weight is 1
    gate_up = x @ t5["experts.gate_up_proj"][e] + t5["experts.gate_up_proj_bias"][e]
    gate, up = np.minimum(gate_up[::2], 7.0), np.clip(gate_up[1::2], -7.0, 7.0)
    want = ((up + 1) * gate / (1 + np.exp(-1.702 * gate))) @ t5["experts.down_proj"][e] + t5["experts.down_proj_bias"][e]
    got = np.array(block(mx.array(x[None, None]))[0, 0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_yarn_untruncated_frequencies_are_transformers() -> None:
    from lmdock_mlx._engine import config_overrides
    from lmdock_mlx._gpt_oss import yarn_freqs
    from mlx_lm.models.rope_utils import initialize_rope

    scaling = config_overrides(GPT_OSS)["rope_scaling"]
    ours = 1 / np.array(yarn_freqs(32, scaling, 150000.0))
    np.testing.assert_allclose(ours, TRANSFORMERS_YARN_INV_FREQ, rtol=1e-5)
    # mlx-lm's own YarnRoPE rounds the correction range (transformers' truncate = true): other frequencies
    theirs = 1 / np.array(initialize_rope(32, 150000.0, False, scaling)._freqs)
    assert not np.allclose(theirs, TRANSFORMERS_YARN_INV_FREQ, rtol=1e-3)


def _gpt_oss_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """transformers 5's names and shapes (experts stacked, multiplied from the right)."""
    d, inner, e, hd = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,), "lm_head.weight": (c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (q, d), p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.v_proj.bias": (kv,),
                    p + "self_attn.o_proj.weight": (d, q), p + "self_attn.o_proj.bias": (d,), p + "self_attn.sinks": (c["num_attention_heads"],),
                    p + "mlp.router.weight": (e, d), p + "mlp.router.bias": (e,),
                    p + "mlp.experts.gate_up_proj": (e, d, 2 * inner), p + "mlp.experts.gate_up_proj_bias": (e, 2 * inner),
                    p + "mlp.experts.down_proj": (e, inner, d), p + "mlp.experts.down_proj_bias": (e, d)})
    return out


def test_gpt_oss_loads_transformers_5s_layout_with_its_frequencies(tmp_path: Path) -> None:
    import mlx.core as mx
    from lmdock_mlx._gpt_oss import load_gpt_oss

    saved = _random(_gpt_oss_shapes(GPT_OSS), 42)
    out = _load_untouched(tmp_path, GPT_OSS, saved, load_gpt_oss)
    model, loaded = out["model"], out["loaded"]
    gate_up = saved["model.layers.1.mlp.experts.gate_up_proj"]
    assert mx.array_equal(loaded["model.layers.1.mlp.experts.up_proj.weight"], gate_up[..., 1::2].swapaxes(1, 2)).item()
    assert mx.array_equal(loaded["model.layers.0.self_attn.sinks"], saved["model.layers.0.self_attn.sinks"]).item()
    for layer in model.layers:
        np.testing.assert_allclose(1 / np.array(layer.self_attn.rope._freqs), TRANSFORMERS_YARN_INV_FREQ, rtol=1e-5)
    assert np.isfinite(np.array(model(mx.array([[1, 403, 407, 261]])))).all()


@pytest.mark.parametrize("change", [{"swiglu_alpha": 1.5}, {"swiglu_limit": 10.0}, {"attention_bias": False}])
def test_what_mlx_lms_gpt_oss_fixes_otherwise_is_refused(tmp_path: Path, change: dict) -> None:
    from lmdock_mlx._engine import config_overrides
    from lmdock_mlx._gpt_oss import load_gpt_oss

    config = {**GPT_OSS, **change}
    folder = _checkpoint(tmp_path, config, _random(_gpt_oss_shapes(GPT_OSS), 43))
    with pytest.raises(UnsupportedError, match=f"{next(iter(change))}=.*fixes it"):
        load_gpt_oss(str(folder), config_overrides(config))


@pytest.mark.parametrize("family", ["gpt2", "gpt_oss"])
def test_a_hub_id_is_refused_with_what_to_do(family: str) -> None:
    from lmdock_mlx._engine import LOADERS

    with pytest.raises(UnsupportedError, match="local folder"):
        LOADERS[family](f"someone/{family}-model", model_config={})
