"""lmdock-mlx against mlx-lm used directly, on the same model, in the same run.

Batch 1: one request (``mlx_lm.stream_generate`` vs ``LLM.generate``).  Batch 8: eight requests
(``mlx_lm.batch_generate`` vs ``LLM.generate`` on eight prompts).  Greedy, EOS ignored on both sides
(mlx-lm's tokenizer gets an empty EOS set), 128 new tokens per request, best of 3 runs.
Models: stories260K (``LMDOCK_MODELS``) and a random-weight Llama of about 100M parameters built
with MLX from a fixed seed and cached under ``~/.cache/lmdock/bench``.
Run: ``HF_HUB_OFFLINE=1 python benchmarks/mlx.py [--tokens 128]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# This file is named like the package it measures, and mlx is a namespace package, which any mlx.py
# on sys.path shadows: keep this folder off the path and load the shared helpers by file.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _common():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_common", _HERE / "_common.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def stories() -> Path:
    return Path(os.environ.get("LMDOCK_MODELS", Path(__file__).resolve().parents[2] / "shared" / "models")) / "stories260K"


def random_llama_mlx(seed: int = 0) -> Path:
    """A ~100M-parameter Llama with random weights, saved as a Hugging Face folder (MLX only)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    LLAMA_100M = _common().LLAMA_100M  # noqa: N806
    out = Path(os.environ.get("LMDOCK_BENCH_CACHE", Path.home() / ".cache" / "lmdock" / "bench")) / f"llama-100m-mlx-seed{seed}"
    if (out / "model.safetensors").is_file():
        return out
    mx.random.seed(seed)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "head_dim": 64, **LLAMA_100M}
    model = Model(ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    tmp = out.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(stories() / name, tmp / name)
    tmp.rename(out)
    return out


def best(fn, runs: int = 3) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench(path: Path, n_tokens: int) -> list[tuple[str, str, str, str]]:
    import mlx_lm
    from lmdock import LLM, SamplingParams

    model, tok = mlx_lm.load(str(path))
    tok.eos_token_ids = set()  # run every request to n_tokens, as lmdock does with ignore_eos
    prompts = [tok.encode(p) for p in ("Once upon a time", "The cat", "Lily and Tom", "One day", "The sun was", "A little dog", "Tim had a", "In the park")]

    def direct_1() -> None:
        for _ in mlx_lm.stream_generate(model, tok, prompts[0], max_tokens=n_tokens):
            pass

    def direct_8() -> None:
        mlx_lm.batch_generate(model, tok, prompts, max_tokens=n_tokens)

    rows = []
    params = SamplingParams(temperature=0, max_new_tokens=n_tokens, ignore_eos=True)
    with LLM(str(path), backend="mlx") as llm:
        llm.generate([prompts[0]], params)  # warm-up
        direct_1()
        for batch, direct in ((1, direct_1), (8, direct_8)):
            t_direct = best(direct)
            t_lm = best(lambda b=batch: llm.generate(prompts[:b], params, use_tqdm=False))
            tokens = batch * n_tokens
            rows.append((f"{path.name}, batch {batch}", f"{tokens / t_lm:,.0f}", f"{tokens / t_direct:,.0f}", f"{t_direct / t_lm:.2f}"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stories-only", action="store_true", help="skip the 100M model (minutes on a CPU)")
    args = ap.parse_args()
    import mlx.core as mx
    import mlx_lm

    table = _common().table
    rows = bench(stories(), args.tokens)
    if not args.stories_only:
        rows += bench(random_llama_mlx(), args.tokens)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} ({mx.default_device()}), mlx-lm {mlx_lm.__version__}")
    print(table(rows, ("model, requests", "lmdock tokens/s", "mlx-lm tokens/s", "lmdock / mlx-lm")), flush=True)


if __name__ == "__main__":
    main()
