"""LoRA adapters on lmdock-hf: a batch that mixes adapters against the same requests grouped by adapter.

8 requests over 4 adapters (two each; rank 16 on q/v/o of every layer, random weights from fixed
seeds), 64-token prompts, 64 greedy tokens each.  "mixed": all 8 submitted together, so each decode
step runs every adapter's rows in one forward (lmdock-hf's per-row low-rank add).  "grouped": one
adapter's requests at a time (what an engine that cannot mix adapters in a batch must do, as
llama.cpp).  "base": the 8 requests with no adapter (the add's own cost).  Each side runs once as a
warm-up, then ``--repeat`` times in turn (round robin); the best run counts.  Prints generated tokens per second and the
ratios, and checks that mixed and grouped give the same tokens.

Model: the random-weight ~100M Llama of benchmarks/_common.py, float32.
Run: ``HF_HUB_OFFLINE=1 python benchmarks/lora.py [--tokens 64] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ADAPTERS = 4
REQUESTS = 8


def main() -> None:
    from _common import machine, random_llama, table, timed
    from lmdock import LLM, LoRARequest, SamplingParams
    from lmdock_conformance._models import lora_adapter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = random_llama()
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(args.prompt - 1)] for _ in range(REQUESTS)]
    params = SamplingParams(temperature=0, max_new_tokens=args.tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"a{i}", lora_adapter(model, Path(tmp) / f"a{i}", seed=i, rank=16)) for i in range(ADAPTERS)]
        per_request = [loras[i % ADAPTERS] for i in range(REQUESTS)]
        with LLM(str(model), backend="hf", kv_cache={"enable_prefix_caching": False}, scheduler={"max_num_seqs": REQUESTS}) as llm:

            def mixed() -> list[list[int]]:
                return [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=per_request)]

            def grouped() -> list[list[int]]:
                out: dict[int, list[int]] = {}
                for lora in loras:
                    idx = [i for i in range(REQUESTS) if per_request[i] is lora]
                    for i, o in zip(idx, llm.generate([prompts[i] for i in idx], params, lora_request=lora)):
                        out[i] = o.outputs[0].token_ids
                return [out[i] for i in range(REQUESTS)]

            def base() -> list[list[int]]:
                return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

            sides = {"mixed": mixed, "grouped": grouped, "base": base}
            tokens = {name: fn() for name, fn in sides.items()}  # warm-up: adapters loaded, layers wrapped
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(args.repeat):  # round robin, so a busy moment of the machine hits every side alike
                for name, fn in sides.items():
                    times[name].append(timed(fn)[0])
            results = {name: (min(times[name]), tokens[name]) for name in sides}
    total = REQUESTS * args.tokens
    rows = [(name, f"{secs:.2f}", f"{total / secs:.0f}") for name, (secs, _) in results.items()]
    print(machine())
    print(f"{REQUESTS} requests over {ADAPTERS} adapters (rank 16, q/v/o), {args.prompt}-token prompts, {args.tokens} tokens each, best of {args.repeat}\n")
    print(table(rows, ("run", "seconds", "tokens/s")))
    mixed_s, grouped_s, base_s = (results[k][0] for k in ("mixed", "grouped", "base"))
    print(f"\nmixed vs grouped: {grouped_s / mixed_s:.2f}x the throughput; mixed vs base: {base_s / mixed_s:.2f}x "
          f"(the adapters' cost); same tokens mixed and grouped: {results['mixed'][1] == results['grouped'][1]}")


if __name__ == "__main__":
    main()
