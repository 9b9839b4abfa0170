"""Reading a model's small JSON files (config.json, generation_config.json) for any backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_model_json(model: str, filename: str) -> dict[str, Any]:
    """``filename`` of a model: from a local folder, else from the Hugging Face cache for a hub id
    (when ``huggingface_hub`` is installed; nothing is downloaded).  ``{}`` when absent or unreadable."""
    path = Path(model) / filename
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return {}
        try:
            cached = try_to_load_from_cache(model, filename)
        except Exception:  # not a valid repo id
            return {}
        if not isinstance(cached, str):
            return {}
        path = Path(cached)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
