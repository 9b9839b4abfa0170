"""What a model's config asks of lmdock-hf beyond plain causal attention, and what it refuses.

- sliding windows: per layer from ``layer_types`` and ``sliding_window`` (``max_window_layers`` and
  Qwen 2's ``use_sliding_window`` are folded into ``layer_types`` by the configs that have them);
  Mistral and Phi-3 window every layer (:func:`windows`).  lmdock's attention
  (``lmdock_hf._attention``) applies them and the slot cache keeps only each sliding layer's window
  (``lmdock_hf._window``), so a windowed model needs it (``attn_implementation = "auto"``).
- recurrent state (SSM / conv layers of hybrids): kept per slot (``lmdock_hf._states``) through
  transformers 5's linear-attention ``Cache`` API; older transformers has no such API here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmdock import UnsupportedError

_ATTENTION_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}
_RECURRENT_MODEL_TYPES = {"mamba", "mamba2", "falcon_mamba", "falcon_h1", "bamba", "jamba", "zamba", "zamba2", "lfm2",
                          "lfm2_moe", "granitemoehybrid", "qwen3_next", "nemotron_h", "plamo2", "recurrent_gemma"}


@dataclass(frozen=True)
class Family:
    name: str
    windowed: bool
    recurrent: bool


def inspect(config: Any) -> Family:
    cfg = config.get_text_config()
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None) or []
    window = getattr(cfg, "sliding_window", None)
    if not window:
        windowed = False
    elif getattr(cfg, "layer_types", None) is not None:
        windowed = "sliding_attention" in cfg.layer_types
    else:
        windowed = bool(getattr(cfg, "use_sliding_window", True))
    recurrent = cfg.model_type in _RECURRENT_MODEL_TYPES or any(t not in _ATTENTION_TYPES for t in types)
    return Family(str(cfg.model_type), windowed, recurrent)


def windows(config: Any) -> dict[int, int]:
    """Layer index -> window of every sliding-window attention layer (none: an empty dict).

    The layers transformers' own ``DynamicCache`` makes sliding (``get_layer_types_and_kwargs``):
    ``sliding_attention`` in ``layer_types``; without ``layer_types``, every layer of a config with a
    ``sliding_window`` (Mistral, Phi-3; Qwen 2's ``use_sliding_window = false`` turns it off).
    ``chunked_attention`` (Llama 4) is not a sliding window and stays a full layer here.
    """
    cfg = config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    if not inspect(config).windowed or not isinstance(window, int) or window <= 0:
        return {}
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return dict.fromkeys(range(int(cfg.num_hidden_layers)), window)
    return {i: window for i, t in enumerate(types) if t == "sliding_attention"}


def check(family: Family, model: str, attn: str) -> None:
    """Refuse at load what lmdock-hf would run differently from transformers."""
    if family.windowed and attn != "auto":
        raise UnsupportedError(
            f"{model!r} ({family.name}) has sliding-window attention layers, which lmdock-hf applies in its own "
            f"attention function; attn_implementation={attn!r} would attend past the window. Use attn_implementation = \"auto\""
        )
    if family.recurrent and not states_api():
        import transformers

        raise UnsupportedError(
            f"{model!r} ({family.name}) has recurrent (SSM / conv) layers; lmdock-hf keeps their state per sequence "
            f"through transformers' linear-attention Cache API (get_conv_state, get_recurrent_state: 5.21 and later), "
            f"and the hybrid models of transformers {transformers.__version__} read their states from the cache's layers "
            "directly instead: upgrade transformers (pip install -U 'transformers>=5.21')"
        )


def states_api() -> bool:
    """Whether the installed transformers' hybrid models read conv / recurrent states only through the
    Cache API that ``BatchView`` implements.  Before 5.21 (4.x, and 5.x up to 5.20) the models reach into
    ``cache_params.layers[i].conv_states`` themselves, which a per-slot view cannot serve (an IndexError at
    the first decode step on transformers 5.17 on a GPU machine, 2026-11-27)."""
    from transformers.cache_utils import Cache

    return hasattr(Cache, "get_conv_state")
