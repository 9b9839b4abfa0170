"""Facts about stories260K from ../shared/models/README.md, shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

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
