"""Sampled decoding at a real vocabulary: lmdock-hf against transformers ``generate(do_sample=True)``.

Model: a tiny random Llama (hidden 64, 2 layers) with Qwen 2.5/3's vocabulary of 151,936 tokens, built
with a fixed seed and cached (``$LMDOCK_BENCH_CACHE``, default ``~/.cache/lmdock/bench``): its forward
is small beside the vocabulary, so what is timed is mostly the step around it and the sampling.
Batch 8 of 16-token token-id prompts, ``--tokens`` tokens each (EOS ignored, no detokenization),
float32 on CPU.  Sampling: temperature 0.8, top-p 0.9, repetition penalty 1.1 (a chat model's
``generation_config.json``); the greedy runs of the same shapes give each side's cost without it.

Printed per side, best of ``--rounds`` interleaved rounds: wall seconds greedy and sampled, and the
sampling's own cost (sampled - greedy) per sequence per step; then lmdock's cost over transformers'.
lmdock runs with its default sampler on the CPU (``[backends.hf] sampler = "auto"``: the reference
sampler) and with ``sampler = "torch"`` (the device sampler, here on the CPU).
Run: ``HF_HUB_OFFLINE=1 python benchmarks/sampling.py [--tokens 32] [--rounds 3] [--threads N]``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 151_936
BATCH = 8
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": VOCAB, "max_position_embeddings": 512, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def tiny_llama(seed: int = 0) -> Path:
    """Build (once, cached on disk) the tiny random Llama with the 151,936-token vocabulary (prompts are
    token ids: its stories260K tokenizer is never asked)."""
    from _common import random_llama

    return random_llama(seed, TINY, f"llama-tiny-v{VOCAB}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()

    import torch
    from _common import machine, table, timed
    from lmdock import LLM, SamplingParams
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(tiny_llama())
    n = args.tokens
    prompts = [[1] + [3 + (17 * i + 5 * j) % 500 for j in range(15)] for i in range(BATCH)]
    batch = torch.tensor(prompts)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    knobs = {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.1}

    def hf(sample: bool) -> None:
        extra = {"do_sample": True, "top_k": 0, **knobs} if sample else {"do_sample": False}
        with torch.inference_mode():
            model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n, min_new_tokens=n, **extra)

    greedy = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, detokenize=False)
    sampled = [SamplingParams(seed=i, max_new_tokens=n, ignore_eos=True, detokenize=False, **knobs) for i in range(BATCH)]
    engines = {mode: LLM(path, backend="hf", backends={"hf": {"sampler": mode}}, scheduler={"max_num_seqs": BATCH}) for mode in ("auto", "torch")}
    try:
        runs: dict[str, list[float]] = {}
        for llm in engines.values():
            llm.generate(prompts, greedy, use_tqdm=False)  # warm-up
        hf(False)
        for _ in range(args.rounds):  # interleaved: every side once per round
            for mode, llm in engines.items():
                runs.setdefault(f"lmdock {mode} greedy", []).append(timed(lambda llm=llm: llm.generate(prompts, greedy, use_tqdm=False))[0])
                runs.setdefault(f"lmdock {mode} sampled", []).append(timed(lambda llm=llm: llm.generate(prompts, sampled, use_tqdm=False))[0])
            runs.setdefault("transformers greedy", []).append(timed(lambda: hf(False))[0])
            runs.setdefault("transformers sampled", []).append(timed(lambda: hf(True))[0])
    finally:
        for llm in engines.values():
            llm.shutdown()
    best = {k: min(v) for k, v in runs.items()}
    per = BATCH * n  # sequence-steps

    def cost(side: str) -> float:
        return (best[f"{side} sampled"] - best[f"{side} greedy"]) / per

    hf_cost = cost("transformers")
    rows = []
    for side in ("lmdock auto", "lmdock torch", "transformers"):
        c = cost(side)
        rows.append((side, f"{BATCH * n / best[side + ' greedy']:,.0f}", f"{BATCH * n / best[side + ' sampled']:,.0f}",
                     f"{c * 1e3:.2f}", f"{c / hf_cost:.2f}"))
    print(f"model: tiny random Llama, vocabulary {VOCAB:,}; batch {BATCH}, {n} tokens each; best of {args.rounds} interleaved rounds")
    print(f"machine: {machine()}")
    print(table(rows, ("side", "greedy tok/s", "sampled tok/s", "sampling ms per seq per step", "cost / transformers'")))


if __name__ == "__main__":
    main()
