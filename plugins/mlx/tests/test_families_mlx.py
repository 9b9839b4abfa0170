"""What lmdock-mlx does for the model families of lmdock-conformance's zoo beyond passing config keys
(test_config_keys.py): Gemma 2's sequences decode each in its own cache, since its attention cannot
take a merged BatchKVCache's mask (the family tests refuse Gemma 2 for its window, so they do not
reach this)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from _checkpoints import write_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: two query heads per key/value head: mlx-lm's Gemma 2 then reshapes its queries to five dimensions
GEMMA2 = {"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 512, "query_pre_attn_scalar": 32,
          "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2}
PROMPTS = [[1, 403, 407, 261], [1, 378, 317], [1, 430, 261, 5, 7], [1, 90]]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Gemma 2 in mlx-lm's own format, with stories260K's tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma2

    folder = tmp_path_factory.mktemp("gemma2")
    mx.random.seed(38)
    model = gemma2.Model(gemma2.ModelArgs.from_dict(GEMMA2))
    weights = {k: (mx.random.normal(v.shape) * (1.0 if "embed" in k else 0.15)) if v.ndim >= 2 else v
               for k, v in tree_flatten(model.parameters())}
    return write_checkpoint(folder, GEMMA2, weights)


def _greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``prompts`` prefilled together, then ``n`` decode steps with every sequence in one step."""
    from lmdock import ModelConfig
    from lmdock.backend import SeqChunk
    from lmdock_mlx._engine import MlxStepEngine

    engine = MlxStepEngine.load(ModelConfig(model=str(folder)), None, None, {"max_seq_len": 256})
    tokens = [list(p) for p in prompts]
    last = engine.step([SeqChunk(s, p, 0) for s, p in enumerate(prompts)]).last
    for _ in range(n):
        for s in range(len(tokens)):
            tokens[s].append(int(np.argmax(np.array(last[s]))))
        last = engine.step([SeqChunk(s, [tokens[s][-1]], len(tokens[s]) - 1) for s in range(len(tokens))]).last
    assert engine.group_ids == []  # no merged cache
    return tokens


def test_gemma2_sequences_decoding_together_give_each_ones_tokens(gemma2: Path) -> None:
    together = _greedy(gemma2, PROMPTS, 12)
    alone = [_greedy(gemma2, [p], 12)[0] for p in PROMPTS]
    assert together == alone
