"""Tiny random-weight checkpoints of transformers families, and transformers' own greedy tokens.

Seeded; 2-D weights re-drawn with std 0.15 (embeddings 1.0) so greedy choices are not near-ties;
windows of 16, under the 40-token prompts; head_dim 32; stories260K's tokenizer (vocab 512).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

SEED = 38
WINDOW = 16
BASE: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 512,
                        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_groups": 1,
          "mamba_chunk_size": 16}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1}),
    "gpt_oss": ("gpt_oss", {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 4,
                            "num_experts_per_tok": 2, "intermediate_size": 64}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                          "query_pre_attn_scalar": 32, "tie_word_embeddings": True}),
    "bamba": ("bamba", {**_MAMBA, "attn_layer_indices": [1]}),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"], "block_ff_dim": 128, "block_auto_adjust_ff_dim": False,
                      "tie_word_embeddings": True}),
}
#: stories260K token ids of "Once upon a time, there was a little girl named Lily. She loved to play..."
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. One day"


def build(family: str, target: Path, tokenizer: Path) -> Any:
    """Write the checkpoint to ``target``; return the (float32, eager) transformers model."""
    from lmdock_conformance.zoo import random_model

    model_type, overrides = FAMILIES[family]
    model = random_model(model_type, {**BASE, **overrides}, SEED)
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, target / name)
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    return model


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of ``prompt`` (no stop at eos)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
