"""Model features read from a config (lmdock._plugin.families) and refused at load where the backend's spec
lacks them (FAKE engines; the real per-family runs are lmdock-conformance's test_families)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeStepEngine
from lmdock import LLM, UnsupportedError
from lmdock._plugin import manager as _plugins
from lmdock._plugin.families import FEATURES, config_features, gguf_features, model_features
from lmdock.backend import CAPABILITIES, Backend, BackendSpec

# Abridged from the config.json transformers 5 writes for each family (the keys the probes read).
MISTRAL = {"model_type": "mistral", "sliding_window": 16, "max_position_embeddings": 512, "num_hidden_layers": 2}
QWEN2_FULL = {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 16, "max_window_layers": 2,
              "layer_types": ["full_attention"] * 4, "max_position_embeddings": 512, "num_hidden_layers": 4}
QWEN2_SLIDING = {**QWEN2_FULL, "use_sliding_window": True, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2}
GEMMA2 = {"model_type": "gemma2", "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2,
          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "max_position_embeddings": 512}
GPT_OSS = {"model_type": "gpt_oss", "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
           "num_local_experts": 4, "max_position_embeddings": 512}
LFM2 = {"model_type": "lfm2", "layer_types": ["conv", "full_attention", "conv", "full_attention"], "max_position_embeddings": 512}
BAMBA = {"model_type": "bamba", "attn_layer_indices": [1], "mamba_d_state": 16, "num_hidden_layers": 2}
MIXTRAL = {"model_type": "mixtral", "sliding_window": None, "num_local_experts": 4, "max_position_embeddings": 512}
LLAMA = {"model_type": "llama", "max_position_embeddings": 512, "num_hidden_layers": 5}


@pytest.mark.parametrize(("cfg", "expected"), [
    (LLAMA, set()),
    (MISTRAL, {"sliding_window"}),
    (QWEN2_FULL, set()),  # transformers 5 writes sliding_window even where use_sliding_window is off
    (QWEN2_SLIDING, {"sliding_window"}),
    (GEMMA2, {"sliding_window", "logit_softcapping"}),
    (GPT_OSS, {"sliding_window", "attention_sinks", "moe"}),
    (LFM2, {"recurrent_state"}),
    (BAMBA, {"recurrent_state"}),
    (MIXTRAL, {"moe"}),
    ({**MISTRAL, "sliding_window": 512}, set()),  # a window as long as the context is no window
    ({"model_type": "gemma3", "text_config": {**GEMMA2, "model_type": "gemma3_text", "attn_logit_softcapping": None,
                                               "final_logit_softcapping": None}}, {"sliding_window"}),
    # a vision-language model (LLaVA): its vision tower is a feature of its own
    ({"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"}, "text_config": {**MISTRAL, "sliding_window": None}},
     {"vision"}),
])
def test_features_are_read_from_the_config(cfg: dict[str, Any], expected: set[str]) -> None:
    found = config_features(cfg)
    assert set(found.features) == expected
    assert found.model_type == (cfg.get("text_config") or cfg)["model_type"]
    assert set(FEATURES) <= set(CAPABILITIES)


def test_the_description_says_where_the_feature_is() -> None:
    assert config_features(QWEN2_SLIDING).features["sliding_window"] == "a 16-token sliding window on 2 of 4 layers"
    assert "2 of 4" in config_features(LFM2).features["recurrent_state"]
    assert "4 experts" in config_features(MIXTRAL).features["moe"]


def _gguf(path: Path, meta: dict[str, Any]) -> Path:
    """A GGUF header with ``meta`` (strings, uint32s, float32s and one string array) and no tensors."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()
    body = b""
    for key, value in meta.items():
        body += string(key)
        if isinstance(value, str):
            body += struct.pack("<I", 8) + string(value)
        elif isinstance(value, float):
            body += struct.pack("<If", 6, value)
        elif isinstance(value, list):
            body += struct.pack("<IIQ", 9, 8, len(value)) + b"".join(string(v) for v in value)
        else:
            body += struct.pack("<II", 4, value)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(meta)) + body)
    return path


def test_gguf_metadata_gives_the_features(tmp_path: Path) -> None:
    gemma = _gguf(tmp_path / "g.gguf", {"general.architecture": "gemma2", "tokenizer.ggml.tokens": ["a", "b"],
                                        "gemma2.context_length": 512, "gemma2.attention.sliding_window": 16,
                                        "gemma2.final_logit_softcapping": 30.0})
    assert set(gguf_features(gemma).features) == {"sliding_window", "logit_softcapping"}
    hybrid = _gguf(tmp_path / "h.gguf", {"general.architecture": "granitehybrid", "granitehybrid.ssm.state_size": 16,
                                         "granitehybrid.expert_count": 4})
    found = model_features(str(hybrid))
    assert found.model_type == "granitemoehybrid" and set(found.features) == {"recurrent_state", "moe"}
    assert gguf_features(tmp_path / "nothing.gguf") is None


