"""Bamba on vLLM's Granite 4 hybrid layers (vLLM dropped its own Bamba model after 0.23).

Bamba is the architecture IBM's Granite 4 hybrids (``GraniteMoeHybrid``) grew from: the same Mamba-2
mixer and the same attention layers, with a plain SwiGLU feed-forward and no multipliers.  vLLM's
``GraniteMoeHybridForCausalLM`` with no experts, a shared MLP the size of Bamba's, every multiplier
at 1 and the attention scaled by ``head_dim ** -0.5`` computes Bamba's function exactly; what differs
is the checkpoint's names, translated here as the weights stream in:

====================================  ==========================================
Bamba (transformers)                  vLLM's GraniteMoeHybrid
====================================  ==========================================
``model.final_layernorm``             ``model.norm``
``layers.N.pre_ff_layernorm``         ``layers.N.post_attention_layernorm``
``layers.N.feed_forward.gate_proj``   ``layers.N.shared_mlp.input_linear`` (first half)
``layers.N.feed_forward.up_proj``     ``layers.N.shared_mlp.input_linear`` (second half)
``layers.N.feed_forward.down_proj``   ``layers.N.shared_mlp.output_linear``
====================================  ==========================================

The config keys the Granite model reads and Bamba's config lacks come as vLLM ``hf_overrides``
(:func:`hf_overrides`, through ``_config_drift``).  vLLM finds the class by the architecture name:
:func:`register` adds it to vLLM's model registry, from lmdock's load and from vLLM's
``vllm.general_plugins`` entry point (so an engine core vLLM spawns in a fresh process has it too),
and only where the installed vLLM has no Bamba of its own.  The family tests check the tokens
against transformers' Bamba (docs/model-families.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from lmdock import ModelConfig, UnsupportedError
from lmdock.backend import read_model_json

ARCHITECTURE = "BambaForCausalLM"
_RENAMES = (
    ("model.final_layernorm.", "model.norm."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    (".feed_forward.down_proj.", ".shared_mlp.output_linear."),
)


def hf_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """The Granite hybrid's config keys, at the values that make its layers Bamba's."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        return {}
    return {
        "position_embedding_type": "rope",
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "logits_scaling": 1.0,
        "attention_multiplier": (hidden // heads) ** -0.5,  # Bamba scales by head_dim ** -0.5
        "shared_intermediate_size": config.get("intermediate_size"),
        "num_local_experts": 0,
    }


def unsupported(config: dict[str, Any]) -> str | None:
    """Why vLLM's Granite layers cannot hold this Bamba checkpoint (``None`` where they can)."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    head_dim = config.get("head_dim")
    if isinstance(hidden, int) and isinstance(heads, int) and heads and head_dim not in (None, hidden // heads):
        # vLLM's Granite attention sizes its heads as hidden_size / num_attention_heads
        return f"head_dim {head_dim} is not hidden_size / num_attention_heads ({hidden} / {heads})"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config.get('hidden_act')!r}: vLLM's Granite feed-forward is SwiGLU (silu) only"
    if config.get("mlp_bias"):
        return "mlp_bias: vLLM's Granite feed-forward has no biases"
    return None


def prepare(mc: ModelConfig) -> None:
    """Before vLLM starts on a Bamba checkpoint: refuse one the Granite layers cannot hold, and
    register the model class (an engine core vLLM forks inherits the registry)."""
    config = read_model_json(mc.model, "config.json")
    if ARCHITECTURE not in (config.get("architectures") or []):
        return
    reason = unsupported(config)
    if reason is not None:
        raise UnsupportedError(f"{mc.model}: this Bamba checkpoint does not fit vLLM's Granite 4 hybrid layers, which "
                               f"lmdock-vllm runs Bamba on: {reason}; use backend = 'hf'")
    register()


def register() -> None:
    """Add Bamba to vLLM's model registry, unless the installed vLLM has its own.

    vLLM's ``vllm.general_plugins`` entry point calls this in every process vLLM starts; lmdock's load
    calls it too.  The class is named by its module path, so nothing here imports vLLM's model code."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "lmdock_vllm._bamba_model:BambaForCausalLM")


def renamed(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Bamba's checkpoint tensors under the Granite model's names; each layer's gate and up
    projections are joined (gate first) into the one ``input_linear`` the Granite MLP holds."""
    import torch

    halves: dict[str, dict[str, Any]] = {}
    for name, tensor in weights:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        for half in ("gate_proj", "up_proj"):
            marker = f".feed_forward.{half}."
            if marker in name:
                fused = name.replace(marker, ".shared_mlp.input_linear.")
                pair = halves.setdefault(fused, {})
                pair[half] = tensor
                if len(pair) == 2:
                    del halves[fused]
                    yield fused, torch.cat([pair["gate_proj"], pair["up_proj"]], dim=0)
                break
        else:
            yield name, tensor
    if halves:  # a gate without its up projection (or the reverse): a broken checkpoint
        raise ValueError(f"Bamba checkpoint: feed-forward halves without their pair: {sorted(halves)}")
