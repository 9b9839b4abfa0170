"""Loading a checkpoint onto one of mlx-lm's ports with lmdock-mlx's own model classes.

mlx-lm's ``load`` builds the classes its ``model_type`` names; where the checkpoint's names or layout
differ from what that port reads (Bamba on granitemoehybrid, transformers 5's gpt2 and gpt-oss),
lmdock-mlx hands ``load_model`` subclasses whose ``sanitize`` translates the tensors in memory: the
user's folder is only read, never rewritten.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmdock import UnsupportedError


def load_on_port(family: str, model: str, model_config: dict[str, Any],
                 classes: Callable[[dict[str, Any]], tuple[type, type]]) -> tuple[Any, Any]:
    """mlx-lm's ``load`` for a local checkpoint of ``family`` built from ``classes(config)``:
    (model, tokenizer wrapper)."""
    from mlx_lm.utils import load_model, load_tokenizer

    path = Path(model)
    if not path.is_dir():
        raise UnsupportedError(f"{family} {model!r}: lmdock-mlx translates {family} checkpoints from a local folder; "
                               "download it first (huggingface-cli download) and give its path")
    net, config = load_model(path, model_config=model_config, get_model_classes=classes)
    return net, load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
