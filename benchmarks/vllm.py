"""lmdock-vllm against ``vllm.LLM.generate`` used directly, on the same model and workload, in one run.

Each side runs in its own subprocess (two vLLM engines do not share one process well), with the
same engine settings: float32, max_num_seqs 32, max_num_batched_tokens 2048, prefix caching on,
the same KV-cache size.  Workloads: batch 1 (one request) and 32 requests with different prompts,
greedy, EOS ignored, 128 new tokens per request; best of 3 timed runs after one warm-up.
Models: stories260K-hd32 (``LMDOCK_MODELS``) and a random-weight Llama of about 100M parameters
(``benchmarks/_common.py``, cached under ``~/.cache/lmdock/bench``).
Scale-out: lmdock-vllm with ``build.tensor_parallel_size = 2`` (two ranks, vLLM's multiprocessing
executor) against the same lmdock-vllm with one rank, same workloads, same run (``--no-tp`` skips it).
Run: ``HF_HUB_OFFLINE=1 python benchmarks/vllm.py [--tokens 128] [--stories-only] [--no-tp | --tp-only]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# This file is named like the package it measures: keep its folder off sys.path so that
# ``import vllm`` finds vLLM, and load the shared helpers by file.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

ENGINE = {"dtype": "float32", "max_num_seqs": 32, "max_num_batched_tokens": 2048, "enable_prefix_caching": True}
WORDS = ["Once upon a time", "The little dog", "One day, a girl", "Tom and Sue", "The sun was", "A big red ball", "Lily wanted", "In the park"]


def _common():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_common", _HERE / "_common.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def prompts(n: int) -> list[str]:
    return [f"{WORDS[i % len(WORDS)]} {'and ' * (i // len(WORDS))}".strip() for i in range(n)]


def worker(side: str, model: str, tokens: int) -> dict[str, float]:  # noqa: C901 - one branch per side
    """Load one engine, time both workloads; returns tokens/s by workload."""
    t0 = time.perf_counter()
    if side == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model, **ENGINE)
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

        def run(batch: list[str]) -> int:
            outs = llm.generate(batch, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
    else:
        import lmdock

        tp = 2 if side == "lmdock-tp2" else 1
        llm = lmdock.LLM(
            model, backend="vllm", build={"dtype": ENGINE["dtype"], "tensor_parallel_size": tp}, kv_cache={"enable_prefix_caching": ENGINE["enable_prefix_caching"]},
            scheduler={"max_num_seqs": ENGINE["max_num_seqs"], "max_num_batched_tokens": ENGINE["max_num_batched_tokens"]},
        )
        params = lmdock.SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)

        def run(batch: list[str]) -> int:
            outs = llm.generate(batch, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

    result = {"start_s": time.perf_counter() - t0}
    for name, batch in (("batch 1", prompts(1)), ("32 requests", prompts(32))):
        run(batch)  # warm-up
        best = min(_timed(run, batch) for _ in range(3))
        result[name] = best
    return result


def _timed(run, batch: list[str]) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    n = run(batch)
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stories-only", action="store_true", help="skip the 100M-parameter model")
    ap.add_argument("--no-tp", action="store_true", help="skip tensor parallel 2 against 1")
    ap.add_argument("--tp-only", action="store_true", help="only tensor parallel 2 against 1, on the 100M model")
    ap.add_argument("--worker", choices=["vllm", "lmdock", "lmdock-tp2"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.model, args.tokens)), flush=True)
        return

    common = _common()
    models = [common.models_dir() / "stories260K-hd32"]
    if not args.stories_only:
        models.append(common.random_llama())
    from lmdock_vllm import installed_build

    build = " ".join(installed_build() or ("vllm", "?"))
    print(f"# {common.machine()}, {build}; {args.tokens} new tokens per request, greedy, EOS ignored, best of 3\n")
    rows, tp_rows = [], []
    for model in models:
        if args.tp_only and model == models[0]:
            continue
        ours = common.spawn(__file__, "lmdock", model, args.tokens)
        direct = ours if args.tp_only else common.spawn(__file__, "vllm", model, args.tokens)
        for workload in ("batch 1", "32 requests"):
            rows.append((model.name, workload, f"{ours[workload]:,.0f}", f"{direct[workload]:,.0f}", f"{ours[workload] / direct[workload]:.2f}x"))
        rows.append((model.name, "engine start (s)", f"{ours['start_s']:.1f}", f"{direct['start_s']:.1f}", ""))
        if not args.no_tp and model != models[0]:  # the 100M model: stories260K is too small to split
            tp2 = common.spawn(__file__, "lmdock-tp2", model, args.tokens)
            for workload in ("batch 1", "32 requests"):
                tp_rows.append((model.name, workload, f"{tp2[workload]:,.0f}", f"{ours[workload]:,.0f}", f"{tp2[workload] / ours[workload]:.2f}x"))
            tp_rows.append((model.name, "engine start (s)", f"{tp2['start_s']:.1f}", f"{ours['start_s']:.1f}", ""))
    if not args.tp_only:
        print(common.table(rows, ("model", "workload", "lmdock-vllm tok/s", "vllm.LLM tok/s", "ratio")))
    if tp_rows:
        print("\n# tensor_parallel_size = 2 against 1 (lmdock-vllm, the same run)\n")
        print(common.table(tp_rows, ("model", "workload", "TP=2 tok/s", "TP=1 tok/s", "ratio")))


if __name__ == "__main__":
    main()
