"""Helpers shared by the benchmark scripts: the random-weight model, the machine, the table."""

from __future__ import annotations

import os
import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: A Llama of about 100M parameters (speed does not depend on trained weights).  The vocabulary is
#: stories260K's, so its tokenizer serves and every generated id decodes.
LLAMA_100M = {
    "hidden_size": 768,
    "intermediate_size": 2560,
    "num_hidden_layers": 13,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def models_dir() -> Path:
    root = os.environ.get("LMDOCK_MODELS")
    if root is None:
        from lmdock import load_config

        return Path(load_config(Path(__file__).parents[1] / "lmdock.toml").model("stories").model).parent
    return Path(root)


def random_llama(seed: int = 0) -> Path:
    """Build (once, cached on disk) the random-weight Llama and return its folder."""
    cache = Path(os.environ.get("LMDOCK_BENCH_CACHE", Path.home() / ".cache" / "lmdock" / "bench"))
    out = cache / f"llama-100m-seed{seed}"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_100M)).eval()
    tmp = out.with_suffix(".tmp")
    model.save_pretrained(tmp)
    stories = models_dir() / "stories260K"
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(stories / name, tmp / name)
    tmp.rename(out)
    return out


def machine() -> str:
    import lmdock
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, lmdock {lmdock.__version__}, Python {platform.python_version()}"
    )


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def spawn(script: str, side: str, model: Path | str, tokens: int) -> dict[str, Any]:
    """Run ``script --worker SIDE --model MODEL --tokens N`` in a subprocess; return the JSON it
    prints after ``RESULT `` (each side of a benchmark gets a process of its own)."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, script, "--worker", side, "--model", str(model), "--tokens", str(tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{side} on {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([line, sep, *body])
