"""Shared fixtures: the real stories260K model, reached through a setting, never a fixed path.

``LMDOCK_MODELS`` names the folder of offline models; without it, the repository's ``lmdock.toml``
(whose own default is ``../shared/models``) says where stories260K is.  A missing model fails.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from stories_facts import REPO  # noqa: E402


def stories_path() -> str:
    from lmdock import load_config

    path = load_config(REPO / "lmdock.toml").model("stories").model
    if not Path(path, "config.json").is_file():
        pytest.fail(f"stories260K not found at {path}: set LMDOCK_MODELS to the folder that holds it")
    return path


@pytest.fixture(scope="session")
def stories() -> str:
    return stories_path()


@pytest.fixture(scope="session")
def llm(stories: str) -> Iterator[object]:
    from lmdock import LLM

    with LLM(stories, backend="hf", scheduler={"max_num_seqs": 16}) as engine:
        yield engine


@pytest.fixture(scope="session")
def hf_model(stories: str) -> object:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories, dtype=torch.float32).eval()
    return model
