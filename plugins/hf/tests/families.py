"""Tiny random-weight checkpoints of transformers' model families, and transformers' greedy reference.

Each family is built from its transformers config (``AutoConfig.for_model``) with a fixed seed, head
dim 32, windows of 16 (smaller than the test sequences), hybrids mixing attention with SSM / conv
layers.  Weights are re-drawn wider than the default initialisation (2-D weights std 0.15,
embeddings 1.0) so greedy choices are not near-ties.  The tokenizer is stories260K's (vocab 512,
bos 1, eos 2).  A family the installed transformers does not know is not built (``None``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

WINDOW = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")

_BASE: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
}
_ALT = ["sliding_attention", "full_attention"] * 2
_MOE = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}

#: model_type -> config fields past the shared ones
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
    "qwen2-nowindow": {"use_sliding_window": False, "sliding_window": WINDOW},
    "qwen3": {},
    "qwen3_moe": {**_MOE, "decoder_sparse_step": 1},
    "mixtral": {**_MOE, "sliding_window": None},
    "gemma2": {"sliding_window": WINDOW, "layer_types": _ALT, "attn_logit_softcapping": 20.0,
               "final_logit_softcapping": 15.0, "query_pre_attn_scalar": 32},
    "gemma3_text": {"sliding_window": WINDOW, "num_hidden_layers": 6, "query_pre_attn_scalar": 32,
                    "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
    "phi3": {"sliding_window": WINDOW, "pad_token_id": 0},
    "gpt2": {"n_embd": 64, "n_layer": 4, "n_head": 2, "n_positions": 512},
    "gpt_oss": {**_MOE, "sliding_window": WINDOW, "layer_types": _ALT},
    "olmo2": {},
    "granite": {},
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
                  "mamba_n_groups": 1, "mamba_chunk_size": 16, "mamba_d_conv": 4, "mamba_expand": 2},
    "bamba": {"attn_layer_indices": [1, 3], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
              "mamba_n_groups": 1, "mamba_chunk_size": 16, "mamba_d_conv": 4, "mamba_expand": 2},
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "conv_L_cache": 3,
             "block_ff_dim": 96, "block_auto_adjust_ff_dim": False},
    "granitemoehybrid": {**_MOE, "layer_types": ["mamba", "attention", "mamba", "attention"],
                         "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1,
                         "mamba_chunk_size": 16, "mamba_d_conv": 4, "mamba_expand": 2, "shared_intermediate_size": 64},
    "qwen3_next": {**_MOE, "layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "linear_conv_kernel_dim": 4, "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1},
}


def model_type(family: str) -> str:
    return family.split("-")[0]


def known(family: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type(family) in CONFIG_MAPPING


def build(family: str, root: Path, tokenizer_from: Path, seed: int = 0) -> Path | None:
    """Write the family's checkpoint under ``root/family``; None when transformers lacks the family."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not known(family):
        return None
    out = root / family
    if (out / "config.json").exists():
        return out
    config = AutoConfig.for_model(model_type(family), **{**_BASE, **FAMILIES[family]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _widen(model)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


@torch.no_grad()
def _widen(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "embed" in name or "wte" in name or "wpe" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif p.dim() >= 2 and "conv" not in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def reference(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' own greedy generate (float32, eager), one prompt at a time: the tokens, and per
    token the margin between the top two logits (a divergence at a margin < 1e-3 is a tie)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in gen.scores]
        out.append((gen.sequences[0, len(ids):].tolist(), margins))
    return out


def same_up_to_ties(ours: list[int], ref: tuple[list[int], list[float]], tie: float = 1e-3) -> bool:
    """Equal tokens, or equal up to a first divergence where the reference's top two were tied."""
    tokens, margins = ref
    for i, (a, b) in enumerate(zip(ours, tokens)):
        if a != b:
            return margins[i] < tie
    return len(ours) == len(tokens)
