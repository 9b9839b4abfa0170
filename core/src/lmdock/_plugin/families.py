"""What a model needs of a backend beyond plain attention, told from its config alone.

A backend that runs a model whose layers it does not implement (a sliding window it ignores, a
recurrent state it cannot fork) gives different tokens without any error.  The core therefore reads
the model's features here, before loading (config.json with :mod:`json`, or a GGUF file's metadata),
and :mod:`lmdock._plugin.declare` refuses a model whose features the backend's spec lacks.  No torch,
numpy or transformers: ``lmdock`` stays light to import.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

#: The model-feature capabilities (each also in lmdock._plugin.contract.CAPABILITIES).
FEATURES = ("sliding_window", "attention_sinks", "logit_softcapping", "recurrent_state", "moe", "vision")

#: Layer types that are attention of some kind; any other (``mamba``, ``conv``, ``linear_attention``)
#: carries a recurrent state.
_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "attention", "chunked_attention", "global_attention", "local_attention"}
#: Families with a recurrent (SSM / conv) state whose configs do not always list layer types.
_RECURRENT_FAMILIES = {"mamba", "mamba2", "falcon_mamba", "falcon_h1", "bamba", "jamba", "zamba", "zamba2", "nemotron_h", "lfm2",
                       "lfm2_moe", "granitemoehybrid", "qwen3_next", "rwkv", "recurrent_gemma", "plamo2"}
#: Config keys only a recurrent (SSM / conv) layer has.
_RECURRENT_KEYS = ("mamba_d_state", "mamba_n_heads", "mamba_d_ssm", "ssm_state_size", "conv_L_cache", "linear_conv_kernel_dim",
                   "attn_layer_indices")
#: Families whose attention has learned sinks (a weight, not a config key).
_SINK_FAMILIES = {"gpt_oss"}
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ModelFeatures:
    """A model's family (``model_type``, or a GGUF architecture) and the features it needs, each with
    a short description of where it is ("a 16-token window on 2 of 4 layers")."""

    model_type: str
    features: Mapping[str, str] = field(default_factory=dict)
    #: the sliding window in tokens, where the model has one: a context no longer than it is never cut
    window: int | None = None

    def within(self, max_seq_len: int | None) -> ModelFeatures:
        """The features that matter for a context of at most ``max_seq_len`` tokens: no sliding window
        when the whole context fits in it (no token is ever further back than the window, so an engine
        that attends to everything computes what the windowed model computes)."""
        if self.window is None or max_seq_len is None or max_seq_len > self.window or "sliding_window" not in self.features:
            return self
        return ModelFeatures(self.model_type, {k: v for k, v in self.features.items() if k != "sliding_window"}, self.window)


def model_features(model: str) -> ModelFeatures | None:
    """The features of ``model`` (a folder or hub id with config.json, or a GGUF file); None when its
    config cannot be read here (a hub id not in the local cache)."""
    path = Path(model)
    if model.lower().endswith(".gguf") and path.is_file():
        return gguf_features(path)
    from lmdock._plugin.model_files import read_model_json

    cfg = read_model_json(model, "config.json")
    return config_features(cfg) if cfg else None


def config_features(cfg: Mapping[str, Any]) -> ModelFeatures:
    """The features a transformers config.json describes (the text config of a multimodal one)."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else cfg
    found: dict[str, str] = {}
    for name, probe in (("sliding_window", _window), ("attention_sinks", _sinks), ("logit_softcapping", _softcap),
                        ("recurrent_state", _recurrent), ("moe", _experts)):
        if detail := probe(text):
            found[name] = detail
    if isinstance(cfg.get("vision_config"), Mapping):  # an image encoder beside the text model (lmdock._llm.multimodal)
        found["vision"] = f"a vision encoder ({cfg['vision_config'].get('model_type') or cfg.get('model_type')})"
    window = text.get("sliding_window") if "sliding_window" in found else None
    return ModelFeatures(str(text.get("model_type") or cfg.get("model_type") or "unknown"), found, window)


