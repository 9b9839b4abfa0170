"""transformers 5's GPT-2 checkpoints on mlx-lm's gpt2 port.

Why: mlx-lm's port was written for the original checkpoint, whose tensors are named ``h.0.attn...``,
``wte``, ``wpe``; transformers 5 writes them under ``transformer.`` (``transformer.h.0.attn...``), so
mlx-lm's ``sanitize`` neither transposes the Conv1D weights nor finds them (the load fails).  The port
also fixes two things a config may set otherwise: the feed-forward width (``4 * n_embd``; transformers
reads ``n_inner``) and tied embeddings (transformers unties them with ``tie_word_embeddings = false``
and an ``lm_head``).  :func:`load_gpt2` builds the port with both from the config and strips the
prefix in memory.

What the port computes otherwise is refused: attention not scaled by ``head_dim**-0.5``
(``scale_attn_weights = false``, ``scale_attn_by_inverse_layer_idx``) and activations other than
GELU's tanh approximation (mlx-lm's ``gelu_approx``).
"""

from __future__ import annotations

from typing import Any

from lmdock import UnsupportedError

from lmdock_mlx._ports import load_on_port

#: transformers' names of GELU's tanh approximation, which mlx-lm's port computes (nn.gelu_approx)
TANH_GELU = frozenset({"gelu_new", "gelu_pytorch_tanh"})


def check_gpt2(config: dict[str, Any]) -> None:
    """Refuse what mlx-lm's gpt2 port computes otherwise than transformers."""
    act = config.get("activation_function", "gelu_new")
    if act not in TANH_GELU:
        raise UnsupportedError(f"gpt2 with activation_function={act!r}: mlx-lm's port computes GELU's tanh approximation "
                               f"({', '.join(sorted(TANH_GELU))}); use backend = 'hf'")
    if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx", False):
        raise UnsupportedError("gpt2 with scale_attn_weights = false or scale_attn_by_inverse_layer_idx = true: mlx-lm's port "
                               "scales attention by head_dim**-0.5 only; use backend = 'hf'")


def gpt2_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's tensors under the original checkpoint's names, which mlx-lm's sanitize reads."""
    return {name.removeprefix("transformer."): tensor for name, tensor in weights.items()}


def _gpt2_classes(config: dict[str, Any]) -> tuple[type, type]:
    from dataclasses import dataclass

    import mlx.nn as nn
    from mlx_lm.models import gpt2

    @dataclass
    class GPT2Args(gpt2.ModelArgs):
        n_inner: int | None = None
        tie_word_embeddings: bool = True

    class MLP(nn.Module):
        def __init__(self, width: int, inner: int) -> None:
            super().__init__()
            self.c_fc = nn.Linear(width, inner)
            self.c_proj = nn.Linear(inner, width)

        def __call__(self, x: Any) -> Any:
            return self.c_proj(nn.gelu_approx(self.c_fc(x)))

    class GPT2(gpt2.Model):
        def __init__(self, args: GPT2Args) -> None:
            super().__init__(args)
            for block in self.model.h:
                block.mlp = MLP(args.n_embd, args.n_inner or 4 * args.n_embd)
            if not args.tie_word_embeddings:
                self.lm_head = nn.Linear(args.n_embd, args.vocab_size, bias=False)

        def __call__(self, inputs: Any, cache: Any = None) -> Any:
            out = self.model(inputs, cache)
            return self.lm_head(out) if "lm_head" in self else self.model.wte.as_linear(out)

        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            head = weights.pop("lm_head.weight", None)  # tied: transformers reads wte, whatever is saved here
            out = super().sanitize(gpt2_weights(weights))
            if "lm_head" in self and head is not None:
                out["lm_head.weight"] = head
            return out

    check_gpt2(config)
    return GPT2, GPT2Args


def load_gpt2(model: str, model_config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's ``load`` for a local GPT-2 checkpoint written by transformers (or the original names)."""
    return load_on_port("gpt2", model, model_config, _gpt2_classes)
