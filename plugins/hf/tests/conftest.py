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

from stories_facts import REPO, stories_path  # noqa: E402,F401


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
