"""Automatic prefix caching on lmdock-hf: requests that share a long prompt prefix.

32 requests share a 256-token prefix (a system prompt, a few-shot header) and differ in a 16-token
suffix; each asks for 16 greedy tokens.  They are submitted together, once with
``kv_cache.enable_prefix_caching = false`` and once with it on (the default), each in its own process,
after the same warm-up request (with another prefix, so the cache starts cold: the first requests'
prompts fill it while the later ones wait for admission, as under real load).  Prints the mean and
p50 time to first token, the total time, the prompt tokens served from the cache, and whether the
outputs are identical.

Model: the random-weight ~100M Llama of benchmarks/_common.py, float32 on CPU.
Run: ``HF_HUB_OFFLINE=1 python benchmarks/prefix_cache.py [--requests 32] [--prefix 256]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def workload(requests: int, prefix: int, suffix: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, 512) for _ in range(prefix - 1)]
    return [shared + [rng.randrange(3, 512) for _ in range(suffix)] for _ in range(requests)]


def worker(caching: bool, args: argparse.Namespace) -> None:
    from _common import random_llama
    from lmdock import LLM, SamplingParams

    prompts = workload(args.requests, args.prefix, args.suffix)
    params = SamplingParams(temperature=0, max_new_tokens=args.tokens, ignore_eos=True)
    with LLM(str(random_llama()), backend="hf", kv_cache={"enable_prefix_caching": caching},
             scheduler={"max_num_seqs": args.requests, "max_num_batched_tokens": 2048}) as llm:
        llm.generate([workload(1, args.prefix, args.suffix, seed=1)[0][:args.prefix] + prompts[0][-args.suffix:]], params)  # warm-up
        first: dict[int, float] = {}
        start = time.perf_counter()

        def watch(i: int) -> list[int]:
            out = None
            for out in llm.stream(prompts[i], params):
                if i not in first and out.outputs and out.outputs[0].token_ids:
                    first[i] = time.perf_counter() - start
            return out.outputs[0].token_ids

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.requests) as pool:
            outputs = list(pool.map(watch, range(args.requests)))
        total = time.perf_counter() - start
        hits = llm.engine.stats().get("prefix_cache_hit_tokens", 0)
    ttft = sorted(first.values())
    print("RESULT " + json.dumps({"ttft_mean": statistics.mean(ttft), "ttft_p50": statistics.median(ttft), "total": total,
                                   "hit_tokens": hits, "outputs": outputs}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--worker", choices=["on", "off"])
    args = ap.parse_args()
    if args.worker:
        worker(args.worker == "on", args)
        return
    results = {}
    for side in ("off", "on"):
        cmd = [sys.executable, __file__, "--worker", side, "--requests", str(args.requests), "--prefix", str(args.prefix),
               "--suffix", str(args.suffix), "--tokens", str(args.tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
        results[side] = json.loads(lines[-1][len("RESULT "):])
    off, on = results["off"], results["on"]
    print(f"{args.requests} requests, {args.prefix}-token shared prefix + {args.suffix}-token suffixes, {args.tokens} new tokens each")
    print(f"{'caching':<8} {'TTFT mean s':>12} {'TTFT p50 s':>11} {'total s':>9} {'prompt tokens from cache':>25}")
    for side in ("off", "on"):
        r = results[side]
        print(f"{side:<8} {r['ttft_mean']:>12.2f} {r['ttft_p50']:>11.2f} {r['total']:>9.2f} {r['hit_tokens']:>25}")
    print(f"speed-up: TTFT {off['ttft_mean'] / on['ttft_mean']:.2f}x, total {off['total'] / on['total']:.2f}x; "
          f"outputs identical: {off['outputs'] == on['outputs']}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
