"""Tiny checkpoint folders for lmdock-mlx's tests: given weights and config, with stories260K's tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest


def write_checkpoint(folder: Path, config: dict[str, Any], weights: dict[str, Any]) -> Path:
    """``folder`` holding ``weights`` (mlx arrays) as model.safetensors, ``config`` and stories260K's tokenizer."""
    import mlx.core as mx

    stories = Path(os.environ.get("LMDOCK_MODELS", "../shared/models")) / "stories260K"
    if not (stories / "tokenizer.json").is_file():
        pytest.fail("set LMDOCK_MODELS to the folder that holds stories260K")
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        if (stories / name).is_file():
            shutil.copy(stories / name, folder / name)
    return folder
