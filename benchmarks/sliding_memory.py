"""KV memory of sliding-window layers on lmdock-hf: window-only rings vs full layers vs transformers.

A Gemma-3-like random-weight model (``gemma3_text``, 5 sliding : 1 global layers, window 1024, 1 KV
head of 64 dims; small hidden size so it runs on a CPU) generates greedily to 8192 tokens per
sequence (a random 8128-token prompt, prefilled in 2048-token chunks, then 64 new tokens):

- ``rings``: lmdock-hf as it ships, each sliding layer's slots hold only its window (``lmdock_hf._window``);
- ``full``: the same engine with its slot cache swapped, before the first request, for one that keeps
  every position of every layer (what lmdock-hf did before the rings; its attention still applies
  the window, so the tokens are the same);
- ``transformers``: transformers' own ``generate`` (SDPA, float32) on the same prompts; its
  ``DynamicCache`` keeps the last ``window - 1`` positions of a sliding layer.

Printed per run: the KV bytes held per sequence (lmdock-hf: every allocated slot's bytes / slots;
transformers: its cache's tensors / batch), the ratios, and whether the three runs' tokens agree.
The ratio does not depend on the head sizes, only on the layer pattern, the window and the length.

Run: ``HF_HUB_OFFLINE=1 LMDOCK_MODELS=../shared/models python benchmarks/sliding_memory.py
[--seqs 1] [--length 8192] [--window 1024] [--new 64]``.  About 35 s of CPU time (a few minutes
of wall time on a busy 2-core machine), most of it transformers' 8k-token prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAYERS = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma 3's pattern (its 1B: 26 such layers)


def build(window: int, length: int) -> Path:
    """The random-weight checkpoint (once, under the benchmark cache) with stories260K's tokenizer."""
    from _common import models_dir
    from lmdock_conformance.zoo import random_model

    cache = Path(os.environ.get("LMDOCK_BENCH_CACHE", Path.home() / ".cache" / "lmdock" / "bench"))
    out = cache / f"gemma3-5to1-w{window}-ctx{length}-seed0"
    if (out / "model.safetensors").is_file():
        return out
    config = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": len(LAYERS),
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "query_pre_attn_scalar": 64,
              "sliding_window": window, "layer_types": LAYERS, "max_position_embeddings": length,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    tmp = out.with_suffix(".tmp")
    random_model("gemma3_text", config).save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        if (models_dir() / "stories260K" / name).is_file():
            shutil.copy(models_dir() / "stories260K" / name, tmp / name)
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    tmp.rename(out)
    return out


def lmdock_run(path: Path, prompts: list[list[int]], new: int, rings: bool) -> tuple[list[list[int]], int, float]:
    """(tokens, KV bytes per sequence, seconds) on lmdock-hf."""
    from lmdock import LLM, SamplingParams
    from lmdock_hf._cache import SlotKVCache

    with LLM(str(path), backend="hf", scheduler={"max_num_batched_tokens": 2048}, kv_cache={"enable_prefix_caching": False}) as llm:
        engine = llm.engine.engine
        if not rings:  # before any request: every layer keeps every position, the window applied by the mask only
            engine.kv_windows = {}
            engine.cache = SlotKVCache(engine.device, engine.dtype, engine.max_seq_len)
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True))
        seconds = time.perf_counter() - start
        per_seq = engine.cache.nbytes() // engine.cache.cap_slots  # every slot is laid out alike
    return [list(o.outputs[0].token_ids) for o in outs], per_seq, seconds


def transformers_run(path: Path, prompts: list[list[int]], new: int) -> tuple[list[list[int]], int, float]:
    """(tokens, KV bytes per sequence, seconds) from transformers' generate and its own cache."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    x = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0, return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    cache: Any = out.get("cache") or out.get("past_key_values")  # renamed in transformers 5.24
    held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    return out.sequences[:, x.shape[1]:].tolist(), held // len(prompts), seconds


def main() -> None:
    from _common import machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--length", type=int, default=8192, help="tokens per sequence: prompt + new")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    path = build(args.window, args.length)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(args.length - args.new - 1)] for _ in range(args.seqs)]
    print(machine())
    runs = {"rings": lmdock_run(path, prompts, args.new, rings=True),
            "full": lmdock_run(path, prompts, args.new, rings=False),
            "transformers": transformers_run(path, prompts, args.new)}
    mib = 1 << 20
    for name, (_, held, seconds) in runs.items():
        print(f"{name:>12}: {held / mib:8.2f} MiB of KV per {args.length}-token sequence ({seconds:.1f} s)")
    rings, full, hf = (runs[n][1] for n in ("rings", "full", "transformers"))
    sliding = LAYERS.count("sliding_attention")
    expected = len(LAYERS) * args.length / (sliding * min(args.window, args.length) + (len(LAYERS) - sliding) * args.length)
    print(f"full layers / window-only rings: {full / rings:.2f}x (the layer pattern gives {expected:.2f}x); "
          f"rings / transformers' DynamicCache: {rings / hf:.4f}")
    same = runs["rings"][0] == runs["full"][0] == runs["transformers"][0]
    print(f"tokens: rings == full == transformers: {same}")


if __name__ == "__main__":
    main()
