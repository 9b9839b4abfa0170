"""lmdock-hf offload on a GPU: a random-weight bfloat16 Llama, batch 64, greedy tokens of each
placement compared with lmdock-hf in memory, and tok/s (docs/backends/hf.md records one run on an H200).

Needs an NVIDIA GPU; the tokenizer files come from ``$LMDOCK_MODELS/stories260K`` or ``./tok``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    from lmdock import LLM, SamplingParams

    folder = tempfile.mkdtemp()
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    tok = Path(__file__).parent / "tok"
    if not tok.is_dir():
        tok = Path(os.environ["LMDOCK_MODELS"]) / "stories260K"
    for f in tok.glob("*token*"):
        shutil.copy(f, folder)
    print("gpu:", torch.cuda.get_device_name(0), torch.__version__, flush=True)
    sp = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True, detokenize=False)
    prompts = [[1] + [(i * 37 + j) % 31000 + 100 for j in range(8)] for i in range(64)]
    reference = None
    placements = [
        ("in-memory", None),
        ("gpu50-disk50", {"weights_gpu_percent": 50, "weights_cpu_percent": 0}),
        ("disk100", {"weights_gpu_percent": 0, "weights_cpu_percent": 0}),
        ("disk100-compress", {"weights_gpu_percent": 0, "weights_cpu_percent": 0, "compress_weight": True}),
    ]
    for name, policy in placements:
        try:
            extra = {"offload": policy} if policy else {}
            llm = LLM(folder, backend="hf", build={"device": "cuda", "dtype": "bfloat16", "max_seq_len": 64}, scheduler={"max_num_seqs": 64}, **extra)
            llm.generate(prompts[:2], sp)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = llm.generate(prompts, sp)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tokens = [list(o.outputs[0].token_ids) for o in out]
            reference = reference or tokens
            stats = llm._engine.engine.stats() if policy else {}
            print(name, f"batch 64: {64 * 32 / dt:.1f} tok/s", "equal to in-memory:", tokens == reference, stats, flush=True)
            llm.shutdown()
        except Exception as exc:  # noqa: BLE001 - report every placement
            traceback.print_exc()
            print(name, "FAILED", exc, flush=True)


if __name__ == "__main__":
    main()
