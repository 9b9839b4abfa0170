"""Does an engine keep a zoo family's sliding window?  Its log-probabilities over a 63-token sequence
(the zoo's 40-token prompt and transformers' greedy continuation; a 40-token prefill, then one token at
a time, as decoding runs) against transformers' (float32, eager) with the window and with every layer
full.  The family tests compare greedy tokens only, and on the zoo's Gemma checkpoints the window
does not change them; this tells the two apart.  Needs torch and transformers beside the engine::

    python plugins/mlx/tools/window_logits.py ZOO mlx:gemma3_text mlx:gemma2 \\
        llamacpp:gemma2 llamacpp:gemma3_text --gguf GGUF_DIR   # contrib/llamacpp/tools/zoo_gguf.py's folder
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def transformers_logits(folder: Path, seq: list[int], window: bool) -> np.ndarray:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    cfg._attn_implementation = "eager"  # noqa: SLF001 - the zoo's reference is eager attention
    if not window:
        cfg.layer_types = ["full_attention"] * len(cfg.layer_types)
    model = AutoModelForCausalLM.from_pretrained(folder, config=cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].numpy()


def mlx_logits(folder: Path, seq: list[int], prefill: int) -> np.ndarray:
    import mlx.core as mx
    from lmdock_mlx._engine import config_overrides
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(folder), model_config=config_overrides(json.loads((folder / "config.json").read_text())))
    cache = make_prompt_cache(model)
    rows = [np.array(model(mx.array([seq[:prefill]]), cache=cache)[0])]
    rows += [np.array(model(mx.array([[t]]), cache=cache)[0]) for t in seq[prefill:]]
    return np.concatenate(rows)


def llamacpp_logits(gguf: Path, seq: list[int], prefill: int) -> np.ndarray:
    import llama_cpp

    # f32 KV cache and no flash attention, as lmdock-llamacpp runs a float32 file
    llm = llama_cpp.Llama(str(gguf), logits_all=True, verbose=False, n_ctx=128, type_k=0, type_v=0, flash_attn=False)
    llm.eval(seq[:prefill])
    for t in seq[prefill:]:
        llm.eval([t])
    return np.array(llm.scores[: len(seq)])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("zoo", type=Path)
    parser.add_argument("runs", nargs="+", help="ENGINE:FAMILY, ENGINE mlx or llamacpp")
    parser.add_argument("--gguf", type=Path, help="the zoo's GGUF folder (for llamacpp)")
    args = parser.parse_args()
    zoo = json.loads((args.zoo / "zoo.json").read_text())
    prompt = zoo["prompts"]["single"]
    for engine, family in (r.split(":") for r in args.runs):
        seq = (prompt + zoo["families"][family]["reference"][" ".join(map(str, prompt))]["tokens"])[:-1]
        if engine == "mlx":
            got = mlx_logits(args.zoo / family, seq, len(prompt))
        else:
            got = llamacpp_logits(args.gguf / f"{family}.gguf", seq, len(prompt))
        windowed, full = (log_softmax(transformers_logits(args.zoo / family, seq, w)) for w in (True, False))
        got = log_softmax(got)
        print(f"{engine} {family}: max |logprob - transformers with the window| {np.abs(got - windowed).max():.2e}, "
              f"without it {np.abs(got - full).max():.2e} (the window itself moves them by {np.abs(windowed - full).max():.2e})")


if __name__ == "__main__":
    main()
