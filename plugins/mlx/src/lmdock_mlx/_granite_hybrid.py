"""Granite 4 hybrids (granitemoehybrid) and Bamba on mlx-lm's granitemoehybrid port.

Why the translations: transformers 5 writes ``layer_types`` as ``linear_attention`` / ``full_attention``
where mlx-lm 0.32 reads ``mamba`` / ``attention`` (the load fails), and transformers applies RoPE only
when ``position_embedding_type == "rope"`` while mlx-lm applies it unless the value is ``"nope"``: a
config with ``null`` (transformers 5's default, and Granite 4's meaning of "no positions") got
rotary positions in mlx-lm and tokens that differ from the first (measured on the zoo checkpoint:
logits off by up to 4.2 at the 10th position; translated, 4.4e-6).

Bamba is the same network with other names (as lmdock-vllm runs it, ``lmdock_vllm._bamba``): Mamba-2
mixers and attention layers, a dense SwiGLU feed-forward, no multipliers (attention scaled by
``head_dim**-0.5``) and half the head rotated.  :func:`load_bamba` builds mlx-lm's granitemoehybrid
with that configuration, rotary positions on the first ``partial_rotary_factor`` of each head, and the
checkpoint's weights renamed in memory (the user's folder is only read).

Where mlx-lm's port computes something else than transformers, the load is refused: its gated norm
normalizes the Mamba output as one group (transformers: ``mamba_n_groups`` groups), and it derives
the attention head size from ``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

from typing import Any

from lmdock import UnsupportedError

from lmdock_mlx._ports import load_on_port

#: transformers 5's layer types -> mlx-lm's granitemoehybrid layer types
LAYER_KINDS = {"linear_attention": "mamba", "full_attention": "attention"}


def _check_port(config: dict[str, Any]) -> None:
    family = config.get("model_type")
    if int(config.get("mamba_n_groups") or 1) != 1:
        raise UnsupportedError(f"{family} with mamba_n_groups={config['mamba_n_groups']}: mlx-lm 0.32's port normalizes the "
                               "Mamba output as one group where transformers normalizes each group; use backend = 'hf' or 'vllm'")
    heads, width = config.get("num_attention_heads"), config.get("hidden_size")
    if config.get("head_dim") and heads and width and config["head_dim"] != width // heads:
        raise UnsupportedError(f"{family} with head_dim={config['head_dim']} (hidden_size/num_attention_heads = {width // heads}): "
                               "mlx-lm 0.32's port derives the head size from the latter; use backend = 'hf' or 'vllm'")


def granite_layer_types(config: dict[str, Any]) -> list[str] | None:
    """mlx-lm's layer types from transformers 5's (all Mamba where absent, as transformers reads it);
    None where the config already has mlx-lm's."""
    _check_port(config)
    types = config.get("layer_types") or ["linear_attention"] * int(config.get("num_hidden_layers") or 0)
    if all(t in LAYER_KINDS.values() for t in types):
        return None
    unknown = sorted({t for t in types if t not in LAYER_KINDS})
    if unknown:
        raise UnsupportedError(f"granitemoehybrid layer_types {unknown}: lmdock-mlx knows {sorted(LAYER_KINDS)}; use backend = 'hf'")
    return [LAYER_KINDS[t] for t in types]


def granite_positions(config: dict[str, Any]) -> str:
    """``"nope"`` unless the config says ``"rope"``: transformers adds rotary positions only then."""
    if config.get("position_embedding_type") != "rope":
        return "nope"
    if (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedError("granitemoehybrid with a partial_rotary_factor: mlx-lm 0.32's port rotates the whole head; "
                               "use backend = 'hf'")
    return "rope"


def time_step_limit(config: dict[str, Any]) -> list[float] | None:
    """The Mamba time-step clamp as numbers: transformers 5 writes infinity as ``{"__float__": "Infinity"}``,
    which mlx-lm 0.30 passes on as a dict (its SSM step then fails; 0.32 decodes it)."""
    limit = config.get("time_step_limit")
    if not isinstance(limit, list):
        return None
    return [float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else v for v in limit]


def _bamba_rotary(config: dict[str, Any]) -> float:
    # transformers 5's BambaConfig sets 0.5 whatever the config says ("hardcode for BC")
    return float((config.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5))


def _bamba_layer_types(config: dict[str, Any]) -> list[str]:
    _check_port(config)
    attention = set(config.get("attn_layer_indices") or ())
    return ["attention" if i in attention else "mamba" for i in range(int(config["num_hidden_layers"]))]


def _bamba_head_scale(config: dict[str, Any]) -> float:
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return float(head) ** -0.5


#: What mlx-lm's granitemoehybrid reads, computed from a Bamba config (KEY_VALUES["bamba"])
BAMBA_KEYS: dict[str, Any] = {
    "layer_types": _bamba_layer_types,
    "attention_multiplier": _bamba_head_scale,
    "embedding_multiplier": lambda _: 1.0,
    "residual_multiplier": lambda _: 1.0,
    "logits_scaling": lambda _: 1.0,
    "position_embedding_type": lambda _: "rope",
    "partial_rotary_factor": _bamba_rotary,
    "time_step_limit": time_step_limit,
}  # no num_local_experts: mlx-lm's dense GraniteMoeHybridMLP, a SwiGLU like Bamba's feed_forward

#: Bamba's weight names -> mlx-lm granitemoehybrid's (substrings of the dotted names)
BAMBA_RENAMES = {".feed_forward.": ".mlp.", ".pre_ff_layernorm.": ".post_attention_layernorm.",
                 "model.final_layernorm.": "model.norm."}


def bamba_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's tensors under mlx-lm granitemoehybrid's names."""
    out = {}
    for name, tensor in weights.items():
        for old, new in BAMBA_RENAMES.items():
            name = name.replace(old, new)
        out[name] = tensor
    return out


def _bamba_classes(config: dict[str, Any]) -> tuple[type, type]:
    from dataclasses import dataclass

    import mlx.nn as nn
    from mlx_lm.models import granitemoehybrid as gmh

    @dataclass
    class BambaArgs(gmh.ModelArgs):
        partial_rotary_factor: float = 0.5

    class Bamba(gmh.Model):
        def __init__(self, args: BambaArgs) -> None:
            super().__init__(args)
            head = args.hidden_size // args.num_attention_heads
            for layer in self.layers:
                if layer.layer_type == "attention":  # rotate the first part of each head only, as Bamba does
                    layer.self_attn.rope = nn.RoPE(int(head * args.partial_rotary_factor), traditional=False, base=args.rope_theta)

        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            return super().sanitize(bamba_weights(weights))

    return Bamba, BambaArgs


def load_bamba(model: str, model_config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's ``load`` for a local Bamba checkpoint: (model, tokenizer wrapper)."""
    return load_on_port("bamba", model, model_config, _bamba_classes)
