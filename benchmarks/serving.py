"""lmdock on transformers against transformers used directly.

1. Serving: 32 concurrent requests with mixed prompt (8-256 tokens) and output (16-256 tokens)
   lengths, through lmdock (continuous batching), against transformers ``generate`` one request at a
   time and against one left-padded static batch (which runs every row to the longest output).
2. Batch-1 and batch-8 decode: one request, and 8 requests with prompts of the same length (so
   ``generate``'s batch needs no padding, its best case), lmdock against transformers ``generate``.

Model: a random-weight Llama of about 100M parameters built with a fixed seed (benchmarks/_common.py).
Greedy decoding, EOS ignored, float32 on CPU.  Tokens/s counts the output tokens each request asked
for.  Run: ``HF_HUB_OFFLINE=1 python benchmarks/serving.py [--requests 32] [--threads N] [--decode-only]``.
"""

from __future__ import annotations

import argparse
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, 512) for _ in range(rng.randint(8, 256) - 1)], rng.randint(16, 256)) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--decode-only", action="store_true", help="only the batch-1 and batch-8 decode rows")
    args = ap.parse_args()

    import torch
    from _common import machine, random_llama, table, timed
    from lmdock import LLM, SamplingParams
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(random_llama())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    work = workload(args.requests)
    useful = sum(n for _, n in work)

    def hf_one(ids: list[int], n: int) -> None:
        t = torch.tensor([ids])
        with torch.inference_mode():
            model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    def hf_static() -> None:
        longest = max(len(ids) for ids, _ in work)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in work])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in work])
        n = max(k for _, k in work)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    rows = []
    with LLM(path, backend="hf", scheduler={"max_num_seqs": args.requests, "max_num_batched_tokens": 512}) as llm:
        greedy = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for _, n in work]
        llm.generate([work[0][0]], greedy[0])  # warm-up
        hf_one(work[0][0], 4)  # warm-up
        if not args.decode_only:
            t_lm, outs = timed(lambda: llm.generate([ids for ids, _ in work], greedy, use_tqdm=False))
            assert sum(len(o.outputs[0].token_ids) for o in outs) == useful
            t_one, _ = timed(lambda: [hf_one(ids, n) for ids, n in work])
            t_static, _ = timed(hf_static)
            rows += [
                ("serving: lmdock (continuous batching)", f"{useful / t_lm:,.1f}", "1.00"),
                ("serving: transformers, one at a time", f"{useful / t_one:,.1f}", f"{t_one / t_lm:.2f}"),
                ("serving: transformers, one padded static batch", f"{useful / t_static:,.1f}", f"{t_static / t_lm:.2f}"),
            ]
        prompt = work[0][0][:16]
        n = args.decode_tokens
        one = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
        t_lm1 = min(timed(lambda: llm.generate([prompt], one, use_tqdm=False))[0] for _ in range(3))
        t_hf1 = min(timed(lambda: hf_one(prompt, n))[0] for _ in range(3))
        rows += [
            (f"batch-1 decode ({n} tokens): lmdock", f"{n / t_lm1:,.1f}", "1.00"),
            (f"batch-1 decode ({n} tokens): transformers generate", f"{n / t_hf1:,.1f}", f"{t_hf1 / t_lm1:.2f}"),
        ]
        eight = [ids[:16] for ids, _ in work[:8]]
        batch = torch.tensor(eight)

        def hf_eight() -> None:
            with torch.inference_mode():
                model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n, min_new_tokens=n, do_sample=False)

        t_lm8 = min(timed(lambda: llm.generate(eight, one, use_tqdm=False))[0] for _ in range(3))
        t_hf8 = min(timed(hf_eight)[0] for _ in range(3))
        rows += [
            (f"batch-8 decode ({n} tokens each): lmdock", f"{8 * n / t_lm8:,.1f}", "1.00"),
            (f"batch-8 decode ({n} tokens each): transformers generate", f"{8 * n / t_hf8:,.1f}", f"{t_hf8 / t_lm8:.2f}"),
        ]
    print(f"model: random Llama, {params_m:.0f}M parameters, float32; {args.requests} requests, {useful} output tokens")
    print(f"machine: {machine()}")
    print(table(rows, ("run", "tokens/s", "lmdock speed-up (time ratio)")))


if __name__ == "__main__":
    main()
