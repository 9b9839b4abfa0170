"""Sampled decoding at a real vocabulary: lmdock-hf against transformers ``generate(do_sample=True)``.

Model: a tiny random Llama (hidden 64, 2 layers) with Qwen 2.5/3's vocabulary of 151,936 tokens, built
with a fixed seed and cached (``$LMDOCK_BENCH_CACHE``, default ``~/.cache/lmdock/bench``): its forward
is small beside the vocabulary, so what is timed is mostly the step around it and the sampling.
Batch 8 of 16-token token-id prompts, ``--tokens`` tokens each (EOS ignored, no detokenization),
float32 on CPU.  Sampling: temperature 0.8, top-p 0.9, repetition penalty 1.1 (a chat model's
``generation_config.json``); the greedy runs of the same shapes give each side's cost without it.

Printed per side, best of ``--rounds`` interleaved rounds: wall seconds greedy and sampled, and the
sampling's own cost (sampled - greedy) per sequence per step; then lmdock's cost over transformers'.
lmdock runs with its default sampler (``[backends.hf] sampler = "auto"``: the reference sampler on the
CPU, the torch sampler on an accelerator), with ``sampler = "torch"`` (the device sampler) and with
``sampler = "reference"`` (the core's NumPy sampler: on an accelerator the logits cross to the host).
``--device cuda`` runs both sides' model on the GPU (float32); ``--batch N`` decodes N sequences at once.
Run: ``HF_HUB_OFFLINE=1 python benchmarks/sampling.py [--tokens 32] [--rounds 3] [--threads N] [--device cuda] [--batch 8]``.
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
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where both sides run the model (float32 on both)")
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences decoded together")
    args = ap.parse_args()

    import torch
    from _common import machine, table, timed
    from lmdock import LLM, SamplingParams
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(tiny_llama())
    n = args.tokens
    size = args.batch
    prompts = [[1] + [3 + (17 * i + 5 * j) % 500 for j in range(15)] for i in range(size)]
    batch = torch.tensor(prompts, device=args.device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    knobs = {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.1}

    def hf(sample: bool) -> None:
        extra = {"do_sample": True, "top_k": 0, **knobs} if sample else {"do_sample": False}
        with torch.inference_mode():
            model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n, min_new_tokens=n, **extra)
        if batch.is_cuda:
            torch.cuda.synchronize()

    greedy = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, detokenize=False)
    sampled = [SamplingParams(seed=i, max_new_tokens=n, ignore_eos=True, detokenize=False, **knobs) for i in range(size)]
    build = {"device": args.device, "dtype": "float32"}
    engines = {mode: LLM(path, backend="hf", build=build, backends={"hf": {"sampler": mode}}, scheduler={"max_num_seqs": size})
               for mode in ("auto", "torch", "reference")}
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
    per = size * n  # sequence-steps

    def cost(side: str) -> float:
        return (best[f"{side} sampled"] - best[f"{side} greedy"]) / per

    hf_cost = cost("transformers")
    rows = []
    for side in ("lmdock auto", "lmdock torch", "lmdock reference", "transformers"):
        c = cost(side)
        rows.append((side, f"{per / best[side + ' greedy']:,.0f}", f"{per / best[side + ' sampled']:,.0f}",
                     f"{c * 1e3:.2f}", f"{c / hf_cost:.2f}"))
    print(f"model: tiny random Llama, vocabulary {VOCAB:,}; batch {size}, {n} tokens each, on {args.device}; "
          f"best of {args.rounds} interleaved rounds")
    print(f"machine: {machine()}")
    print(table(rows, ("side", "greedy tok/s", "sampled tok/s", "sampling ms per seq per step", "cost / transformers'")))


if __name__ == "__main__":
    main()