def test_the_stories_gguf_needs_no_feature() -> None:
    folder = Path(os.environ.get("LMDOCK_MODELS", "/work/shared/models")) / "stories260K-gguf"
    files = sorted(folder.glob("*.gguf"))
    if not files:
        pytest.skip(f"no GGUF in {folder}")
    found = gguf_features(files[0])
    assert found is not None and found.model_type == "llama" and not found.features


def _model(tmp_path: Path, cfg: dict[str, Any]) -> str:
    folder = tmp_path / cfg["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _register(name: str, loads: list[str], **spec: Any) -> None:
    spec.setdefault("supports", frozenset({"generate"}))
    s = BackendSpec(name=name, kind="step", plugin_api="1.0", description="FAKE test backend", **spec)
    _plugins.get_registry().add_plugin(Backend(s, load=lambda *a: loads.append(name) or FakeStepEngine()), name)


def test_a_model_needing_a_lacked_feature_is_refused_before_loading(isolated: Path) -> None:
    loads: list[str] = []
    _register("plain", loads, lacks={"sliding_window": "it attends to the whole context"})
    _register("full", loads, supports=frozenset({"generate", "sliding_window", "logit_softcapping"}))
    with pytest.raises(UnsupportedError) as info:
        LLM(_model(isolated, GEMMA2), backend="plain")
    message = str(info.value)
    for part in ("gemma2 model", "16-token sliding window", "lacks 'sliding_window'", "it attends to the whole context", "backend = 'full'"):
        assert part in message, message
    assert loads == []
    with LLM(_model(isolated, LLAMA), backend="plain"):  # a model that needs nothing loads
        pass
    with LLM(str(isolated / "gemma2"), backend="full"):
        pass
    assert loads == ["plain", "full"]


def test_a_family_refused_by_name_and_a_feature_supported_for_one_family(isolated: Path) -> None:
    loads: list[str] = []
    _register("picky", loads, lacks={"sliding_window": "it ignores windows"}, refuses_families={"lfm2": "its config keys are not read"},
              family_support={"sliding_window": frozenset({"gemma3_text"})})
    with pytest.raises(UnsupportedError, match=r"lfm2 model, which backend 'picky' refuses: its config keys are not read"):
        LLM(_model(isolated, LFM2), backend="picky")
    with pytest.raises(UnsupportedError, match="lacks 'sliding_window': it ignores windows"):
        LLM(_model(isolated, MISTRAL), backend="picky")
    with LLM(_model(isolated, {**MISTRAL, "model_type": "gemma3_text"}), backend="picky"):
        pass
    assert loads == ["picky"]


def test_a_model_whose_config_cannot_be_read_is_left_to_the_engine(isolated: Path) -> None:
    loads: list[str] = []
    _register("plain", loads, lacks={"sliding_window": "no"})
    with LLM("some-org/not-in-any-cache", backend="plain"):
        pass
    assert loads == ["plain"]


def test_a_context_capped_at_the_window_needs_no_window(isolated: Path) -> None:
    """No token of a context at most the window long is further back than the window, so a backend that
    attends to everything computes the windowed model exactly; the refusal says so."""
    loads: list[str] = []
    _register("plain", loads, lacks={"sliding_window": "it attends to the whole context"})
    mistral = _model(isolated, MISTRAL)
    with pytest.raises(UnsupportedError, match=r"lacks 'sliding_window'.*build\.max_seq_len = 16 or less"):
        LLM(mistral, backend="plain")
    with pytest.raises(UnsupportedError, match="lacks 'sliding_window'"):
        LLM(mistral, backend="plain", build={"max_seq_len": 17})
    with LLM(mistral, backend="plain", build={"max_seq_len": 16}):
        pass
    assert loads == ["plain"]
    # the cap lifts the window only: Gemma 2's soft-capping is still needed
    with pytest.raises(UnsupportedError, match="lacks 'logit_softcapping'"):
        LLM(_model(isolated, GEMMA2), backend="plain", build={"max_seq_len": 8})
    assert config_features(MISTRAL).within(16).features == {} and config_features(MISTRAL).within(None).window == 16
