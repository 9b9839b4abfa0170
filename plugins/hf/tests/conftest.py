"""Shared fixtures: the real stories260K model, reached through a setting, never a fixed path.

``LMDOCK_MODELS`` names the folder of offline models; without it, the repository's ``lmdock.toml``
(whose own default is ``../shared/models``) says where stories260K is.  A missing model fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[3]

#: Facts from ../shared/models/README.md (an outside reference: it agrees with llama2.c's C engine).
PROMPT = "Once upon a time"
PROMPT_IDS = [1, 403, 407, 261, 378]
GREEDY_40 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
             419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]
GREEDY_40_TEXT = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."


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