def _window(cfg: Mapping[str, Any]) -> str:
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return ""
    limit = cfg.get("max_position_embeddings") or cfg.get("n_positions") or cfg.get("n_ctx")
    if isinstance(limit, int) and window >= limit:
        return ""  # a window as long as the model's context never cuts anything
    layers = cfg.get("layer_types")
    total = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    if isinstance(layers, list):
        sliding = sum(1 for t in layers if isinstance(t, str) and "sliding" in t)
        return f"a {window}-token sliding window on {sliding} of {len(layers)} layers" if sliding else ""
    if "use_sliding_window" in cfg:  # qwen2-style: a switch and the layers below max_window_layers kept full
        if not cfg.get("use_sliding_window"):
            return ""
        first = cfg.get("max_window_layers") or 0
        if isinstance(total, int) and first >= total:
            return ""
        return f"a {window}-token sliding window on the layers from {first}"
    return f"a {window}-token sliding window"


def _sinks(cfg: Mapping[str, Any]) -> str:
    return "learned attention sinks" if cfg.get("model_type") in _SINK_FAMILIES else ""


def _softcap(cfg: Mapping[str, Any]) -> str:
    caps = [f"{k}={cfg[k]}" for k in ("attn_logit_softcapping", "final_logit_softcapping") if cfg.get(k)]
    return f"logit soft-capping ({', '.join(caps)})" if caps else ""


def _recurrent(cfg: Mapping[str, Any]) -> str:
    layers = cfg.get("layer_types") or cfg.get("layers_block_type")
    if isinstance(layers, list):
        kinds = sorted({t for t in layers if isinstance(t, str) and t not in _ATTENTION_LAYERS})
        if kinds:
            return f"recurrent-state layers ({', '.join(kinds)}: {sum(t in kinds for t in layers)} of {len(layers)})"
    if cfg.get("model_type") in _RECURRENT_FAMILIES or any(k in cfg for k in _RECURRENT_KEYS):
        return "recurrent-state (SSM / convolution) layers"
    return ""


def _experts(cfg: Mapping[str, Any]) -> str:
    for key in _EXPERT_KEYS:
        n = cfg.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return f"mixture-of-experts layers ({n} experts)"
    return ""


# -------------------------------------------------------------------------------------------------
# GGUF: the metadata header only (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
# -------------------------------------------------------------------------------------------------

#: GGUF architecture names that differ from the transformers model_type of the same family.
_GGUF_FAMILIES = {"gpt-oss": "gpt_oss", "falcon-h1": "falcon_h1", "granitehybrid": "granitemoehybrid", "qwen3moe": "qwen3_moe",
                  "qwen2moe": "qwen2_moe", "qwen3next": "qwen3_next", "gemma3": "gemma3_text"}
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_features(path: str | Path) -> ModelFeatures | None:
    """The features a GGUF file's metadata declares; None when it is not a readable GGUF."""
    try:
        meta = read_gguf_metadata(path)
    except (OSError, ValueError, struct.error):
        return None
    arch = str(meta.get("general.architecture") or "unknown")
    def get(key: str) -> Any:
        return meta.get(f"{arch}.{key}")
    cfg: dict[str, Any] = {"model_type": _GGUF_FAMILIES.get(arch, arch)}
    if isinstance(w := get("attention.sliding_window"), int) and w > 0:
        cfg.update(sliding_window=w, max_position_embeddings=get("context_length"))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cfg[key] = get(key)
    if isinstance(n := get("expert_count"), int):
        cfg["num_experts"] = n
    found = {k: d for k, d in config_features(cfg).features.items()}
    if any(k.startswith((f"{arch}.ssm.", f"{arch}.shortconv.", f"{arch}.rwkv")) for k in meta) and "recurrent_state" not in found:
        found["recurrent_state"] = "recurrent-state (SSM / convolution) layers"
    return ModelFeatures(cfg["model_type"], found, cfg.get("sliding_window") if "sliding_window" in found else None)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (arrays are skipped, not kept)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, _tensors, count = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old")
        meta: dict[str, Any] = {}
        for _ in range(count):
            key = _gguf_string(f)
            meta[key] = _gguf_value(f, struct.unpack("<I", f.read(4))[0])
        return meta


def _gguf_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", "replace")


def _gguf_value(f: BinaryIO, kind: int) -> Any:
    if kind in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[kind]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind == _GGUF_STRING:
        return _gguf_string(f)
    if kind == _GGUF_ARRAY:
        item, n = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SCALARS:
            f.seek(n * struct.calcsize(_GGUF_SCALARS[item]), 1)
        else:
            for _ in range(n):
                _gguf_value(f, item)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")
