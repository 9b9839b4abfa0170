"""transformers 5's gpt-oss checkpoints on mlx-lm's gpt_oss port.

Why: mlx-lm's ``sanitize`` reads the original checkpoint's experts (MXFP4 ``gate_up_proj_blocks``, or
tensors it had already split into ``gate_proj.weight``); transformers 5 writes each layer's experts as
two stacked tensors, ``experts.gate_up_proj`` of shape (experts, hidden, 2 * intermediate) whose
columns alternate gate and up (``GptOssExperts._apply_gate``: ``gate_up[..., ::2]``,
``gate_up[..., 1::2]``), and ``experts.down_proj`` of shape (experts, intermediate, hidden), both
multiplied from the right (``x @ W``).  mlx-lm's SwitchGLU holds (experts, out, in) weights:
:func:`expert_weights` splits the columns and transposes, in memory.

transformers' YaRN with ``truncate = false`` (what transformers 5 writes for gpt-oss) ramps between
the exact correction dimensions, where mlx-lm's YarnRoPE always rounds them (``floor`` / ``ceil``):
:func:`yarn_freqs` recomputes the rotary frequencies untruncated.  The attention sinks and the
sliding layers' window mlx-lm's port keeps as transformers does (a RotatingKVCache of the window per
sliding layer); the family tests check both past the window.

What the port fixes otherwise is refused: its SwiGLU's alpha and clamp are constants (1.702, 7.0), and
its attention projections always have biases.
"""

from __future__ import annotations

import math
from typing import Any

from lmdock import UnsupportedError

from lmdock_mlx._ports import load_on_port

#: what mlx-lm's gpt-oss port hard-codes: {config key: value}
FIXED = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True}


def check_gpt_oss(config: dict[str, Any]) -> None:
    """Refuse what mlx-lm's gpt_oss port computes otherwise than transformers."""
    for key, value in FIXED.items():
        if key in config and config[key] != value:
            raise UnsupportedError(f"gpt_oss with {key}={config[key]!r}: mlx-lm's port fixes it at {value!r}; use backend = 'hf'")


def expert_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's stacked expert tensors as mlx-lm's SwitchGLU holds them (other tensors unchanged)."""
    import mlx.core as mx

    out = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition("experts.")
        if not prefix and not name.startswith("experts."):
            out[name] = tensor
        elif leaf == "gate_up_proj":  # (E, hidden, 2I), gate and up columns alternating
            out[f"{prefix}experts.gate_proj.weight"] = mx.contiguous(tensor[..., ::2].swapaxes(-1, -2))
            out[f"{prefix}experts.up_proj.weight"] = mx.contiguous(tensor[..., 1::2].swapaxes(-1, -2))
        elif leaf == "gate_up_proj_bias":
            out[f"{prefix}experts.gate_proj.bias"] = mx.contiguous(tensor[..., ::2])
            out[f"{prefix}experts.up_proj.bias"] = mx.contiguous(tensor[..., 1::2])
        elif leaf == "down_proj":  # (E, I, hidden)
            out[f"{prefix}experts.down_proj.weight"] = mx.contiguous(tensor.swapaxes(-1, -2))
        elif leaf == "down_proj_bias":
            out[f"{prefix}experts.down_proj.bias"] = tensor
        else:
            out[name] = tensor
    return out


def _transformers_layout(weights: dict[str, Any]) -> bool:
    return any(name.endswith("experts.gate_up_proj") for name in weights)


def yarn_freqs(dims: int, scaling: dict[str, Any], base: float) -> Any:
    """mx.fast.rope's ``freqs`` (the inverse of transformers' inv_freq) for YaRN with an untruncated
    correction range (transformers' ``_compute_yarn_parameters`` with ``truncate = false``)."""
    import mlx.core as mx

    def correction_dim(rotations: float) -> float:
        return dims * math.log(scaling["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(correction_dim(scaling.get("beta_fast") or 32), 0)
    high = min(correction_dim(scaling.get("beta_slow") or 1), dims - 1)
    if low == high:
        high += 0.001  # as transformers does
    extrapolate = 1 - mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    wavelength = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inv_freq = 1 / (scaling["factor"] * wavelength) * (1 - extrapolate) + 1 / wavelength * extrapolate
    return 1 / inv_freq


def _untruncated(scaling: Any) -> bool:
    return isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("truncate") is False


def _gpt_oss_classes(config: dict[str, Any]) -> tuple[type, type]:
    from mlx_lm.models import gpt_oss

    check_gpt_oss(config)

    class GptOss(gpt_oss.Model):
        def __init__(self, args: gpt_oss.ModelArgs) -> None:
            super().__init__(args)
            if _untruncated(args.rope_scaling):
                freqs = yarn_freqs(args.head_dim, args.rope_scaling, args.rope_theta)
                for layer in self.layers:
                    layer.self_attn.rope._freqs = freqs

        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            return expert_weights(weights) if _transformers_layout(weights) else super().sanitize(weights)

    return GptOss, gpt_oss.ModelArgs


def load_gpt_oss(model: str, model_config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's ``load`` for a local gpt-oss checkpoint written by transformers 5 (or the original layout)."""
    return load_on_port("gpt_oss", model, model_config, _gpt_oss_classes)
