"""Config keys lmdock-hf honours, exercised (docs/tests/audit.md points here).

``[models.NAME] revision`` reaches transformers: a hub cache made on disk (Hugging Face's layout:
``models--ORG--NAME/refs/REF`` holding a commit, ``snapshots/COMMIT/`` the files), read offline; the
weights of stories260K go in one snapshot and a copy with one weight changed in another, so the
revision picked is seen in the output.  ``build.device``: cpu runs there, a device torch lacks is
refused naming the key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from stories_facts import GREEDY_40_TEXT, PROMPT


def _snapshot(cache: Path, ref: str, commit: str, source: Path, scale_head: float | None = None) -> None:
    repo = cache / "models--lmdock-test--stories"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    snap = repo / "snapshots" / commit
    shutil.copytree(source, snap)
    if scale_head is not None:  # a different model under this commit: the output shows which was loaded
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(snap / "model.safetensors"))
        key = next(k for k in tensors if k.endswith("layers.0.mlp.down_proj.weight"))
        tensors[key] = tensors[key] * scale_head
        save_file(tensors, str(snap / "model.safetensors"), metadata={"format": "pt"})


def test_revision_picks_the_snapshot_transformers_loads(stories: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdock import LLM

    cache = tmp_path / "hub"
    _snapshot(cache, "main", "a" * 40, Path(stories))
    _snapshot(cache, "other", "b" * 40, Path(stories), scale_head=-3.0)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variables once, at its import: an earlier test in this process may
    # have imported it already, so its constants are set too (transformers reads them at each load)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    import transformers.utils.hub as hub  # transformers 4.x loads from its own copy, taken at its import

    monkeypatch.setattr(hub, "TRANSFORMERS_CACHE", str(cache), raising=False)
    greedy = {"temperature": 0.0, "max_tokens": 40}
    with LLM("lmdock-test/stories", backend="hf") as llm:
        assert llm.generate(PROMPT, greedy)[0].outputs[0].text == GREEDY_40_TEXT
    with LLM("lmdock-test/stories", backend="hf", revision="other") as llm:
        assert llm.model_config.revision == "other"
        assert llm.generate(PROMPT, greedy)[0].outputs[0].text != GREEDY_40_TEXT


def test_build_device_cpu_runs_there_and_a_device_torch_lacks_is_refused_naming_the_key(stories: str) -> None:
    import torch
    from lmdock import LLM, ConfigError

    with LLM(stories, backend="hf", build={"device": "cpu"}) as llm:
        assert llm.generate(PROMPT, {"temperature": 0.0, "max_tokens": 40})[0].outputs[0].text == GREEDY_40_TEXT
    with pytest.raises(ConfigError, match=r"build.device: 'nonsense' is not a torch device"):
        LLM(stories, backend="hf", build={"device": "nonsense"})
    if not torch.cuda.is_available():  # where there is one, cuda is a device (hardware decides, not the test)
        with pytest.raises(ConfigError, match=r"build.device: 'cuda': this torch has no cuda device here"):
            LLM(stories, backend="hf", build={"device": "cuda"})


def test_kv_cache_dtype_other_than_the_models_is_refused_naming_it(stories: str) -> None:
    """lmdock-hf keeps its KV cache in the model's dtype: ``kv_cache.dtype = "int8"`` (vLLM's
    ``kv_cache_dtype``) was silently run in float32; it is refused, and ``auto`` or ``build.dtype``'s
    own value run."""
    from lmdock import LLM, UnsupportedError

    with pytest.raises(UnsupportedError, match=r"kv_cache.dtype 'int8': lmdock-hf keeps the KV cache in the model's dtype"):
        LLM(stories, backend="hf", kv_cache={"dtype": "int8"})
    with LLM(stories, backend="hf", build={"dtype": "float32"}, kv_cache={"dtype": "float32"}) as llm:
        assert llm.generate(PROMPT, {"temperature": 0.0, "max_tokens": 40})[0].outputs[0].text == GREEDY_40_TEXT
